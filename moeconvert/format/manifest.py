"""``moeconvert.json``: read it, validate every field, and check it against the shards (docs/format.md).

``moeconvert verify`` and ``moeconvert.runtime.load`` both go through :func:`check_output`, so what one
accepts the other accepts. Each refusal is one :class:`MoeConvertError` line naming the field:

* a field missing, of the wrong type or out of range
  (``moeconvert.json: moe_layers[3].num_experts: expected a positive int, found "x"``);
* a manifest that disagrees with itself or with the tensors it describes: the partition against each
  layer's expert range and per-rank intermediate size; each layer's sizes against the shapes and dtypes
  its layout plans for them (``Layout.plan``, the same call the conversion made); ``layout_metadata``
  against what the layout states for those sizes;
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

from moeconvert.canonical import LayerShape, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.format.config import CONFIG_NAME, family_name
from moeconvert.format.safetensors import DTYPES, TORCH_TO_CODE, TensorInfo, read_header
from moeconvert.layouts import Layout, get_layout
from moeconvert.layouts.base import padded_sizes
from moeconvert.mxfp4 import ROUNDINGS
from moeconvert.schemes import FLOAT_DTYPES, FloatScheme, MXFP4Scheme, Scheme, WNA16Scheme

MANIFEST_NAME = "moeconvert.json"
#: Version of the output format (the layout of ``moeconvert.json`` and the tensor naming contract).
FORMAT_VERSION = 2
#: the first format version whose manifest records a sha256 of every shard header (``shards[].header_sha256``)
HEADER_CHECKSUMS_SINCE = 2
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_QUANT_FORMATS = ("mxfp4",)
#: activation -> the parameters it takes (docs/runtime.md, "Activations")
_ACTIVATIONS = {"silu": (), "swigluoai": ("alpha", "limit")}
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

def _show(v: object) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def field_error(where: str, message: str) -> MoeConvertError:
    """One line: ``moeconvert.json: <field path>: <message>``."""
    return MoeConvertError(message, file=MANIFEST_NAME, tensor=where)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "str|null": (lambda v: v is None or (isinstance(v, str) and v != ""), "a non-empty string or null"),
    "int>0": (lambda v: _is_int(v) and v > 0, "a positive int"),
    "int>=0": (lambda v: _is_int(v) and v >= 0, "a non-negative int"),
    "int>0|null": (lambda v: v is None or (_is_int(v) and v > 0), "a positive int or null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
                  "a list of non-empty strings"),
    "sha256": (lambda v: isinstance(v, str) and bool(_HEX64.match(v)), "a sha256 (64 lowercase hex digits)"),
    "float_dtype": (lambda v: v in FLOAT_DTYPES, " | ".join(FLOAT_DTYPES)),
    "float_dtype|null": (lambda v: v is None or v in FLOAT_DTYPES, " | ".join(FLOAT_DTYPES) + " or null"),
    "st_dtype": (lambda v: isinstance(v, str) and v in DTYPES, "a safetensors dtype code (" + ", ".join(DTYPES) + ")"),
    "shape": (lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
              "a list of non-negative ints"),
}


def _get(obj: dict, key: str, path: str, rule: str, default: object = _MISSING):
    """``obj[key]`` if it satisfies ``rule``; else a MoeConvertError naming ``path.key``."""
    where = f"{path}.{key}" if path else key
    ok, what = _RULES[rule]
    if key not in obj:
        if default is not _MISSING:
            return default
        raise field_error(where, f"missing (expected {what})")
    value = obj[key]
    if not ok(value):
        raise field_error(where, f"expected {what}, found {_show(value)}")
    return value


def _one_of(obj: dict, key: str, path: str, allowed: tuple) -> object:
    where = f"{path}.{key}" if path else key
    if key not in obj:
        raise field_error(where, f"missing (expected {' | '.join(map(str, allowed))})")
    if isinstance(obj[key], bool) or obj[key] not in allowed:
        raise field_error(where, f"expected {' | '.join(map(str, allowed))}, found {_show(obj[key])}")
    return obj[key]


def _exact_keys(obj: dict, path: str, keys: set[str]) -> None:
    extra = sorted(set(obj) - keys)
    if extra:
        raise field_error(f"{path}.{extra[0]}", f"unknown field (expected only {', '.join(sorted(keys))})")


def parse_scheme(obj: object, path: str) -> Scheme:
    """A scheme object (``{"kind": ...}``), every field checked, no unknown field."""
    if not isinstance(obj, dict):
        raise field_error(path, f"expected an object, found {_show(obj)}")
    kind = _one_of(obj, "kind", path, ("float", "wna16", "mxfp4"))
    if kind == "float":
        _exact_keys(obj, path, {"kind", "dtype"})
        return FloatScheme(dtype=_get(obj, "dtype", path, "float_dtype"))
    if kind == "wna16":
        _exact_keys(obj, path, {"kind", "bits", "group_size", "symmetric", "scale_dtype"})
        bits = _one_of(obj, "bits", path, (2, 4, 8))
        group = obj.get("group_size", _MISSING)
        if group is _MISSING:
            raise field_error(f"{path}.group_size", "missing (expected -1 or a positive int)")
        if not (_is_int(group) and (group == -1 or group > 0)):
            raise field_error(f"{path}.group_size", f"expected -1 or a positive int, found {_show(group)}")
        return WNA16Scheme(bits=bits, group_size=group, symmetric=_get(obj, "symmetric", path, "bool"),
                           scale_dtype=_get(obj, "scale_dtype", path, "float_dtype"))
    _exact_keys(obj, path, {"kind", "block_size"})
    return MXFP4Scheme(block_size=_one_of(obj, "block_size", path, (32,)))


def _tensor_entry(e: object, path: str, shard_files: set[str]) -> dict:
    if not isinstance(e, dict):
        raise field_error(path, f"expected an object, found {_show(e)}")
    _get(e, "name", path, "str")
    file = _get(e, "file", path, "str")
    if file not in shard_files:
        raise field_error(f"{path}.file", f"names no shard of the manifest's shards list, found {_show(file)}")
    _get(e, "shape", path, "shape")
    _get(e, "dtype", path, "st_dtype")
    _get(e, "sha256", path, "sha256")
    return e


def _check_quality(q: object, path: str) -> None:
    if not isinstance(q, dict) or not all(isinstance(v, dict) and all(_is_num(x) for x in v.values())
                                          for v in q.values()):
        raise field_error(path, f"expected an object of objects of numbers, found {_show(q)}")


def validate_fields(m: dict) -> None:
    """Every field of the manifest present, of its type and in its range (docs/format.md)."""
    _get(m, "tool_version", "", "str")
    src = _get(m, "source", "", "dict")
    _get(src, "id", "source", "str")
    _get(src, "revision", "source", "str|null")
    for name, d in _get(src, "files", "source", "dict").items():
        p = f"source.files[{_show(name)}]"
        if not isinstance(d, dict):
            raise field_error(p, f"expected an object, found {_show(d)}")
        _get(d, "sha256", p, "sha256")
        _get(d, "size", p, "int>=0")
    _get(m, "family", "", "str")
    _get(m, "dtype", "", "float_dtype")
    if "quantization" not in m:
        raise field_error("quantization", "missing (expected an object or null)")
    quant = m["quantization"]
    if quant is not None:
        if not isinstance(quant, dict):
            raise field_error("quantization", f"expected an object or null, found {_show(quant)}")
        _exact_keys(quant, "quantization", {"format", "rounding"})
        _one_of(quant, "format", "quantization", _QUANT_FORMATS)
        _one_of(quant, "rounding", "quantization", tuple(ROUNDINGS))
    if "scheme" not in m:
        raise field_error("scheme", "missing (expected a scheme object or null)")
    if m["scheme"] is not None:
        parse_scheme(m["scheme"], "scheme")
    _get(m, "backend", "", "str")
    lay = _get(m, "layout", "", "dict")
    _get(lay, "name", "layout", "str")
    _get(lay, "version", "layout", "int>0")
    _get(lay, "kernel", "layout", "str")
    made_for = _get(lay, "made_for", "layout", "dict")
    for k, v in made_for.items():
        if not isinstance(v, str):
            raise field_error(f"layout.made_for.{k}", f"expected a version string, found {_show(v)}")
    part = _get(m, "partition", "", "dict")
    _exact_keys(part, "partition", {"tp_size", "tp_rank", "ep_size", "ep_rank"})
    for size, rank in (("tp_size", "tp_rank"), ("ep_size", "ep_rank")):
        n = _get(part, size, "partition", "int>0")
        r = _get(part, rank, "partition", "int>=0")
        if r >= n:
            raise field_error(f"partition.{rank}", f"expected a rank below partition.{size} {n}, found {r}")
    shards = _get(m, "shards", "", "list")
    if not shards:
        raise field_error("shards", "expected at least one shard, found []")
    files: set[str] = set()
    for i, s in enumerate(shards):
        p = f"shards[{i}]"
        if not isinstance(s, dict):
            raise field_error(p, f"expected an object, found {_show(s)}")
        f = _get(s, "file", p, "str")
        if Path(f).name != f or f in (".", ".."):
            raise field_error(f"{p}.file", f"names a path outside the output folder, found {_show(f)}")
        if f in files:
            raise field_error(f"{p}.file", f"the same shard is listed twice, found {_show(f)}")
        files.add(f)
        _get(s, "size", p, "int>0")
        _get(s, "header_sha256", p, "sha256")
    seen: dict[str, str] = {}

    def once(name: str, where: str) -> None:
        if name in seen:
            raise field_error(f"{where}.name", f"tensor listed twice (also at {seen[name]}), found {_show(name)}")
        seen[name] = where

    for key, e in _get(m, "tensors", "", "dict").items():
        p = f"tensors[{_show(key)}]"
        _tensor_entry(e, p, files)
        if e["name"] != key:
            raise field_error(f"{p}.name", f"expected the entry's key {_show(key)}, found {_show(e['name'])}")
        once(key, p)
    layers = _get(m, "moe_layers", "", "list")
    if not layers:
        raise field_error("moe_layers", "expected at least one MoE layer, found []")
    numbers: dict[object, str] = {}
    for i, raw in enumerate(layers):
        p = f"moe_layers[{i}]"
        if not isinstance(raw, dict):
            raise field_error(p, f"expected an object, found {_show(raw)}")
        prefix = _get(raw, "prefix", p, "str")
        number = _get(raw, "layer", p, "int>=0")
        for key, value in (("prefix", prefix), ("layer", number)):
            if (key, value) in numbers:  # load(layers=[3]) must mean one layer
                raise field_error(f"{p}.{key}", f"also the {key} of {numbers[key, value]}, found {_show(value)}")
            numbers[key, value] = p
        named = re.search(r"(?:^|\.)layers\.(\d+)\.", prefix)
        if named and int(named[1]) != number:
            raise field_error(f"{p}.layer", f"expected {named[1]} (the prefix's layer), found {number}")
        n = _get(raw, "num_experts", p, "int>0")
        n_global = _get(raw, "num_experts_global", p, "int>0")
        e0 = _get(raw, "expert_offset", p, "int>=0")
        if e0 + n > n_global:
            raise field_error(f"{p}.num_experts", f"experts {e0}..{e0 + n - 1} run past num_experts_global "
                              f"{n_global}")
        top_k = _get(raw, "top_k", p, "int>0|null")
        if top_k is not None and top_k > n_global:
            raise field_error(f"{p}.top_k", f"expected at most num_experts_global {n_global}, found {top_k}")
        sizes = {k: _get(raw, k, p, "int>0") for k in ("hidden_size", "intermediate_size", "intermediate_size_total",
                                                      "intermediate_size_padded", "hidden_size_padded")}
        for real, padded in (("hidden_size", "hidden_size_padded"), ("intermediate_size", "intermediate_size_padded")):
            if sizes[padded] < sizes[real]:
                raise field_error(f"{p}.{padded}", f"expected at least {real} {sizes[real]}, found {sizes[padded]}")
        activation = _one_of(raw, "activation", p, tuple(_ACTIVATIONS))
        params = _get(raw, "activation_params", p, "dict")
        for k, v in params.items():
            if k not in _ACTIVATIONS[activation]:
                raise field_error(f"{p}.activation_params.{k}", f"unknown parameter of {activation} (expected "
                                  f"{', '.join(_ACTIVATIONS[activation]) or 'none'})")
            if not _is_num(v):
                raise field_error(f"{p}.activation_params.{k}", f"expected a number, found {_show(v)}")
        _get(raw, "has_bias", p, "bool")
        _get(raw, "bias_dtype", p, "float_dtype|null")
        for key in ("scheme", "source_scheme"):
            if key not in raw:
                raise field_error(f"{p}.{key}", "missing (expected a scheme object)")
            parse_scheme(raw[key], f"{p}.{key}")
        _get(raw, "router", p, "list[str]")
        _get(raw, "shared_experts", p, "list[str]")
        _get(raw, "layout_metadata", p, "dict")
        _get(raw, "warnings", p, "list[str]")
        if "quality" in raw:
            _check_quality(raw["quality"], f"{p}.quality")
        tensors = _get(raw, "tensors", p, "dict")
        if not tensors:
            raise field_error(f"{p}.tensors", "expected the layer's expert tensors, found {}")
        for suffix, e in tensors.items():
            tp = f"{p}.tensors.{suffix}"
            _tensor_entry(e, tp, files)
            if e["name"] != f"{prefix}.{suffix}":
                raise field_error(f"{tp}.name", f"expected {_show(prefix + '.' + suffix)}, found {_show(e['name'])}")
            once(e["name"], tp)
        for key in ("router", "shared_experts"):
            for name in raw[key]:
                if name not in m["tensors"]:
                    raise field_error(f"{p}.{key}", f"names a tensor the manifest does not list, found {_show(name)}")
    copied = _get(m, "copied_files", "", "dict")
    if CONFIG_NAME not in copied:  # every source has one, and routing reads it: its checksum is not optional
        raise field_error("copied_files", f"expected an entry for {CONFIG_NAME}, found {_show(sorted(copied))}")
    for name, d in copied.items():
        p = f"copied_files[{_show(name)}]"
        if Path(name).name != name or name in (".", ".."):
            raise field_error(p, "names a path outside the output folder")
        if not isinstance(d, dict):
            raise field_error(p, f"expected an object, found {_show(d)}")
        _get(d, "sha256", p, "sha256")
        _get(d, "size", p, "int>=0")


# -- consistency ----------------------------------------------------------------------------------

@dataclass
class CheckedLayer:
    """One MoE layer of a validated manifest, with what its tensors are decoded with."""

    where: str  # "moe_layers[i]", for messages
    raw: dict
    scheme: Scheme
    layout: Layout
    shape: LayerShape  # what the layout planned with (padded H, I for MXFP4)


def layer_shape_from_manifest(entry: dict, dtype: str) -> LayerShape:
    """The LayerShape the layout planned with: padded sizes (and the real ones in ``extra``) for MXFP4."""
    H, I, extra = entry["hidden_size"], entry["intermediate_size"], {}
    if entry["scheme"]["kind"] == "mxfp4":
        extra = {"hidden_size_unpadded": H, "intermediate_size_unpadded": I}
        H, I = entry["hidden_size_padded"], entry["intermediate_size_padded"]
    return LayerShape(num_experts=entry["num_experts"], hidden_size=H, intermediate_size=I,
                      has_bias=entry["has_bias"], activation=entry["activation"], dtype=dtype,
                      bias_dtype=entry.get("bias_dtype"), extra=extra)


def check_layout(manifest: dict, kind: str, made_for: bool = True) -> Layout:
    """The registered layout of this name for this scheme kind, if the file's layout version (and, with
    ``made_for``, the kernel library versions it was made for) are this moeconvert's."""
    info = manifest["layout"]
    layout = get_layout(info["name"], kind)
    if kind not in layout.schemes:
        raise MoeConvertError("this moeconvert has no layout of that name for these experts", file=MANIFEST_NAME,
                              tensor=f"layout {layout.name}", expected=", ".join(layout.schemes), found=kind)
    if info["version"] != layout.version:
        newer = info["version"] > layout.version
        raise MoeConvertError(
            "layout version " + ("is newer than this moeconvert knows (upgrade moeconvert)" if newer
                                 else "differs from this moeconvert's (convert the checkpoint again)"),
            file=MANIFEST_NAME, tensor=f"layout {layout.name}", expected=layout.version, found=info["version"])
    if made_for and dict(info["made_for"]) != dict(layout.made_for):
        raise MoeConvertError(
            "layout was made for other kernel library versions than this moeconvert's layout targets "
            "(its bytes may not be what those kernels read; convert again)", file=MANIFEST_NAME,
            tensor=f"layout {layout.name} made_for", expected=dict(layout.made_for), found=dict(info["made_for"]))
    return layout


def _json_equal(a: object, b: object) -> bool:
    return json.loads(json.dumps(a)) == json.loads(json.dumps(b))


def check_layer(manifest: dict, i: int, made_for: bool = True) -> CheckedLayer:
    """One layer's fields against the partition and against the shapes its layout plans for its sizes."""
    raw, p = manifest["moe_layers"][i], f"moe_layers[{i}]"
    part = Partition(**manifest["partition"])
    n, n_global, e0 = raw["num_experts"], raw["num_experts_global"], raw["expert_offset"]
    if part.ep_size > n_global:
        raise field_error("partition.ep_size", f"expected at most {p}.num_experts_global {n_global}, "
                          f"found {part.ep_size}")
    a, b = part.expert_range(n_global)
    if (e0, e0 + n) != (a, b):
        raise field_error(f"{p}.num_experts", f"{n} experts from expert_offset {e0} disagree with the partition "
                          f"(ep_size {part.ep_size}, ep_rank {part.ep_rank} of num_experts_global {n_global} hold "
                          f"{b - a} experts from {a})")
    # the layer's block (``model.layers.3.mlp``) holds its experts, its router and its shared experts:
    # a tensor of the block in neither list would be silently left out of ``block()``
    block = raw["prefix"].rsplit(".", 1)[0] + "."
    named = set(raw["router"]) | set(raw["shared_experts"])
    for name in manifest["tensors"]:
        if name.startswith(block) and not name.startswith(raw["prefix"] + ".") and name not in named:
            raise field_error(p, f"{name} belongs to the layer's block {block[:-1]} but is in neither router nor "
                              "shared_experts")
    I, I_total = raw["intermediate_size"], raw["intermediate_size_total"]
    if I * part.tp_size != I_total:
        raise field_error(f"{p}.intermediate_size", f"{I} per TP rank x partition.tp_size {part.tp_size} != "
                          f"intermediate_size_total {I_total}")
    scheme = parse_scheme(raw["scheme"], f"{p}.scheme")
    layout = check_layout(manifest, scheme.kind, made_for)
    if manifest["backend"] != layout.name:
        raise field_error("backend", f"expected the layout's name {_show(layout.name)}, found {_show(manifest['backend'])}")
    if scheme.kind == "mxfp4":
        # MXFP4 outputs hold H and I zero-padded to the layout's multiples (convert.layer_shape)
        want = padded_sizes(raw["hidden_size"], I, layout.pad_multiples)
        for key, size in zip(("hidden_size_padded", "intermediate_size_padded"), want):
            if raw[key] != size:
                raise field_error(f"{p}.{key}", f"expected {size} for layout {layout.name}, found {raw[key]}")
    if raw["has_bias"] != (raw["bias_dtype"] is not None):
        raise field_error(f"{p}.bias_dtype", f"expected {'a dtype' if raw['has_bias'] else 'null'} with has_bias "
                          f"{json.dumps(raw['has_bias'])}, found {_show(raw['bias_dtype'])}")
    shape = layer_shape_from_manifest(raw, manifest["dtype"])
    sizes = (f"num_experts {n}, hidden_size {shape.hidden_size}, intermediate_size {shape.intermediate_size}, "
             f"{scheme.describe()}")
    try:
        problems = layout.check(shape, scheme)
        if problems:
            raise field_error(p, f"layout {layout.name} cannot hold a layer of {sizes}: {problems[0]}")
        specs = {s.suffix: s for s in layout.plan(shape, scheme)}
        metadata = layout.layer_metadata(shape, scheme)
    except MoeConvertError:
        raise
    except Exception as e:  # noqa: BLE001 - a layout's own assertion on sizes no conversion could write
        raise field_error(p, f"layout {layout.name} cannot plan a layer of {sizes}: {e}") from e
    tensors = raw["tensors"]
    if set(tensors) != set(specs):
        raise field_error(f"{p}.tensors", f"layout {layout.name} writes {sorted(specs)} for this layer, "
                          f"found {sorted(tensors)}")
    for suffix, spec in specs.items():
        e = tensors[suffix]
        if not e["shape"] or e["shape"][0] != n:
            raise field_error(f"{p}.num_experts", f"{n} disagrees with the leading dim of {suffix} {e['shape']}")
        if list(spec.shape) != e["shape"] or TORCH_TO_CODE[spec.dtype] != e["dtype"]:
            raise field_error(f"{p}.tensors.{suffix}", f"layout {layout.name} plans {list(spec.shape)} "
                              f"{TORCH_TO_CODE[spec.dtype]} for {sizes}, found {e['shape']} {e['dtype']}")
    if not _json_equal(raw["layout_metadata"], metadata):
        raise field_error(f"{p}.layout_metadata", f"expected what layout {layout.name} states for {sizes}: "
                          f"{_show(metadata)}, found {_show(raw['layout_metadata'])}")
    for key, size in (("hidden_size_padded", metadata.get("hidden_size_padded", shape.hidden_size)),
                      ("intermediate_size_padded", metadata.get("intermediate_size_padded", shape.intermediate_size))):
        if raw[key] != size:
            raise field_error(f"{p}.{key}", f"expected {size} for layout {layout.name}, found {raw[key]}")
    return CheckedLayer(p, raw, scheme, layout, shape)


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
    entries = [(f"tensors[{_show(k)}]", e) for k, e in manifest["tensors"].items()]
    entries += [(f"moe_layers[{i}].tensors.{suffix}", e) for i, raw in enumerate(manifest["moe_layers"])
                for suffix, e in raw["tensors"].items()]
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


# -- all of it ------------------------------------------------------------------------------------

@dataclass
class CheckedOutput:
    """A converted folder whose manifest, layers, shards and config were checked (:func:`check_output`)."""

    root: Path
    manifest: dict
    layers: list[CheckedLayer]
    infos: dict[str, TensorInfo]  # every tensor of the output, name -> where its bytes are
    sha256: dict[str, str]  # every tensor of the output, name -> the manifest's sha256
    config: dict


def check_output(root: Path, *, hash_headers: bool = True, made_for: bool = True) -> CheckedOutput:
    """Read and check everything but the tensor data (see the module docstring). ``hash_headers``:
    compare each shard header's sha256 with the manifest's, and config.json's with ``copied_files``."""
    manifest = read_manifest(root)
    validate_fields(manifest)
    infos = check_shards(root, manifest, hash_headers)
    layers = [check_layer(manifest, i, made_for) for i in range(len(manifest["moe_layers"]))]
    schemes = list(dict.fromkeys(cl.scheme for cl in layers))
    common = schemes[0] if len(schemes) == 1 else None
    if (parse_scheme(manifest["scheme"], "scheme") if manifest["scheme"] is not None else None) != common:
        raise field_error("scheme", "expected " + ("the layers' scheme " + _show(common.to_json()) if common else
                                                   "null (the layers' schemes differ)")
                          + f", found {_show(manifest['scheme'])}")
    config = read_output_config(root, manifest["copied_files"][CONFIG_NAME] if hash_headers else None)
    family = family_name(config)  # the conversion's own reading of the config
    if family != manifest["family"]:
        raise field_error("family", f"expected {_show(family)} (what config.json describes), "
                          f"found {_show(manifest['family'])}")
    text = config.get("text_config")
    routing = text if isinstance(text, dict) and "num_experts_per_tok" not in config else config
    top_k = routing.get("num_experts_per_tok")
    for cl in layers:  # the conversion took top_k from there; the runtime's router uses the manifest's
        if _is_int(top_k) and cl.raw["top_k"] != top_k:
            raise field_error(f"{cl.where}.top_k", f"expected {top_k} (config.json num_experts_per_tok), "
                              f"found {_show(cl.raw['top_k'])}")
    sha = {e["name"]: e["sha256"] for e in manifest["tensors"].values()}
    sha.update({e["name"]: e["sha256"] for raw in manifest["moe_layers"] for e in raw["tensors"].values()})
    return CheckedOutput(root, manifest, layers, infos, sha, config)
