"""Sources: a checkpoint folder or a Hugging Face repo id, read lazily and validated before use.

Every safetensors header is parsed and checked (:func:`moeconvert.format.read_header`, by the rules
``safetensors.safe_open`` applies), and every file we open (config, index, shards, files copied through)
must resolve inside the checkpoint, before any tensor is read. Tensors are then read one at a time (or
one chunk of experts at a time) with ``pread`` into a fresh buffer: nothing is mapped, so the resident
memory of a conversion is what it holds, not the pages of the model it has touched.

config.json values are read with the ``config_*`` getters of :mod:`moeconvert.format.config`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, TensorInfo, read_header, show_value
from moeconvert.format.safetensors import _json_kind, _os_reason, _short

# Weight files of other formats never travel with a converted output (they would duplicate weights).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def read_json_file(path: Path, shown: str):
    """A small JSON file of the checkpoint (config, index), parsed as transformers parses it (NaN allowed,
    the last of duplicate keys wins): the values we use go through the ``config_*`` getters, which refuse
    what is not a finite number where one is needed, so nothing non-finite reaches the manifest."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MoeConvertError(f"not valid UTF-8 (byte {e.start})", file=shown) from e
    except OSError as e:
        raise MoeConvertError(f"cannot read: {_os_reason(e)}", file=shown) from e
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise MoeConvertError(f"cannot parse: {str(e) or type(e).__name__}", file=shown) from e


class Source:
    """A validated checkpoint: its config, its tensors (in file order) and its other files."""

    def __init__(self, root: Path, ident: str, revision: str | None = None, confine_to: Path | None = None):
        self.root = root
        self.ident = ident  # what the user typed: a path or a repo id
        self.revision = revision  # the resolved commit for Hub sources
        # Files must resolve inside this folder (the snapshot itself, or for the Hub cache the repo
        # folder whose blobs/ the snapshot's symlinks point into).
        self._confine = Path(os.path.realpath(confine_to or root))
        self.config_path = root / CONFIG_NAME
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
        if not os.path.lexists(self.config_path):
            raise MoeConvertError("not a checkpoint folder: no config.json", file=str(self.root))
        path = self._regular_file(self._inside(CONFIG_NAME, CONFIG_NAME, where=CONFIG_NAME), CONFIG_NAME)
        cfg = read_json_file(path, CONFIG_NAME)
        if not isinstance(cfg, dict):
            raise MoeConvertError("config is not a JSON object", file=CONFIG_NAME, expected="a JSON object",
                                  found=f"a JSON {_json_kind(cfg)}")
        return cfg

    def _inside(self, rel: str, what: str, where: str = INDEX_NAME) -> Path:
        """Resolve a file name the checkpoint gives, refusing anything that leads out of it (before it is
        opened: a link to a file elsewhere is never read)."""
        p = Path(rel)
        if not rel or "\0" in rel:
            raise MoeConvertError(f"{what} names an invalid path (empty, or with a NUL character)", file=where,
                                  found=show_value(rel))
        if p.is_absolute() or ".." in p.parts or rel != p.as_posix():
            raise MoeConvertError(f"{what} names a path outside the checkpoint folder; refusing to read it",
                                  file=where, expected="a relative path inside the checkpoint", found=show_value(rel))
        full = self.root / p
        try:
            # realpath, not Path.resolve: on a symlink loop Python 3.11's resolve raises RuntimeError;
            # realpath stops there, and the loop is reported when the file is used.
            real = Path(os.path.realpath(full))
        except (OSError, ValueError) as e:
            raise MoeConvertError(f"cannot resolve: {e}", file=where, found=show_value(rel)) from e
        if real != self._confine and self._confine not in real.parents:
            raise MoeConvertError(f"{what} is a link leading outside the checkpoint folder; refusing to read it",
                                  file=where, expected="a file inside the checkpoint", found=show_value(rel))
        return full

    def _regular_file(self, full: Path, where: str, missing: str | None = None) -> Path:
        """``full`` if it is a regular file (after links); else one line saying what it is instead."""
        try:
            st = os.stat(full)
        except OSError as e:
            if e.errno == errno.ENOENT and missing is not None:
                raise MoeConvertError(missing, file=where, found=_short(self._rel(full))) from e
            raise MoeConvertError(f"cannot open {_short(self._rel(full))}: {_os_reason(e)}", file=where) from e
        if not stat.S_ISREG(st.st_mode):
            raise MoeConvertError(f"{_short(self._rel(full))} is not a file", file=where, expected="a regular file",
                                  found="a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        return full

    def _shard_files(self) -> list[Path]:
        index = self.root / INDEX_NAME
        if os.path.lexists(index):
            self._regular_file(self._inside(INDEX_NAME, "the index", where=INDEX_NAME), INDEX_NAME)
            data = read_json_file(index, INDEX_NAME)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise MoeConvertError("corrupt index: weight_map must map tensor names to file names",
                                      file=INDEX_NAME, tensor="weight_map", expected="an object of strings",
                                      found=show_value(weight_map) if isinstance(data, dict) and "weight_map" in data
                                      else "no weight_map")
            files = []
            for fname in dict.fromkeys(weight_map.values()):
                full = self._inside(fname, "weight_map")
                files.append(self._regular_file(full, INDEX_NAME,
                                                missing="the index names a shard that does not exist"))
            self._weight_map = weight_map
            return files
        self._weight_map = None
        single = self.root / "model.safetensors"
        if os.path.lexists(single):
            self._inside("model.safetensors", "the checkpoint file", where="model.safetensors")
            return [self._regular_file(single, "model.safetensors")]
        found = sorted(p.name for p in self.root.glob("*.safetensors"))
        raise MoeConvertError("no model.safetensors and no " + INDEX_NAME, file=str(self.root),
                              expected=f"model.safetensors or {INDEX_NAME}",
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
        dtype = info.torch_dtype
        start, shape = info.start, info.shape
        if rows is not None:
            a, b = rows
            row_bytes = info.nbytes // shape[0] if shape[0] else 0
            start, shape = info.start + a * row_bytes, (b - a, *shape[1:])
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        buf = bytearray(nbytes)
        self._pread_into(info, buf, start)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

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

    def file_digest(self, path: Path, progress=None) -> dict:
        """``{"sha256", "size"}`` of one file; ``progress(n)`` after each piece hashed."""
        h = hashlib.sha256()
        buf = bytearray(8 << 20)  # one buffer, reused: no allocator churn beside the conversion
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])
                if progress is not None:
                    progress(n)
        return {"sha256": h.hexdigest(), "size": path.stat().st_size}


def open_source(spec: str, revision: str | None = None) -> Source:
    """A local checkpoint folder, or a Hub repo id resolved through huggingface_hub (cache + HF_HUB_OFFLINE).

    Only ``owner/name`` can be either; anything else that is not a folder here (``./x``, ``/x``, ``~/x``,
    ``a/b/c``, ``x``) is reported as a missing folder rather than sent to the Hub.
    """
    try:
        p = Path(spec).expanduser()
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except RuntimeError as e:  # "~user" with no such user
        raise MoeConvertError(f"no such folder ({e})", file=spec) from e
    except OSError as e:
        why = {errno.ELOOP: "the path is a symbolic link loop",
               errno.ENAMETOOLONG: "the name is longer than the file system allows"}.get(e.errno, e.strerror)
        raise MoeConvertError(f"cannot open the checkpoint folder: {why}", file=spec) from e
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise MoeConvertError("not a checkpoint folder", file=spec, expected="a folder",
                                  found="a file" if stat.S_ISREG(st.st_mode) else "something else")
        if not os.access(p, os.R_OK | os.X_OK):
            raise MoeConvertError("checkpoint folder is not readable", file=spec)
        if revision is not None:
            raise MoeConvertError("--revision applies to Hub repo ids, not to local folders", file=spec)
        # A folder inside the Hub cache (…/models--o--n/snapshots/<commit>) links into ../../blobs.
        real = Path(os.path.realpath(p))
        cache_repo = real.parent.parent if real.parent.name == "snapshots" else None
        if cache_repo is not None and (cache_repo / "blobs").is_dir():
            return Source(p, spec, confine_to=cache_repo)
        return Source(p, spec)
    if not _REPO_ID.match(spec):
        raise MoeConvertError("no such folder", file=spec)
    return _hub_source(spec, revision)


def _hub_source(repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "*.md"]
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise MoeConvertError(
            "no such local folder, and not in the Hugging Face cache (the Hub cannot be reached: HF_HUB_OFFLINE "
            "or no network); download it first or pass a local folder", file=repo_id) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise MoeConvertError(f"no such local folder, and cannot fetch from the Hub: {str(e).splitlines()[0]}",
                              file=repo_id) from e
    # .../models--owner--name/snapshots/<commit>: the snapshot's files link into ../../blobs.
    return Source(folder, repo_id, revision=folder.name, confine_to=folder.parent.parent)
