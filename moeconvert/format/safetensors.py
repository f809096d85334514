"""Safetensors files as moeconvert reads and writes them: the dtype table and a header reader that
refuses what ``safetensors.safe_open`` refuses (:func:`read_header` lists the rules), plus the name of the
Hugging Face shard index (docs/format.md).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError

INDEX_NAME = "model.safetensors.index.json"

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
#: the floating dtypes a model (and a manifest's ``dtype``) may name, by torch's name
FLOAT_DTYPES = ("bfloat16", "float16", "float32")

#: bits per element of every dtype safetensors 0.8 knows (its ``Dtype`` enum). A header naming any
#: other string does not parse there, so it is refused here; the sub-byte ones pass through unread.
_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

_MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE (decimal, not 100 MiB)
_USIZE = 1 << 64  # safetensors reads shapes and offsets as Rust usize: 0 .. 2^64 - 1


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

