"""A converted output checked against the layouts that wrote it (docs/format.md, "Checking an output").

:func:`check_output` is what ``moeconvert verify`` and ``moeconvert.runtime.load`` both call, so what one
accepts the other accepts: the manifest's fields (``moeconvert.format.manifest.validate_fields``), the
shards' sizes, header checksums and tensors (``check_shards``), then what needs the layouts: every scheme
object parsed, the partition against each layer's expert range and per-rank intermediate size, each
layer's sizes against the shapes and dtypes its layout plans for them (``Layout.plan``, the same call the
conversion made), ``layout_metadata`` against what the layout states for those sizes, and the family and
top-k against the output's config.json. Each refusal is one :class:`MoeConvertError` line naming the field.

It lives here rather than in ``moeconvert.format`` because it asks the layouts, and the format is the
bottom layer the layouts themselves read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from moeconvert.canonical import LayerShape, Partition
from moeconvert.errors import MoeConvertError
from moeconvert.format import CONFIG_NAME, TORCH_TO_CODE, TensorInfo, family_name
from moeconvert.format.manifest import (MANIFEST_NAME, check_shards, made_for_versions, exact_keys, field_error, get_field, is_int,
                                        layer_tensor_entries, one_of, read_manifest, read_output_config, show_field,
                                        show_mismatch,
                                        validate_fields)
from moeconvert.layouts import Layout, get_layout
from moeconvert.layouts.base import CHOICES, padded_sizes
from moeconvert.mxfp4 import ROUNDINGS
from moeconvert.schemes import FloatScheme, MXFP4Scheme, NVFP4Scheme, Scheme, WNA16Scheme

_MISSING = object()


# -- schemes --------------------------------------------------------------------------------------

def parse_scheme(obj: object, path: str) -> Scheme:
    """A scheme object (``{"kind": ...}``), every field checked, no unknown field."""
    if not isinstance(obj, dict):
        raise field_error(path, f"expected an object, found {show_field(obj)}")
    kind = one_of(obj, "kind", path, ("float", "wna16", "mxfp4", "nvfp4"))
    if kind == "float":
        exact_keys(obj, path, {"kind", "dtype"})
        return FloatScheme(dtype=get_field(obj, "dtype", path, "float_dtype"))
    if kind == "wna16":
        exact_keys(obj, path, {"kind", "bits", "group_size", "symmetric", "scale_dtype"})
        bits = one_of(obj, "bits", path, (2, 4, 8))
        group = obj.get("group_size", _MISSING)
        if group is _MISSING:
            raise field_error(f"{path}.group_size", "missing (expected -1 or a positive int)")
        if not (is_int(group) and (group == -1 or group > 0)):
            raise field_error(f"{path}.group_size", f"expected -1 or a positive int, found {show_field(group)}")
        return WNA16Scheme(bits=bits, group_size=group, symmetric=get_field(obj, "symmetric", path, "bool"),
                           scale_dtype=get_field(obj, "scale_dtype", path, "float_dtype"))
    if kind == "nvfp4":
        exact_keys(obj, path, {"kind", "group_size"})
        return NVFP4Scheme(group_size=one_of(obj, "group_size", path, (16,)))
    exact_keys(obj, path, {"kind", "block_size"})
    return MXFP4Scheme(block_size=one_of(obj, "block_size", path, (32,)))



def check_schemes(m: dict) -> None:
    """Every scheme object of a manifest whose fields passed ``validate_fields`` (the top-level one, each
    layer's and its source's), and the quantization's rounding, against what this moeconvert knows."""
    quant = m["quantization"]
    if quant is not None:
        one_of(quant, "rounding", "quantization", tuple(ROUNDINGS))
    if m["scheme"] is not None:
        parse_scheme(m["scheme"], "scheme")
    for i, raw in enumerate(m["moe_layers"]):
        for key in ("scheme", "source_scheme"):
            parse_scheme(raw[key], f"moe_layers[{i}].{key}")


# -- consistency ----------------------------------------------------------------------------------

@dataclass
class CheckedLayer:
    """One MoE layer of a validated manifest, with what its tensors are decoded with."""

    where: str  # "moe_layers[i]", for messages
    raw: dict
    scheme: Scheme
    layout: Layout
    shape: LayerShape  # what the layout planned with (padded H, I for MXFP4), and its data's choices
    #: each stored TP size's rank shapes (``tp_sizes``), with each rank's choices where the layout scans
    rank_shapes: dict[int, list[LayerShape]] = field(default_factory=dict)


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
    if made_for and not made_for_within(info["made_for"], layout.made_for, layout.made_for_optional):
        raise MoeConvertError(
            "layout was made for other kernel library versions than this moeconvert's layout targets "
            "(its bytes may not be what those kernels read; convert again)", file=MANIFEST_NAME,
            tensor=f"layout {layout.name} made_for", expected=dict(layout.made_for), found=dict(info["made_for"]))
    return layout


def made_for_within(found: dict, layout_made_for: dict, optional: tuple[str, ...] = ()) -> bool:
    """Whether a folder's ``made_for`` is one this moeconvert's layout (same name and version, so the same
    bytes) stands behind: the same libraries, and for each only versions the layout lists. A folder written
    before a version was added to the list names fewer (a string: the one version then checked); one written
    before the layout named an ``optional`` key (``Layout.made_for_optional``) lacks it."""
    if not set(layout_made_for) - set(optional) <= set(found) <= set(layout_made_for):
        return False
    return all(made_for_versions(found[k]) and set(made_for_versions(found[k])) <= set(made_for_versions(v))
               for k, v in layout_made_for.items() if k in found)


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
        raise field_error("backend", f"expected the layout's name {show_field(layout.name)}, found {show_field(manifest['backend'])}")
    if scheme.kind == "mxfp4":
        # MXFP4 outputs hold H and I zero-padded to the layout's multiples (convert.layer_shape)
        want = padded_sizes(raw["hidden_size"], I, layout.pad_multiples)
        for key, size in zip(("hidden_size_padded", "intermediate_size_padded"), want):
            if raw[key] != size:
                raise field_error(f"{p}.{key}", f"expected {size} for layout {layout.name}, found {raw[key]}")
    if raw["has_bias"] != (raw["bias_dtype"] is not None):
        raise field_error(f"{p}.bias_dtype", f"expected {'a dtype' if raw['has_bias'] else 'null'} with has_bias "
                          f"{json.dumps(raw['has_bias'])}, found {show_field(raw['bias_dtype'])}")
    shape = layer_shape_from_manifest(raw, manifest["dtype"])
    sizes = (f"num_experts {n}, hidden_size {shape.hidden_size}, intermediate_size {shape.intermediate_size}, "
             f"{scheme.describe()}")
    try:
        problems = layout.check(shape, scheme)
        if problems:
            raise field_error(p, f"layout {layout.name} cannot hold a layer of {sizes}: {problems[0]}")
        specs = {s.suffix: s for s in layout.plan(shape, scheme)}
        facts = _recorded_facts(layout, raw["layout_metadata"], f"{p}.layout_metadata", shape, scheme, e0)
        metadata = layout.layer_metadata(shape, scheme, facts)
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
                          f"{show_mismatch(metadata, raw['layout_metadata'])}")
    for key, size in (("hidden_size_padded", metadata.get("hidden_size_padded", shape.hidden_size)),
                      ("intermediate_size_padded", metadata.get("intermediate_size_padded", shape.intermediate_size))):
        if raw[key] != size:
            raise field_error(f"{p}.{key}", f"expected {size} for layout {layout.name}, found {raw[key]}")
    ranks = _check_tp_sizes(manifest, raw, p, layout, scheme, shape) if "tp_sizes" in raw else {}
    return CheckedLayer(p, raw, scheme, layout, shape, ranks)


def _recorded_facts(layout: Layout, metadata: object, where: str, shape: LayerShape, scheme: Scheme,
                    expert_offset: int) -> dict | None:
    """For a layout whose bytes depend on a whole-layer fact (``Layout.layer_scan``): the facts ``metadata``
    records, checked, with the choices they decide put in ``shape.extra`` for ``decode``; else None."""
    if layout.layer_scan(shape, scheme, expert_offset) is None:
        return None
    facts = layout.recorded_facts(metadata)
    why = layout.facts_problem(facts, shape, scheme, expert_offset)
    if why is not None:
        raise field_error(where, f"layout {layout.name} records what its scan of the data found: {why}")
    shape.extra[CHOICES] = layout.choices(facts, shape, scheme)
    return facts


def rank_shape(shape: LayerShape, layout: Layout, scheme: Scheme, tp_size: int) -> LayerShape:
    """One TP rank's LayerShape, from the full layer's (MXFP4: the rank's real I padded by the layout)."""
    H = shape.extra.get("hidden_size_unpadded", shape.hidden_size)
    I = shape.extra.get("intermediate_size_unpadded", shape.intermediate_size) // tp_size
    extra = {}
    if isinstance(scheme, MXFP4Scheme):
        extra = {"hidden_size_unpadded": H, "intermediate_size_unpadded": I}
        H, I = padded_sizes(H, I, layout.pad_multiples)
    return LayerShape(num_experts=shape.num_experts, hidden_size=H, intermediate_size=I, has_bias=shape.has_bias,
                      activation=shape.activation, dtype=shape.dtype, bias_dtype=shape.bias_dtype, extra=extra)


def _check_tp_sizes(manifest: dict, raw: dict, p: str, layout: Layout, scheme: Scheme,
                    shape: LayerShape) -> dict[int, list[LayerShape]]:
    """``tp_sizes`` against the layout: a size is stored exactly where the layout cannot cut it out of the full
    tensors, and what is stored is what the layout plans for one rank, stacked ``[T, ...]``; where the layout's
    bytes depend on the data, each rank's ``rank_layout_metadata`` is what its own scan found. Returns each
    stored size's rank shapes."""
    out: dict[int, list[LayerShape]] = {}
    if manifest["partition"] != {"tp_size": 1, "tp_rank": 0, "ep_size": 1, "ep_rank": 0}:
        raise field_error(f"{p}.tp_sizes", f"only a full folder (TP 1, EP 1) holds TP sizes, this one is "
                          f"{show_field(manifest['partition'])}")
    I_total = raw["intermediate_size_total"]
    for key, v in raw["tp_sizes"].items():
        T, tp = int(key), f"{p}.tp_sizes[{show_field(key)}]"
        if I_total % T:
            raise field_error(tp, f"intermediate_size_total {I_total} is not divisible by TP size {T}")
        cuts = layout.tp_cuts(shape, scheme, T)
        if isinstance(cuts, dict) == v["stored"]:
            raise field_error(f"{tp}.stored", f"layout {layout.name} " + (
                f"cuts TP {T} out of the full tensors exactly, expected false" if v["stored"]
                else f"cannot cut TP {T} out of the full tensors ({cuts}), expected true and the rank tensors"))
        if not v["stored"]:
            continue
        rank = rank_shape(shape, layout, scheme, T)
        sizes = f"TP {T}: intermediate_size {rank.intermediate_size}, {scheme.describe()}"
        problems = layout.check(rank, scheme)
        if problems:
            raise field_error(tp, f"layout {layout.name} cannot hold a rank of {sizes}: {problems[0]}")
        if v["intermediate_size"] != I_total // T:
            raise field_error(f"{tp}.intermediate_size", f"expected {I_total // T}, found {v['intermediate_size']}")
        specs = {s.suffix: s for s in layout.plan(rank, scheme)}
        metadata = layout.layer_metadata(rank, scheme)
        if set(v["tensors"]) != set(specs):
            raise field_error(f"{tp}.tensors", f"layout {layout.name} writes {sorted(specs)} for a rank, "
                              f"found {sorted(v['tensors'])}")
        for suffix, spec in specs.items():
            e = v["tensors"][suffix]
            want = [T, *spec.shape]
            if e["shape"] != want or TORCH_TO_CODE[spec.dtype] != e["dtype"]:
                raise field_error(f"{tp}.tensors.{suffix}", f"layout {layout.name} plans {want} "
                                  f"{TORCH_TO_CODE[spec.dtype]} for {sizes}, found {e['shape']} {e['dtype']}")
        if not _json_equal(v["layout_metadata"], metadata):
            raise field_error(f"{tp}.layout_metadata", f"expected what layout {layout.name} states for {sizes}: "
                              f"{show_mismatch(metadata, v['layout_metadata'])}")
        for key2, size in (("hidden_size_padded", metadata.get("hidden_size_padded", rank.hidden_size)),
                           ("intermediate_size_padded", metadata.get("intermediate_size_padded", rank.intermediate_size))):
            if v[key2] != size:
                raise field_error(f"{tp}.{key2}", f"expected {size} for layout {layout.name}, found {v[key2]}")
        e0 = raw["expert_offset"]
        out[T] = [replace(rank, extra=dict(rank.extra)) for _ in range(T)]
        if layout.layer_scan(rank, scheme, e0) is None:
            if "rank_layout_metadata" in v:
                raise field_error(f"{tp}.rank_layout_metadata", f"layout {layout.name} decides nothing from a "
                                  "rank's data, expected no such field")
            continue
        if "rank_layout_metadata" not in v:
            raise field_error(f"{tp}.rank_layout_metadata", f"missing: layout {layout.name} records what each rank's "
                              "data decided")
        for r, (got, rs) in enumerate(zip(v["rank_layout_metadata"], out[T])):
            where = f"{tp}.rank_layout_metadata[{r}]"
            want = layout.layer_metadata(rs, scheme, _recorded_facts(layout, got, where, rs, scheme, e0))
            if not _json_equal(got, want):
                raise field_error(where, f"expected what layout {layout.name} states for {sizes} and the facts "
                                  f"recorded there: {show_mismatch(want, got)}")
    return out


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
    check_schemes(manifest)
    infos = check_shards(root, manifest, hash_headers)
    layers = [check_layer(manifest, i, made_for) for i in range(len(manifest["moe_layers"]))]
    schemes = list(dict.fromkeys(cl.scheme for cl in layers))
    common = schemes[0] if len(schemes) == 1 else None
    if (parse_scheme(manifest["scheme"], "scheme") if manifest["scheme"] is not None else None) != common:
        raise field_error("scheme", "expected " + (f"the layers' scheme: {show_mismatch(common.to_json(), manifest['scheme'])}"
                                                   if common else "null (the layers' schemes differ), found "
                                                   + show_field(manifest["scheme"])))
    config = read_output_config(root, manifest["copied_files"][CONFIG_NAME] if hash_headers else None)
    family = family_name(config)  # the conversion's own reading of the config
    if family != manifest["family"]:
        raise field_error("family", f"expected {show_field(family)} (what config.json describes), "
                          f"found {show_field(manifest['family'])}")
    text = config.get("text_config")
    routing = text if isinstance(text, dict) and "num_experts_per_tok" not in config else config
    top_k = routing.get("num_experts_per_tok")
    for cl in layers:  # the conversion took top_k from there; the runtime's router uses the manifest's
        if is_int(top_k) and cl.raw["top_k"] != top_k:
            raise field_error(f"{cl.where}.top_k", f"expected {top_k} (config.json num_experts_per_tok), "
                              f"found {show_field(cl.raw['top_k'])}")
    sha = {e["name"]: e["sha256"] for e in manifest["tensors"].values()}
    sha.update({e["name"]: e["sha256"] for i, raw in enumerate(manifest["moe_layers"])
                for _, e in layer_tensor_entries(raw, i)})
    return CheckedOutput(root, manifest, layers, infos, sha, config)


# -- the bytes ------------------------------------------------------------------------------------

#: experts' bytes checked at a time by :func:`check_layer_bytes` (decoded and encoded again: about 4x in memory)
CHECK_CHUNK_BYTES = 256 << 20


def check_layer_bytes(layout: Layout, shape: LayerShape, scheme: Scheme, tensors: dict, prefix: str) -> None:
    """Refuse, in one line, a layer's stored ``tensors`` (suffix -> ``[E, ...]``, on any device) that hold bytes
    its layout never writes (``Layout.byte_problems``): what ``load(verify=True)`` checks beyond the digests,
    as ``verify`` does (docs/format.md, "What verify guarantees")."""
    n = shape.num_experts
    per_expert = sum(t.numel() * t.element_size() for t in tensors.values()) // max(n, 1)
    step = max(1, min(n, CHECK_CHUNK_BYTES // max(per_expert, 1)))
    for a in range(0, n, step):
        b = min(n, a + step)
        chunk = {suffix: t[a:b].cpu() for suffix, t in tensors.items()}
        try:
            block = layout.decode(chunk, shape, scheme)
        except (RuntimeError, ValueError, KeyError, IndexError) as e:
            raise MoeConvertError(f"experts {a}..{b - 1} do not decode as layout {layout.name}: {e}",
                                  tensor=prefix) from None
        problems = layout.byte_problems(chunk, block, shape)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise MoeConvertError(f"experts {a}..{b - 1}: {problems[0]}{more}: not what moeconvert wrote; convert "
                                  "the source again", tensor=prefix)
