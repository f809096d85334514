"""Sources: a checkpoint folder or a Hugging Face repo id, read lazily and validated before use.

Every safetensors header is parsed and checked here (JSON, dtypes, offsets inside the file, sizes that
match the shapes), and every path an index names is confined to the checkpoint, before any tensor is
read. Tensors are then read one at a time (or one chunk of experts at a time) with ``pread`` into a
fresh buffer: nothing is mapped, so the resident memory of a conversion is what it holds, not the
pages of the model it has touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "moeconvert.json"

#: safetensors dtype code -> (bytes per element, torch dtype or None when torch has no such dtype)
DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "I16": (2, torch.int16),
    "U16": (2, getattr(torch, "uint16", None)),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "U32": (4, getattr(torch, "uint32", None)),
    "F32": (4, torch.float32),
    "I64": (8, torch.int64),
    "U64": (8, getattr(torch, "uint64", None)),
    "F64": (8, torch.float64),
    "F8_E4M3": (1, getattr(torch, "float8_e4m3fn", None)),
    "F8_E5M2": (1, getattr(torch, "float8_e5m2", None)),
    "F8_E8M0": (1, getattr(torch, "float8_e8m0fnu", None)),
}
TORCH_TO_CODE = {dt: code for code, (_, dt) in DTYPES.items() if dt is not None}

# Weight files of other formats never travel with a converted output (they would duplicate weights).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = DTYPES.get(self.dtype, (0, None))[1]
        if dt is None:
            raise MoeConvertError("tensor dtype has no torch equivalent", file=self.file.name, tensor=self.name,
                                  found=self.dtype)
        return dt


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header. Raises MoeConvertError naming the file."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MoeConvertError("truncated safetensors file: no header", file=name,
                                      expected="at least 8 bytes", found=f"{len(head)} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise MoeConvertError("header length exceeds the file", file=name,
                                      expected=f"at most {size - 8} bytes", found=n)
            raw = f.read(n)
    except OSError as e:
        raise MoeConvertError(f"cannot read: {e.strerror}", file=str(path)) from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeConvertError(f"corrupt header JSON: {e}", file=name) from e
    if not isinstance(header, dict):
        raise MoeConvertError("corrupt header: not a JSON object", file=name, found=type(header).__name__)
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for tname, entry in header.items():
        if tname == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list) and isinstance(entry.get("data_offsets"), list)
                and len(entry["data_offsets"]) == 2
                and all(isinstance(x, int) and x >= 0 for x in entry["shape"] + entry["data_offsets"])):
            raise MoeConvertError("corrupt header entry", file=name, tensor=tname,
                                  expected="{dtype, shape, data_offsets}", found=json.dumps(entry)[:120])
        b, e = entry["data_offsets"]
        if not b <= e:
            raise MoeConvertError("corrupt data_offsets", file=name, tensor=tname, found=[b, e])
        if e > data_len:
            raise MoeConvertError("tensor data runs past the end of the file (truncated or corrupt shard)",
                                  file=name, tensor=tname, expected=f"end <= {data_len}", found=e)
        width = DTYPES.get(entry["dtype"], (None, None))[0]
        numel = 1
        for d in entry["shape"]:
            numel *= d
        if width is not None and numel * width != e - b:
            raise MoeConvertError("data size does not match shape and dtype", file=name, tensor=tname,
                                  expected=numel * width, found=e - b)
        out[tname] = TensorInfo(tname, path, entry["dtype"], tuple(entry["shape"]), data_start + b, data_start + e)
        spans.append((b, e, tname))
    spans.sort()
    for (b0, e0, t0), (b1, e1, t1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise MoeConvertError(f"tensors {t0} and {t1} overlap", file=name)
    return out


class Source:
    """A validated checkpoint: its config, its tensors (in file order) and its other files."""

    def __init__(self, root: Path, ident: str, revision: str | None = None, confine_to: Path | None = None):
        self.root = root
        self.ident = ident  # what the user typed: a path or a repo id
        self.revision = revision  # the resolved commit for Hub sources
        # Files must resolve inside this folder (the snapshot itself, or for the Hub cache the repo
        # folder whose blobs/ the snapshot's symlinks point into).
        self._confine = (confine_to or root).resolve()
        self.config_path = root / "config.json"
        self.config = self._read_config()
        self.files = self._shard_files()
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for tname, info in read_header(f).items():
                if tname in self.tensors:
                    raise MoeConvertError(f"tensor is stored twice, also in {self.tensors[tname].file.name}",
                                          file=f.name, tensor=tname)
                self.tensors[tname] = info
        self._check_index_agrees()

    # -- discovery -----------------------------------------------------------------------------------

    def _read_config(self) -> dict:
        if not self.config_path.is_file():
            raise MoeConvertError("not a checkpoint folder: no config.json", file=str(self.root))
        try:
            cfg = json.loads(self.config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MoeConvertError(f"cannot parse: {e}", file=self._rel(self.config_path)) from e
        if not isinstance(cfg, dict):
            raise MoeConvertError("config is not a JSON object", file="config.json")
        return cfg

    def _inside(self, rel: str, what: str, where: str = INDEX_NAME) -> Path:
        """Resolve a file name an index gives, refusing anything that leads out of the checkpoint."""
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or rel != p.as_posix() or not rel:
            raise MoeConvertError(f"{what} names a path outside the checkpoint folder; refusing to read it",
                                  file=where, found=rel)
        full = self.root / p
        try:
            real = full.resolve(strict=False)
        except OSError as e:
            raise MoeConvertError(f"cannot resolve: {e}", file=where, found=rel) from e
        if real != self._confine and self._confine not in real.parents:
            raise MoeConvertError(f"{what} is a link leading outside the checkpoint folder; refusing to read it",
                                  file=where, found=rel)
        return full

    def _shard_files(self) -> list[Path]:
        index = self.root / INDEX_NAME
        if index.exists():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map must map names to file names")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise MoeConvertError(f"corrupt index: {e}", file=INDEX_NAME) from e
            files = []
            for fname in dict.fromkeys(weight_map.values()):
                full = self._inside(fname, "weight_map")
                if not full.is_file():
                    raise MoeConvertError("the index names a shard that does not exist", file=INDEX_NAME,
                                          found=fname)
                files.append(full)
            self._weight_map = weight_map
            return files
        self._weight_map = None
        single = self.root / "model.safetensors"
        if single.is_file():
            self._inside("model.safetensors", "the checkpoint file", where="model.safetensors")
            return [single]
        found = sorted(p.name for p in self.root.glob("*.safetensors"))
        raise MoeConvertError("no model.safetensors and no " + INDEX_NAME, file=str(self.root),
                              found=", ".join(found) or "no safetensors files")

    def _check_index_agrees(self) -> None:
        if self._weight_map is None:
            return
        for tname, fname in self._weight_map.items():
            info = self.tensors.get(tname)
            if info is None or info.file.name != Path(fname).name:
                raise MoeConvertError(f"the index maps this tensor to {fname}, which does not hold it",
                                      file=INDEX_NAME, tensor=tname)

    def _rel(self, p: Path) -> str:
        try:
            return str(p.relative_to(self.root))
        except ValueError:
            return str(p)

    def other_files(self) -> list[Path]:
        """Top-level files copied through unchanged: config, tokenizer, generation config, chat templates."""
        out = []
        for p in sorted(self.root.iterdir()):
            if not p.is_file() or p.name.startswith(".") or p.name in (INDEX_NAME, MANIFEST_NAME):
                continue
            if p.suffix in _WEIGHT_SUFFIXES:
                continue
            out.append(self._inside(p.name, "the file", where=p.name))
        return out

    # -- reading -------------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or rows [a, b) of its first dimension), as a fresh CPU tensor."""
        info = self.tensors[name]
        start, shape = info.start, info.shape
        if rows is not None:
            a, b = rows
            row_bytes = info.nbytes // shape[0] if shape[0] else 0
            start, shape = info.start + a * row_bytes, (b - a, *shape[1:])
        nbytes = DTYPES[info.dtype][0]
        for d in shape:
            nbytes *= d
        buf = bytearray(nbytes)
        self._pread_into(info, buf, start)
        if nbytes == 0:
            return torch.empty(shape, dtype=info.torch_dtype)
        return torch.frombuffer(buf, dtype=info.torch_dtype).reshape(shape)

    def read_raw(self, name: str, chunk: int = 16 << 20):
        """The stored bytes of a tensor, in chunks (for byte-identical pass-through).

        One buffer is reused for every chunk: a consumer must be done with a chunk before asking for
        the next (writing and hashing it is).
        """
        info = self.tensors[name]
        buf = bytearray(min(chunk, info.nbytes))
        pos = info.start
        while pos < info.end:
            n = min(len(buf), info.end - pos)
            view = memoryview(buf)[:n]
            self._pread_into(info, view, pos)
            yield view
            pos += n

    def _pread_into(self, info: TensorInfo, buf, offset: int) -> None:
        view, done = memoryview(buf), 0
        try:
            fd = os.open(info.file, os.O_RDONLY)
        except OSError as e:
            raise MoeConvertError(f"cannot open: {e.strerror}", file=self._rel(info.file), tensor=info.name) from e
        try:
            while done < len(buf):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    raise MoeConvertError("file ended while reading the tensor (truncated since it was opened?)",
                                          file=self._rel(info.file), tensor=info.name)
                done += n
        except OSError as e:
            raise MoeConvertError(f"read failed: {e.strerror}", file=self._rel(info.file), tensor=info.name) from e
        finally:
            os.close(fd)

    def file_digest(self, path: Path) -> dict:
        h = hashlib.sha256()
        buf = bytearray(8 << 20)  # one buffer, reused: no allocator churn beside the conversion
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])
        return {"sha256": h.hexdigest(), "size": path.stat().st_size}


def open_source(spec: str, revision: str | None = None) -> Source:
    """A local checkpoint folder, or a Hub repo id resolved through huggingface_hub (cache + HF_HUB_OFFLINE)."""
    p = Path(spec).expanduser()
    if p.exists():
        if not p.is_dir():
            raise MoeConvertError("not a checkpoint folder", file=spec)
        if not os.access(p, os.R_OK | os.X_OK):
            raise MoeConvertError("checkpoint folder is not readable", file=spec)
        if revision is not None:
            raise MoeConvertError("--revision applies to Hub repo ids, not to local folders", file=spec)
        # A folder inside the Hub cache (…/models--o--n/snapshots/<commit>) links into ../../blobs.
        cache_repo = p.resolve().parent.parent if p.resolve().parent.name == "snapshots" else None
        if cache_repo is not None and (cache_repo / "blobs").is_dir():
            return Source(p, spec, confine_to=cache_repo)
        return Source(p, spec)
    if not _REPO_ID.match(spec):
        raise MoeConvertError("no such checkpoint folder, and not a Hub repo id (owner/name)", file=spec)
    return _hub_source(spec, revision)


def _hub_source(repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "*.md"]
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise MoeConvertError(
            "not in the local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE or no network); "
            "download it first or pass a local folder", file=repo_id) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise MoeConvertError(f"cannot fetch from the Hub: {str(e).splitlines()[0]}", file=repo_id) from e
    # .../models--owner--name/snapshots/<commit>: the snapshot's files link into ../../blobs.
    return Source(folder, repo_id, revision=folder.name, confine_to=folder.parent.parent)
