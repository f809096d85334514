"""``moeconvert.json``: read it, validate every field, and check the shards against it (docs/format.md).

The bottom layer, like the rest of ``moeconvert.format``: it knows the file, not the layouts. What needs
them (scheme objects parsed, each layer against its layout's plan) is ``moeconvert.layouts.output``,
whose ``check_output`` runs these checks first. Each refusal is one :class:`MoeConvertError` line naming
the field:

* a field missing, of the wrong type or out of range
  (``moeconvert.json: moe_layers[3].num_experts: expected a positive int, found "x"``);
* shards missing, of another size, whose header bytes (the 8-byte length and the JSON, ``__metadata__``
  and padding included) hash to another sha256 than recorded, or whose tensors (names, files, shapes,
  dtypes) disagree with the manifest;
* an output ``config.json`` that is missing, not JSON, or not a JSON object.

Tensor data is not read here: its checksums need every byte, which ``verify`` and
``load(verify=True)`` read anyway (and hash in the same pass).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moeconvert.errors import MoeConvertError
from moeconvert.format.config import CONFIG_NAME
from moeconvert.format.safetensors import DTYPES, FLOAT_DTYPES, TensorInfo, read_header

MANIFEST_NAME = "moeconvert.json"
#: Version of the output format (the layout of ``moeconvert.json`` and the tensor naming contract).
FORMAT_VERSION = 2
#: the first format version whose manifest records a sha256 of every shard header (``shards[].header_sha256``)
HEADER_CHECKSUMS_SINCE = 2
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_QUANT_FORMATS = ("mxfp4",)
#: activation -> the parameters it takes (docs/runtime.md, "Activations")
#: silu's ``limit``: DeepSeek-V4's swiglu_limit (gate and up clamped before SiLU-and-mul, when > 0);
#: swiglustep's: Step-3.5's (SiLU of gate clamped from above after it, up clamped on both sides)
_ACTIVATIONS = {"silu": ("limit",), "swigluoai": ("alpha", "limit"), "situ": ("beta", "linear_beta"),
                "swiglustep": ("limit",)}
#: zero-computation experts' types (LongCat-Flash; vLLM's zero_experts_compute_triton computes identity only)
ZERO_EXPERT_TYPES = ("identity",)
_MISSING = object()


# -- reading --------------------------------------------------------------------------------------

def read_manifest(out: Path) -> dict:
    """The parsed ``moeconvert.json`` of a finished output of this format version (fields unchecked)."""
    path = out / MANIFEST_NAME
    if not out.is_dir():
        raise MoeConvertError("no such output folder", file=str(out))
    if not path.is_file():
        raise MoeConvertError("incomplete or not a moeconvert output: no moeconvert.json", file=str(out))
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeConvertError(f"corrupt manifest: {e}", file=str(path)) from e
    if not isinstance(manifest, dict):
        raise MoeConvertError("corrupt manifest: not a JSON object", file=str(path), found=type(manifest).__name__)
    if manifest.get("format") != "moeconvert":
        raise MoeConvertError("not a moeconvert manifest", file=str(path), tensor="format",
                              expected="moeconvert", found=manifest.get("format"))
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version < HEADER_CHECKSUMS_SINCE:
        # Refused rather than read without the header check: a verify that passes must mean every byte
        # of the shards was checked, and this manifest cannot say what the headers were.
        raise MoeConvertError(
            f"unsupported output format version {version}: the manifest predates shard header checksums "
            "(convert the checkpoint again with this moeconvert)", file=str(path), tensor="format_version",
            expected=FORMAT_VERSION, found=version)
    if version != FORMAT_VERSION:
        raise MoeConvertError("unsupported output format version (made by another moeconvert version)",
                              file=str(path), tensor="format_version", expected=FORMAT_VERSION, found=version)
    return manifest


def read_output_config(root: Path, digest: dict | None = None) -> dict:
    """The output's ``config.json`` (routing parameters come from it); with ``digest`` (the manifest's
    ``copied_files`` entry, ``{"sha256", "size"}``), its bytes must be those."""
    path = root / CONFIG_NAME
    if not path.is_file():
        raise MoeConvertError("the output has no config.json (every conversion copies it from the source; the "
                              "runtime reads the routing parameters from it)", file=str(root))
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise MoeConvertError(f"cannot read the output's config: {e.strerror}", file=str(path)) from e
    try:  # parsed before the checksum is compared: "not JSON, at line 3" says more than a digest
        cfg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeConvertError(f"the output's config is not valid JSON ({e}); copy it again from the source "
                              "checkpoint", file=str(path)) from e
    if not isinstance(cfg, dict):
        raise MoeConvertError("the output's config is not a JSON object", file=str(path),
                              expected="an object", found=type(cfg).__name__)
    if digest is not None:
        got = hashlib.sha256(raw).hexdigest()
        if (got, len(raw)) != (digest["sha256"], digest["size"]):
            raise MoeConvertError("checksum mismatch: config.json changed after conversion", file=str(path),
                                  expected=f"sha256 {digest['sha256'][:16]}…, {digest['size']} bytes",
                                  found=f"sha256 {got[:16]}…, {len(raw)} bytes")
    return cfg


# -- field validation -----------------------------------------------------------------------------

def show_field(v: object) -> str:
    """A JSON value for a message, cut at 60 characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


_ABSENT = object()


def show_mismatch(expected: object, found: object, limit: int = 3) -> str:
    """What follows "expected " in a message comparing two JSON values: both whole (``X, found Y``) when
    each fits :func:`show_field`'s 60 characters, else where they differ, so that two values cut at the same
    place never read the same: ``X at w13.b_dtype, found Y there`` for the first difference (a string by the
    part around its first differing character), and how many more there are and where."""
    a, b = show_field(expected), show_field(found)
    if a != b and not (a.endswith("...") or b.endswith("...")):
        return f"{a}, found {b}"
    diffs = _differences(expected, found, "")
    if not diffs:
        return f"{a}, found {b}"
    path, x, y = diffs[0]
    if isinstance(x, str) and isinstance(y, str):
        i = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        x, y = _around(x, i), _around(y, i)
    else:
        x, y = _absent_or(x), _absent_or(y)
    more = ""
    if len(diffs) > 1:
        rest = [p or "the value" for p, _, _ in diffs[1:1 + limit]]
        more = f" (and {len(diffs) - 1} more difference(s): {', '.join(rest)}{', ...' if len(diffs) > 1 + limit else ''})"
    return f"{x} at {path or 'the top level'}, found {y} there{more}"


def _absent_or(v: object) -> str:
    return "nothing" if v is _ABSENT else show_field(v)


def _around(text: str, i: int) -> str:
    """``text`` around character ``i`` (its first difference from another string), as JSON."""
    lo = max(0, i - 20)
    part = json.dumps(text[lo:i + 30])
    return ("..." if lo else "") + part + ("..." if i + 30 < len(text) else "")


def _differences(a: object, b: object, path: str) -> list[tuple[str, object, object]]:
    """Every ``(path, a's value, b's value)`` where two JSON values differ (``_ABSENT``: no such key)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _differences(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    same = a is not _ABSENT and b is not _ABSENT and type(a) is type(b) and json.dumps(a) == json.dumps(b)
    return [] if same else [(path, a, b)]


def made_for_versions(value: object) -> tuple[str, ...]:
    """The versions a ``layout.made_for`` entry names: a list of the versions the layout was checked against
    (``"vllm": ["0.33.0", "0.34.0"]``), or one version string, as manifests written before lists name one."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else ()


def field_error(where: str, message: str) -> MoeConvertError:
    """One line: ``moeconvert.json: <field path>: <message>``."""
    return MoeConvertError(message, file=MANIFEST_NAME, tensor=where)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "str|null": (lambda v: v is None or (isinstance(v, str) and v != ""), "a non-empty string or null"),
    "int>0": (lambda v: is_int(v) and v > 0, "a positive int"),
    "int>=0": (lambda v: is_int(v) and v >= 0, "a non-negative int"),
    "int>0|null": (lambda v: v is None or (is_int(v) and v > 0), "a positive int or null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
                  "a list of non-empty strings"),
    "sha256": (lambda v: isinstance(v, str) and bool(_HEX64.match(v)), "a sha256 (64 lowercase hex digits)"),
    "float_dtype": (lambda v: v in FLOAT_DTYPES, " | ".join(FLOAT_DTYPES)),
    "float_dtype|null": (lambda v: v is None or v in FLOAT_DTYPES, " | ".join(FLOAT_DTYPES) + " or null"),
    "st_dtype": (lambda v: isinstance(v, str) and v in DTYPES, "a safetensors dtype code (" + ", ".join(DTYPES) + ")"),
    "shape": (lambda v: isinstance(v, list) and all(is_int(x) and x >= 0 for x in v),
              "a list of non-negative ints"),
}


def get_field(obj: dict, key: str, path: str, rule: str, default: object = _MISSING):
    """``obj[key]`` if it satisfies ``rule``; else a MoeConvertError naming ``path.key``."""
    where = f"{path}.{key}" if path else key
    ok, what = _RULES[rule]
    if key not in obj:
        if default is not _MISSING:
            return default
        raise field_error(where, f"missing (expected {what})")
    value = obj[key]
    if not ok(value):
        raise field_error(where, f"expected {what}, found {show_field(value)}")
    return value


def one_of(obj: dict, key: str, path: str, allowed: tuple) -> object:
    """``obj[key]`` if it is one of ``allowed``; else a MoeConvertError naming ``path.key``."""
    where = f"{path}.{key}" if path else key
    if key not in obj:
        raise field_error(where, f"missing (expected {' | '.join(map(str, allowed))})")
    if isinstance(obj[key], bool) or obj[key] not in allowed:
        raise field_error(where, f"expected {' | '.join(map(str, allowed))}, found {show_field(obj[key])}")
    return obj[key]


def exact_keys(obj: dict, path: str, keys: set[str]) -> None:
    """A MoeConvertError naming the first field of ``obj`` not in ``keys``."""
    extra = sorted(set(obj) - keys)
    if extra:
        raise field_error(f"{path}.{extra[0]}", f"unknown field (expected only {', '.join(sorted(keys))})")


def _tensor_entry(e: object, path: str, shard_files: set[str]) -> dict:
    if not isinstance(e, dict):
        raise field_error(path, f"expected an object, found {show_field(e)}")
    get_field(e, "name", path, "str")
    file = get_field(e, "file", path, "str")
    if file not in shard_files:
        raise field_error(f"{path}.file", f"names no shard of the manifest's shards list, found {show_field(file)}")
    get_field(e, "shape", path, "shape")
    get_field(e, "dtype", path, "st_dtype")
    get_field(e, "sha256", path, "sha256")
    return e


def _check_quality(q: object, path: str) -> None:
    if not isinstance(q, dict) or not all(isinstance(v, dict) and all(_is_num(x) for x in v.values())
                                          for v in q.values()):
        raise field_error(path, f"expected an object of objects of numbers, found {show_field(q)}")


_TP_STORED_KEYS = {"stored", "intermediate_size", "intermediate_size_padded", "hidden_size_padded", "layout_metadata",
                   "tensors"}


def _tp_sizes(raw: dict, p: str, prefix: str, files: set[str], once: Callable[[str, str], None]) -> None:
    """A layer's ``tp_sizes`` (``--tp-sizes``): TP size -> ``{"stored": false}`` or what is stored for it."""
    for key, v in get_field(raw, "tp_sizes", p, "dict").items():
        tp = f"{p}.tp_sizes[{show_field(key)}]"
        if not (key.isdigit() and str(int(key)) == key and int(key) > 1):
            raise field_error(tp, f"expected a TP size above 1 as the key, found {show_field(key)}")
        if not isinstance(v, dict):
            raise field_error(tp, f"expected an object, found {show_field(v)}")
        if not get_field(v, "stored", tp, "bool"):
            exact_keys(v, tp, {"stored"})
            continue
        exact_keys(v, tp, _TP_STORED_KEYS | ({"rank_layout_metadata"} & set(v)))
        for k in ("intermediate_size", "intermediate_size_padded", "hidden_size_padded"):
            get_field(v, k, tp, "int>0")
        get_field(v, "layout_metadata", tp, "dict")
        if "rank_layout_metadata" in v:  # layouts whose bytes depend on each rank's data: one per rank
            ranks = v["rank_layout_metadata"]
            if not (isinstance(ranks, list) and len(ranks) == int(key) and all(isinstance(r, dict) for r in ranks)):
                raise field_error(f"{tp}.rank_layout_metadata", f"expected a list of {key} objects (one per rank), "
                                  f"found {show_field(ranks)}")
        tensors = get_field(v, "tensors", tp, "dict")
        if not tensors:
            raise field_error(f"{tp}.tensors", "expected the stored rank tensors, found {}")
        for suffix, e in tensors.items():
            where = f"{tp}.tensors.{suffix}"
            _tensor_entry(e, where, files)
            want = f"{prefix}.tp{key}.{suffix}"
            if e["name"] != want:
                raise field_error(f"{where}.name", f"expected {show_field(want)}, found {show_field(e['name'])}")
            once(e["name"], where)


def layer_tensor_entries(raw: dict, i: int) -> list[tuple[str, dict]]:
    """``(where, entry)`` of every tensor layer entry ``i`` lists: its full tensors, then each stored TP size's."""
    p = f"moe_layers[{i}]"
    out = [(f"{p}.tensors.{suffix}", e) for suffix, e in raw["tensors"].items()]
    for key, v in raw.get("tp_sizes", {}).items():
        if v.get("stored"):
            out += [(f"{p}.tp_sizes[{show_field(key)}].tensors.{suffix}", e) for suffix, e in v["tensors"].items()]
    return out


def validate_fields(m: dict) -> None:
    """Every field of the manifest present, of its type and in its range (docs/format.md)."""
    get_field(m, "tool_version", "", "str")
    src = get_field(m, "source", "", "dict")
    get_field(src, "id", "source", "str")
    get_field(src, "revision", "source", "str|null")
    for name, d in get_field(src, "files", "source", "dict").items():
        p = f"source.files[{show_field(name)}]"
        if not isinstance(d, dict):
            raise field_error(p, f"expected an object, found {show_field(d)}")
        get_field(d, "sha256", p, "sha256")
        get_field(d, "size", p, "int>=0")
    get_field(m, "family", "", "str")
    get_field(m, "dtype", "", "float_dtype")
    if "quantization" not in m:
        raise field_error("quantization", "missing (expected an object or null)")
    quant = m["quantization"]
    if quant is not None:
        if not isinstance(quant, dict):
            raise field_error("quantization", f"expected an object or null, found {show_field(quant)}")
        exact_keys(quant, "quantization", {"format", "rounding"})
        one_of(quant, "format", "quantization", _QUANT_FORMATS)
        get_field(quant, "rounding", "quantization", "str")  # which roundings exist: layouts/output.py
    if "scheme" not in m:
        raise field_error("scheme", "missing (expected a scheme object or null)")
    if m["scheme"] is not None and not isinstance(m["scheme"], dict):
        raise field_error("scheme", f"expected a scheme object or null, found {show_field(m['scheme'])}")
    get_field(m, "backend", "", "str")
    lay = get_field(m, "layout", "", "dict")
    get_field(lay, "name", "layout", "str")
    get_field(lay, "version", "layout", "int>0")
    get_field(lay, "kernel", "layout", "str")
    made_for = get_field(lay, "made_for", "layout", "dict")
    for k, v in made_for.items():
        if not (isinstance(v, str) or isinstance(v, list) and v and all(isinstance(x, str) for x in v)):
            raise field_error(f"layout.made_for.{k}",
                              f"expected a version string or a non-empty list of them, found {show_field(v)}")
    part = get_field(m, "partition", "", "dict")
    exact_keys(part, "partition", {"tp_size", "tp_rank", "ep_size", "ep_rank"})
    for size, rank in (("tp_size", "tp_rank"), ("ep_size", "ep_rank")):
        n = get_field(part, size, "partition", "int>0")
        r = get_field(part, rank, "partition", "int>=0")
        if r >= n:
            raise field_error(f"partition.{rank}", f"expected a rank below partition.{size} {n}, found {r}")
    shards = get_field(m, "shards", "", "list")
    if not shards:
        raise field_error("shards", "expected at least one shard, found []")
    files: set[str] = set()
    for i, s in enumerate(shards):
        p = f"shards[{i}]"
        if not isinstance(s, dict):
            raise field_error(p, f"expected an object, found {show_field(s)}")
        f = get_field(s, "file", p, "str")
        if Path(f).name != f or f in (".", ".."):
            raise field_error(f"{p}.file", f"names a path outside the output folder, found {show_field(f)}")
        if f in files:
            raise field_error(f"{p}.file", f"the same shard is listed twice, found {show_field(f)}")
        files.add(f)
        get_field(s, "size", p, "int>0")
        get_field(s, "header_sha256", p, "sha256")
    seen: dict[str, str] = {}

    def once(name: str, where: str) -> None:
        if name in seen:
            raise field_error(f"{where}.name", f"tensor listed twice (also at {seen[name]}), found {show_field(name)}")
        seen[name] = where

    for key, e in get_field(m, "tensors", "", "dict").items():
        p = f"tensors[{show_field(key)}]"
        _tensor_entry(e, p, files)
        if e["name"] != key:
            raise field_error(f"{p}.name", f"expected the entry's key {show_field(key)}, found {show_field(e['name'])}")
        once(key, p)
    layers = get_field(m, "moe_layers", "", "list")
    if not layers:
        raise field_error("moe_layers", "expected at least one MoE layer, found []")
    numbers: dict[object, str] = {}
    for i, raw in enumerate(layers):
        p = f"moe_layers[{i}]"
        if not isinstance(raw, dict):
            raise field_error(p, f"expected an object, found {show_field(raw)}")
        prefix = get_field(raw, "prefix", p, "str")
        number = get_field(raw, "layer", p, "int>=0")
        for key, value in (("prefix", prefix), ("layer", number)):
            if (key, value) in numbers:  # load(layers=[3]) must mean one layer
                raise field_error(f"{p}.{key}", f"also the {key} of {numbers[key, value]}, found {show_field(value)}")
            numbers[key, value] = p
        named = re.search(r"(?:^|\.)layers\.(\d+)\.", prefix)
        if named and int(named[1]) != number:
            raise field_error(f"{p}.layer", f"expected {named[1]} (the prefix's layer), found {number}")
        n = get_field(raw, "num_experts", p, "int>0")
        n_global = get_field(raw, "num_experts_global", p, "int>0")
        e0 = get_field(raw, "expert_offset", p, "int>=0")
        if e0 + n > n_global:
            raise field_error(f"{p}.num_experts", f"experts {e0}..{e0 + n - 1} run past num_experts_global "
                              f"{n_global}")
        zero = get_field(raw, "zero_experts", p, "dict", default=None)
        if zero is not None:
            get_field(zero, "num", f"{p}.zero_experts", "int>0")
            one_of(zero, "type", f"{p}.zero_experts", ZERO_EXPERT_TYPES)
        top_k = get_field(raw, "top_k", p, "int>0|null")
        if top_k is not None and top_k > n_global + (zero["num"] if zero else 0):
            raise field_error(f"{p}.top_k", f"expected at most num_experts_global {n_global}"
                              + (" + zero_experts.num" if zero else "") + f", found {top_k}")
        sizes = {k: get_field(raw, k, p, "int>0") for k in ("hidden_size", "intermediate_size", "intermediate_size_total",
                                                      "intermediate_size_padded", "hidden_size_padded")}
        for real, padded in (("hidden_size", "hidden_size_padded"), ("intermediate_size", "intermediate_size_padded")):
            if sizes[padded] < sizes[real]:
                raise field_error(f"{p}.{padded}", f"expected at least {real} {sizes[real]}, found {sizes[padded]}")
        activation = one_of(raw, "activation", p, tuple(_ACTIVATIONS))
        params = get_field(raw, "activation_params", p, "dict")
        for k, v in params.items():
            if k not in _ACTIVATIONS[activation]:
                raise field_error(f"{p}.activation_params.{k}", f"unknown parameter of {activation} (expected "
                                  f"{', '.join(_ACTIVATIONS[activation]) or 'none'})")
            if not _is_num(v):
                raise field_error(f"{p}.activation_params.{k}", f"expected a number, found {show_field(v)}")
        get_field(raw, "has_bias", p, "bool")
        get_field(raw, "apply_router_weight_on_input", p, "bool", default=False)
        get_field(raw, "bias_dtype", p, "float_dtype|null")
        for key in ("scheme", "source_scheme"):
            get_field(raw, key, p, "dict")  # its fields: layouts/output.py (parse_scheme)
        get_field(raw, "router", p, "list[str]")
        get_field(raw, "shared_experts", p, "list[str]")
        get_field(raw, "layout_metadata", p, "dict")
        get_field(raw, "warnings", p, "list[str]")
        if "quality" in raw:
            _check_quality(raw["quality"], f"{p}.quality")
        tensors = get_field(raw, "tensors", p, "dict")
        if not tensors:
            raise field_error(f"{p}.tensors", "expected the layer's expert tensors, found {}")
        for suffix, e in tensors.items():
            tp = f"{p}.tensors.{suffix}"
            _tensor_entry(e, tp, files)
            if e["name"] != f"{prefix}.{suffix}":
                raise field_error(f"{tp}.name", f"expected {show_field(prefix + '.' + suffix)}, found {show_field(e['name'])}")
            once(e["name"], tp)
        if "tp_sizes" in raw:
            _tp_sizes(raw, p, prefix, files, once)
        for key in ("router", "shared_experts"):
            for name in raw[key]:
                if name not in m["tensors"]:
                    raise field_error(f"{p}.{key}", f"names a tensor the manifest does not list, found {show_field(name)}")
    copied = get_field(m, "copied_files", "", "dict")
    if CONFIG_NAME not in copied:  # every source has one, and routing reads it: its checksum is not optional
        raise field_error("copied_files", f"expected an entry for {CONFIG_NAME}, found {show_field(sorted(copied))}")
    for name, d in copied.items():
        p = f"copied_files[{show_field(name)}]"
        if Path(name).name != name or name in (".", ".."):
            raise field_error(p, "names a path outside the output folder")
        if not isinstance(d, dict):
            raise field_error(p, f"expected an object, found {show_field(d)}")
        get_field(d, "sha256", p, "sha256")
        get_field(d, "size", p, "int>=0")


# -- the shards -----------------------------------------------------------------------------------

def header_sha256(path: Path) -> str:
    """sha256 of everything before a safetensors file's data: the 8-byte length and the JSON header."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            body = f.read(min(n, _MAX_HEADER))
    except OSError as e:
        raise MoeConvertError(f"cannot read: {e.strerror}", file=str(path)) from e
    return hashlib.sha256(head + body).hexdigest()


def check_shards(root: Path, manifest: dict, hash_headers: bool = True) -> dict[str, TensorInfo]:
    """Every shard present, of its size (and with ``hash_headers`` of its header checksum); every tensor
    of the manifest in its shard with its shape and dtype, and no other tensor. -> name -> TensorInfo."""
    infos: dict[str, TensorInfo] = {}
    for i, shard in enumerate(manifest["shards"]):
        path = root / shard["file"]
        if not path.is_file():
            raise MoeConvertError("shard listed in the manifest is missing", file=str(path))
        size = path.stat().st_size
        if size != shard["size"]:
            what = "truncated shard" if size < shard["size"] else "shard is larger than the manifest says"
            raise MoeConvertError(what, file=str(path), expected=f"{shard['size']} bytes", found=f"{size} bytes")
        if hash_headers:
            got = header_sha256(path)
            if got != shard["header_sha256"]:
                raise MoeConvertError("header checksum mismatch: the shard's header changed after conversion",
                                      file=str(path), tensor=f"shards[{i}].header_sha256",
                                      expected=f"sha256 {shard['header_sha256'][:16]}…", found=f"sha256 {got[:16]}…")
        infos.update(read_header(path))
    listed: dict[str, TensorInfo] = {}
    entries = [(f"tensors[{show_field(k)}]", e) for k, e in manifest["tensors"].items()]
    for i, raw in enumerate(manifest["moe_layers"]):
        entries += layer_tensor_entries(raw, i)
    for where, e in entries:
        info = infos.get(e["name"])
        if info is None:
            raise MoeConvertError(f"tensor of the manifest's {where} is in no shard", file=e["file"],
                                  tensor=e["name"])
        if (info.file.name, list(info.shape), info.dtype) != (e["file"], e["shape"], e["dtype"]):
            raise MoeConvertError(f"shard header disagrees with the manifest's {where} (file, shape, dtype)",
                                  file=info.file.name, tensor=e["name"],
                                  expected=f"{e['file']} {e['shape']} {e['dtype']}",
                                  found=f"{info.file.name} {list(info.shape)} {info.dtype}")
        listed[e["name"]] = info
    unlisted = sorted(set(infos) - set(listed))
    if unlisted:
        raise MoeConvertError("tensor in a shard but not in the manifest", file=infos[unlisted[0]].file.name,
                              tensor=unlisted[0])
    return listed
