"""Sources: a checkpoint folder or a Hugging Face repo id, read lazily and validated before use.

Every safetensors header is parsed and checked here, by the rules ``safetensors.safe_open`` applies
(:func:`read_header` lists them), and every file we open (config, index, shards, files copied through)
must resolve inside the checkpoint, before any tensor is read. Tensors are then read one at a time (or
one chunk of experts at a time) with ``pread`` into a fresh buffer: nothing is mapped, so the resident
memory of a conversion is what it holds, not the pages of the model it has touched.

The ``config_*`` getters read config.json values with their type and range checked, so that a broken
config is refused naming its key instead of failing later (or looping over a number nobody checked).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "moeconvert.json"
CONFIG_NAME = "config.json"

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

#: bits per element of every dtype safetensors 0.8 knows (its ``Dtype`` enum). A header naming any
#: other string does not parse there, so it is refused here; the sub-byte ones pass through unread.
_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

# Weight files of other formats never travel with a converted output (they would duplicate weights).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
_MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE (decimal, not 100 MiB)
_USIZE = 1 << 64  # safetensors reads shapes and offsets as Rust usize: 0 .. 2^64 - 1
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
                                  expected="a dtype torch can hold", found=self.dtype)
        return dt


# ---------------------------------------------------------------------------------------------------
# JSON as safetensors and transformers read it


class _JsonRefusal(ValueError):
    """Raised from inside ``json.loads`` hooks: a document Python would accept but we must not."""


def _strict_object(duplicates: list[str], check_unicode: bool):
    """An ``object_pairs_hook`` that notes duplicate keys in ``duplicates`` (``json.loads`` keeps the last
    one silently, so two tensors of one name would read as one) and, with ``check_unicode``, refuses
    strings that are not Unicode text (a lone surrogate escape such as ``"\\ud800"`` parses in Python,
    not in serde_json, which safetensors uses)."""
    def hook(pairs: list[tuple[str, object]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            duplicates.extend(k for k, _ in pairs if k in seen or seen.add(k))
        if check_unicode:
            for key, value in pairs:
                for text in (key, value) if isinstance(value, str) else (key,):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise _JsonRefusal(f"string {show_value(text, 60)} is not valid Unicode "
                                           "(a lone surrogate)") from None
        return out
    return hook


def _no_constant(name: str):
    raise _JsonRefusal(f"{name} is not JSON")


def _json_int(text: str):
    # "-0" is a float to serde_json (and so refused as a dimension); Python would read it as the int 0.
    return -0.0 if text == "-0" else int(text)


# Only a text holding these can hold a lone surrogate or a "-0": the slower checks run only then.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_MINUS_ZERO = re.compile(r"-0(?![0-9.eE])")


def _loads_strict(text: str) -> tuple[object, list[str]]:
    """Parse JSON as safetensors does (no NaN/Infinity, no lone surrogates, ``-0`` is not an integer);
    returns the value and the keys that appeared twice in some object."""
    duplicates: list[str] = []
    hook = _strict_object(duplicates, check_unicode=bool(_SURROGATE_ESCAPE.search(text)))
    extra = {"parse_int": _json_int} if _MINUS_ZERO.search(text) else {}
    value = json.loads(text, object_pairs_hook=hook, parse_constant=_no_constant, **extra)
    return value, duplicates


def show_value(value, limit: int = 80) -> str:
    """A JSON value as it appears in the file (true, "8", 3.0, NaN), shortened: what ``found`` shows."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _short(name: str, limit: int = 100) -> str:
    """A name from the input, cut to fit on the one line (a 4 KB key is still one line, but unreadable)."""
    return name if len(name) <= limit else name[: limit - 25] + "…" + name[-24:]


def _is_usize(x) -> bool:
    return type(x) is int and 0 <= x < _USIZE


def _os_reason(e: OSError) -> str:
    """Why a path could not be used, in words (a symlink loop, a name too long, ...)."""
    if e.errno == errno.ELOOP:
        return "a symbolic link loop"
    if e.errno == errno.ENAMETOOLONG:
        return "file name too long"
    return e.strerror or type(e).__name__


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header. Raises MoeConvertError naming the file.

    Refuses every header ``safetensors.safe_open`` refuses (safetensors 0.8, ``SafeTensors::read_metadata``
    and ``Metadata::validate`` in ``safetensors/src/tensor.rs``), so that nothing we pass through ends up
    in an output safetensors cannot open:

    * the first 8 bytes are the header length N, at most 100,000,000, and 8 + N fits in the file;
    * the N bytes are UTF-8 JSON (no NaN/Infinity) holding one object; ``__metadata__``, if present and
      not null, maps strings to strings; every other key is a tensor: an object with ``dtype`` (one of
      safetensors' dtype names), ``shape`` (a list of integers 0 .. 2^64 - 1) and ``data_offsets``
      (exactly two such integers, begin <= end); unknown fields in an entry are ignored;
    * the element count (shape product, then times the dtype's bits) does not overflow 64 bits, is a
      whole number of bytes, and equals end - begin;
    * sorted by their offsets, the tensors tile the data buffer: the first begins at 0, each begins
      where the one before ends (no gap, no overlap), and the last ends exactly at the end of the file
      (trailing bytes are refused too).

    Stricter than safetensors in one place: a key given twice in one object is refused even where
    safetensors keeps one of them (two entries of one tensor name, say), because the file is then
    ambiguous about what it holds.
    """
    name = path.name
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise MoeConvertError("not a safetensors file", file=name, expected="a regular file",
                                  found="a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MoeConvertError("truncated safetensors file: no header", file=name,
                                      expected="at least 8 bytes", found=f"{len(head)} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise MoeConvertError("header length exceeds safetensors' limit", file=name,
                                      expected=f"at most {_MAX_HEADER} bytes", found=n)
            if n > size - 8:
                raise MoeConvertError("header length exceeds the file", file=name,
                                      expected=f"at most {size - 8} bytes", found=n)
            raw = f.read(n)
    except OSError as e:
        raise MoeConvertError(f"cannot read: {_os_reason(e)}", file=name) from e
    if len(raw) != n:
        raise MoeConvertError("file shrank while its header was read", file=name, expected=f"{n} header bytes",
                              found=f"{len(raw)} bytes")
    if n == 0:
        raise MoeConvertError("empty header", file=name, expected="a JSON object", found="header length 0")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MoeConvertError(f"header is not valid UTF-8 (byte {e.start})", file=name) from e
    try:
        header, duplicates = _loads_strict(text)
    except _JsonRefusal as e:
        raise MoeConvertError(f"corrupt header JSON: {e}", file=name) from e
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an int of > 4300 digits, deep nesting
        raise MoeConvertError(f"corrupt header JSON: {str(e) or type(e).__name__}", file=name) from e
    if not isinstance(header, dict):
        raise MoeConvertError("corrupt header: not a JSON object", file=name, expected="a JSON object",
                              found=f"a JSON {_json_kind(header)}")
    if duplicates:
        key = duplicates[0]
        if key in header:
            raise MoeConvertError("tensor name appears twice in the header (JSON readers keep only the last)",
                                  file=name, tensor=_short(key))
        raise MoeConvertError(f"corrupt header JSON: key {show_value(key, 60)} appears twice in one object",
                              file=name)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise MoeConvertError("must map strings to strings", file=name, tensor="__metadata__",
                              expected="an object of strings", found=show_value(meta))
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for tname, entry in header.items():
        b, e = _check_entry(name, tname, entry, data_len)
        out[tname] = TensorInfo(tname, path, entry["dtype"], tuple(entry["shape"]), data_start + b, data_start + e)
        spans.append((b, e, tname))
    spans.sort()  # safetensors orders by (begin, end) before it checks the tiling
    pos, prev = 0, None
    for b, e, tname in spans:
        if b > pos:
            raise MoeConvertError("gap in the data buffer: " + (f"bytes between {_short(prev)} and this tensor"
                                  if prev is not None else "bytes before the first tensor") + " belong to no tensor",
                                  file=name, tensor=_short(tname), expected=f"data_offsets beginning at {pos}",
                                  found=[b, e])
        if b < pos:
            raise MoeConvertError(f"tensor data overlaps {_short(prev)}", file=name, tensor=_short(tname),
                                  expected=f"data_offsets beginning at {pos}", found=[b, e])
        pos, prev = e, tname
    if pos != data_len:
        raise MoeConvertError("bytes after the last tensor's data: safetensors needs the data to end at the "
                              "end of the file", file=name, expected=f"{data_start + pos} bytes",
                              found=f"{size} bytes")
    return out


def _json_kind(value) -> str:
    kinds = (("object", dict), ("array", list), ("string", str), ("boolean", bool), ("number", (int, float)))
    for kind, types in kinds:
        if isinstance(value, types):
            return kind
    return "null"


def _check_entry(file: str, tname: str, entry, data_len: int) -> tuple[int, int]:
    """One tensor's header entry, by safetensors' rules; returns its (begin, end) in the data buffer."""
    if not isinstance(entry, dict):
        raise MoeConvertError("header entry is not an object", file=file, tensor=_short(tname),
                              expected="{dtype, shape, data_offsets}", found=show_value(entry))
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise MoeConvertError(f"header entry has no {missing[0]}", file=file, tensor=_short(tname),
                              expected="{dtype, shape, data_offsets}", found=show_value(entry, 120))
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        raise MoeConvertError("unknown dtype", file=file, tensor=_short(tname),
                              expected="a safetensors dtype (BF16, F16, F32, I32, U8, ...)",
                              found=show_value(dtype))
    if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
        raise MoeConvertError("shape must be a list of integers", file=file, tensor=_short(tname),
                              expected="integers 0 .. 2^64-1", found=show_value(shape))
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_usize(x) for x in offsets)):
        raise MoeConvertError("data_offsets must be two integers", file=file, tensor=_short(tname),
                              expected="[begin, end]", found=show_value(offsets))
    b, e = offsets
    if b > e:
        raise MoeConvertError("data_offsets are reversed", file=file, tensor=_short(tname),
                              expected="begin <= end", found=[b, e])
    if e > data_len:
        raise MoeConvertError("tensor data runs past the end of the file (truncated or corrupt shard)",
                              file=file, tensor=_short(tname), expected=f"end <= {data_len}", found=e)
    numel = 1
    for d in shape:  # safetensors multiplies left to right and refuses any overflow on the way
        numel *= d
        if numel >= _USIZE:
            raise MoeConvertError("shape overflows 64 bits", file=file, tensor=_short(tname),
                                  expected="a product of dimensions below 2^64", found=show_value(shape))
    bits = numel * _DTYPE_BITS[dtype]
    if bits >= _USIZE:
        raise MoeConvertError("tensor size overflows 64 bits", file=file, tensor=_short(tname),
                              expected="fewer than 2^64 bits", found=f"{numel} x {dtype}")
    if bits % 8:
        raise MoeConvertError(f"{dtype} tensor does not fill whole bytes", file=file, tensor=_short(tname),
                              expected="a multiple of 8 bits", found=f"{bits} bits")
    if bits // 8 != e - b:
        raise MoeConvertError("data size does not match shape and dtype", file=file, tensor=_short(tname),
                              expected=bits // 8, found=e - b)
    return b, e


# ---------------------------------------------------------------------------------------------------
# config.json values


_REQUIRED = object()


def _absent(cfg: dict, key: str, default, section: str, expected: str):
    if default is _REQUIRED:
        raise MoeConvertError("missing" if key not in cfg else "must not be null", file=CONFIG_NAME,
                              tensor=section + key, expected=expected)
    return default


def config_int(cfg: dict, key: str, *, min: int = 1, default=_REQUIRED, section: str = "") -> int | None:
    """``cfg[key]`` as an integer >= ``min``; absent or null gives ``default`` (refused when required).

    true/false, 8.0 and "8" are refused rather than coerced: transformers would fail on them or do
    something else, and a config that says them is broken. ``section`` prefixes the key in messages
    (``text_config.``).
    """
    expected = "a positive integer" if min == 1 else f"an integer >= {min}"
    value = cfg.get(key)
    if value is None:
        return _absent(cfg, key, default, section, expected)
    if type(value) is not int or value < min:
        raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=section + key,
                              expected=expected, found=show_value(value))
    return value


def config_number(cfg: dict, key: str, *, default=_REQUIRED, positive: bool = False,
                  section: str = "") -> float | None:
    """``cfg[key]`` as a finite real number (int or float, never a bool), > 0 when ``positive``."""
    expected = "a finite number" + (" > 0" if positive else "")
    value = cfg.get(key)
    if value is None:
        return _absent(cfg, key, default, section, expected)
    if type(value) not in (int, float) or not math.isfinite(value) or (positive and value <= 0):
        raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=section + key,
                              expected=expected, found=show_value(value))
    return value


_KIND_WORDS = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}


def config_value(cfg: dict, key: str, kind: type, *, default=_REQUIRED, section: str = ""):
    """``cfg[key]`` checked to be a JSON object / list / string / boolean (``kind`` dict, list, str, bool)."""
    value = cfg.get(key)
    if value is None:
        return _absent(cfg, key, default, section, _KIND_WORDS[kind])
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=section + key,
                              expected=_KIND_WORDS[kind], found=show_value(value))
    return value


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

    def file_digest(self, path: Path) -> dict:
        h = hashlib.sha256()
        buf = bytearray(8 << 20)  # one buffer, reused: no allocator churn beside the conversion
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])
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
