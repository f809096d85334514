"""The model map: which tensors are the experts of which layer, in which role, with which sizes.

One :class:`Family` per model family says how its checkpoints name expert tensors and which config keys
give E, I and top-k. :func:`map_model` finds every MoE layer from the tensor names, checks each layer
against the config (sizes, expert count, which layers the config says are sparse) and against itself
(every expert has every projection, all shapes and dtypes agree), and resolves the layer's scheme.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field

from moeconvert.errors import MoeConvertError
from moeconvert.schemes import FloatScheme, MXFP4Scheme, Scheme, WNA16Scheme, float_dtype_name, parse_quantization_config
from moeconvert.sources import Source

# Per-expert tensors: {prefix}.{e}.{proj}.{suffix}; prefix ends in "<layers>.<L>.<mlp>.experts".
_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts)"
    r"\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<suffix>[A-Za-z0-9_]+)$"
)
# Fused tensors (gpt-oss): {prefix}.gate_up_proj[_bias|_blocks|_scales], {prefix}.down_proj[...]
_FUSED = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)"
    r"(?P<suffix>|_bias|_blocks|_scales)$"
)

FLOAT_SUFFIXES = {"weight"}
WNA16_SUFFIXES = {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"}


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    roles: dict[str, str]  # checkpoint projection name -> gate / up / down
    experts_key: tuple[str, ...]  # config keys for the routed expert count (first present wins)
    intermediate_key: tuple[str, ...]  # config keys for the per-expert intermediate size
    fused: bool = False  # experts stored as 3-D tensors (gpt-oss)
    activation: str = "silu"
    router: tuple[str, ...] = ("gate",)  # module names under the MoE block, for inspect
    shared: tuple[str, ...] = ()

    def expected_sparse_layers(self, cfg: dict) -> set[int] | None:
        """Layers the config says have routed experts (None when the config does not say)."""
        n = cfg.get("num_hidden_layers")
        if not isinstance(n, int):
            return None
        if self.name in ("qwen2-moe", "qwen3-moe"):
            step = cfg.get("decoder_sparse_step", 1) or 1
            only = set(cfg.get("mlp_only_layers") or [])
            return {i for i in range(n) if i not in only and (i + 1) % step == 0}
        if self.name in ("deepseek-v2", "deepseek-v3", "glm4-moe"):
            k = cfg.get("first_k_dense_replace", 0) or 0
            freq = cfg.get("moe_layer_freq", 1) or 1
            return {i for i in range(n) if i >= k and i % freq == 0}
        return set(range(n))


FAMILIES = [
    Family("mixtral", ("mixtral",), {"w1": "gate", "w3": "up", "w2": "down"},
           ("num_local_experts",), ("intermediate_size",)),
    Family("qwen2-moe", ("qwen2_moe",), {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("num_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_expert", "shared_expert_gate")),
    Family("qwen3-moe", ("qwen3_moe",), {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("num_experts", "num_local_experts"), ("moe_intermediate_size",)),
    Family("deepseek-v2", ("deepseek_v2",), {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_experts",)),
    Family("deepseek-v3", ("deepseek_v3", "kimi_k2"), {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_experts",)),
    Family("glm4-moe", ("glm4_moe",), {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_experts",)),
    Family("gpt-oss", ("gpt_oss",), {"gate_up_proj": "gate_up", "down_proj": "down"},
           ("num_local_experts",), ("intermediate_size",), fused=True, activation="swigluoai", router=("router",)),
]


def family_for(cfg: dict) -> Family:
    mt = cfg.get("model_type")
    text = cfg.get("text_config")
    if isinstance(text, dict) and not any(mt in f.model_types for f in FAMILIES):
        mt = text.get("model_type", mt)
    for f in FAMILIES:
        if mt in f.model_types:
            return f
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise MoeConvertError("unknown model family", file="config.json", tensor="model_type",
                          expected=f"one of {known}", found=mt)


@dataclass
class MoELayerMap:
    prefix: str  # e.g. model.layers.3.mlp.experts
    layer: int
    num_experts: int
    top_k: int | None
    hidden_size: int
    intermediate_size: int  # per expert, whole (before TP)
    scheme: Scheme
    activation: str
    activation_params: dict
    has_bias: bool
    bias_dtype: str | None
    fused: bool
    #: per-expert form: experts[e][role][suffix] = tensor name; fused form: fused_names[role][suffix]
    experts: list[dict[str, dict[str, str]]] = field(default_factory=list)
    fused_names: dict[str, dict[str, str]] = field(default_factory=dict)
    router: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)

    def source_tensors(self) -> list[str]:
        if self.fused:
            return [n for by_suffix in self.fused_names.values() for n in by_suffix.values()]
        return [n for ex in self.experts for by_suffix in ex.values() for n in by_suffix.values()]


@dataclass
class ModelMap:
    family: Family
    config: dict
    dtype: str  # the model's params dtype
    layers: list[MoELayerMap]

    def moe_tensor_names(self) -> set[str]:
        return {n for layer in self.layers for n in layer.source_tensors()}


def _cfg(cfg: dict) -> dict:
    """Text-model config (multimodal wrappers nest it)."""
    text = cfg.get("text_config")
    return text if isinstance(text, dict) and "hidden_size" in text and "hidden_size" not in cfg else cfg


def _first(cfg: dict, keys: tuple[str, ...]):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def model_dtype(cfg: dict) -> str:
    dt = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return dt if dt in ("bfloat16", "float16", "float32") else "bfloat16"


def map_model(source: Source) -> ModelMap:
    raw_cfg = source.config
    fam = family_for(raw_cfg)
    cfg = _cfg(raw_cfg)
    qconfig = parse_quantization_config(raw_cfg, "config.json")
    layers = _map_fused(source, fam, cfg) if fam.fused else _map_per_expert(source, fam, cfg, qconfig)
    if not layers:
        raise MoeConvertError(f"no MoE expert tensors found for family {fam.name}", file=str(source.ident),
                              expected=_expected_names(fam), found=_sample_names(source))
    expected = fam.expected_sparse_layers(cfg)
    if expected is not None:
        found = {lm.layer for lm in layers}
        missing = sorted(expected - found)
        if missing:
            raise MoeConvertError(f"config says layer {missing[0]} has routed experts, but the checkpoint has no "
                                  "expert tensors for it", file=str(source.ident), tensor=f"layers.{missing[0]}",
                                  expected=_expected_names(fam), found="none")
        n = cfg.get("num_hidden_layers", 0)
        extra = sorted(found - expected)
        if extra and (extra[0] < n or not cfg.get("num_nextn_predict_layers")):
            raise MoeConvertError(f"layer {extra[0]} has expert tensors but the config says it is dense",
                                  file=str(source.ident), tensor=f"layers.{extra[0]}")
    return ModelMap(family=fam, config=raw_cfg, dtype=model_dtype(cfg), layers=sorted(layers, key=lambda x: x.layer))


def _expected_names(fam: Family) -> str:
    if fam.fused:
        return "model.layers.L.mlp.experts.{gate_up_proj,down_proj}"
    return "…layers.L." + ("block_sparse_moe" if fam.name == "mixtral" else "mlp") + ".experts.E.{" + ",".join(fam.roles) + "}.weight"


def _sample_names(source: Source) -> str:
    names = [n for n in source.tensors if "expert" in n][:3] or list(source.tensors)[:3]
    return ", ".join(names) or "no tensors"


def _sizes(cfg: dict, fam: Family, source: Source) -> tuple[int, int, int | None]:
    E = _first(cfg, fam.experts_key)
    I = _first(cfg, fam.intermediate_key)
    H = cfg.get("hidden_size")
    for key, val in ((fam.experts_key[0], E), (fam.intermediate_key[0], I), ("hidden_size", H)):
        if not isinstance(val, int) or val <= 0:
            raise MoeConvertError("missing or invalid size in config", file="config.json", tensor=key,
                                  expected="a positive integer", found=val)
    return E, H, I


def _with_prefix(names: list[str], prefix: str) -> list[str]:
    """The names in sorted ``names`` that start with ``prefix`` (a contiguous run, found by bisection)."""
    i = bisect.bisect_left(names, prefix)
    j = i
    while j < len(names) and names[j].startswith(prefix):
        j += 1
    return names[i:j]


def _router_and_shared(source: Source, fam: Family, prefix: str, names: list[str]) -> tuple[list[str], list[str]]:
    """``names``: the source's tensor names, sorted (once per model, not per layer)."""
    block = prefix.rsplit(".", 1)[0]
    router = sorted(n for r in fam.router for n in _with_prefix(names, f"{block}.{r}."))
    shared = sorted(n for s in fam.shared for n in _with_prefix(names, f"{block}.{s}."))
    return router, shared


def _map_per_expert(source: Source, fam: Family, cfg: dict, qconfig) -> list[MoELayerMap]:
    E_cfg, H_cfg, I_cfg = _sizes(cfg, fam, source)
    by_prefix: dict[str, dict[int, dict[str, dict[str, str]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    layer_of: dict[str, int] = {}
    for name in source.tensors:
        m = _PER_EXPERT.match(name)
        if not m:
            continue
        proj = m["proj"]
        if proj not in fam.roles:
            raise MoeConvertError(f"unexpected expert projection '{proj}' for family {fam.name}",
                                  file=source.tensors[name].file.name, tensor=name,
                                  expected="/".join(fam.roles), found=proj)
        by_prefix[m["prefix"]][int(m["e"])][fam.roles[proj]][m["suffix"]] = name
        layer_of[m["prefix"]] = int(m["layer"])

    names = sorted(source.tensors)
    layers = []
    for prefix, experts in by_prefix.items():
        ids = sorted(experts)
        if ids != list(range(E_cfg)):
            missing = sorted(set(range(E_cfg)) - set(ids))
            raise MoeConvertError("layer does not hold every routed expert", file=str(source.ident),
                                  tensor=prefix, expected=f"experts 0..{E_cfg - 1} (config)",
                                  found=(f"expert {missing[0]} missing" if missing else f"expert {ids[-1]}"))
        first = experts[0]
        for role in ("gate", "up", "down"):
            if role not in first:
                raise MoeConvertError(f"expert 0 has no {role} projection", file=str(source.ident),
                                      tensor=f"{prefix}.0", expected="gate, up and down", found=", ".join(sorted(first)))
        ex_list = [experts[e] for e in ids]
        scheme = _layer_scheme(source, prefix, ex_list, qconfig)
        H, I = _check_expert_shapes(source, prefix, ex_list, scheme)
        if H != H_cfg:
            raise MoeConvertError("expert hidden size disagrees with config.json hidden_size", tensor=prefix,
                                  file=str(source.ident), expected=H_cfg, found=H)
        if I != I_cfg:
            raise MoeConvertError(f"expert intermediate size disagrees with config.json {fam.intermediate_key[0]}",
                                  tensor=prefix, file=str(source.ident), expected=I_cfg, found=I)
        has_bias = "bias" in first["gate"]
        router, shared = _router_and_shared(source, fam, prefix, names)
        layers.append(MoELayerMap(
            prefix=prefix, layer=layer_of[prefix], num_experts=E_cfg, top_k=cfg.get("num_experts_per_tok"),
            hidden_size=H, intermediate_size=I, scheme=scheme, activation=fam.activation, activation_params={},
            has_bias=has_bias,
            bias_dtype=float_dtype_name(source.tensors[first["gate"]["bias"]].dtype) if has_bias else None,
            fused=False, experts=ex_list, router=router, shared=shared,
        ))
    return layers


def _layer_scheme(source: Source, prefix: str, experts, qconfig) -> Scheme:
    first = experts[0]
    suffixes = set(first["gate"])
    if "weight_packed" in suffixes:
        if qconfig is None:
            raise MoeConvertError("experts are packed (weight_packed) but config.json has no compressed-tensors "
                                  "quantization_config", file="config.json", tensor=prefix)
        scale_dtype = float_dtype_name(source.tensors[first["gate"]["weight_scale"]].dtype) if "weight_scale" in suffixes else None
        if scale_dtype is None:
            raise MoeConvertError("packed experts need a float weight_scale", file=str(source.ident),
                                  tensor=f"{prefix}.0", found=", ".join(sorted(suffixes)))
        names = {role: first[role]["weight_packed"].rsplit(".", 1)[0] for role in ("gate", "up", "down")
                 if "weight_packed" in first[role]}
        scheme = qconfig.scheme_for(names, scale_dtype)
        if scheme is None:
            raise MoeConvertError("experts are packed but quantization_config's targets/ignore leave them "
                                  "unquantized", file="config.json", tensor=prefix)
        return scheme
    if "weight" in suffixes:
        dt = float_dtype_name(source.tensors[first["gate"]["weight"]].dtype)
        if dt is None:
            raise MoeConvertError("expert weights are not bf16/fp16/fp32 (unsupported quantized format)",
                                  file=str(source.ident), tensor=first["gate"]["weight"],
                                  expected="BF16, F16, F32 or compressed-tensors pack-quantized",
                                  found=source.tensors[first["gate"]["weight"]].dtype)
        if qconfig is not None:
            names = {role: first[role]["weight"].rsplit(".", 1)[0] for role in ("gate", "up", "down")}
            if qconfig.scheme_for(names, dt) is not None:
                raise MoeConvertError("quantization_config says the experts are quantized, but they are stored "
                                      "unpacked (weight, not weight_packed)", file="config.json", tensor=prefix)
        return FloatScheme(dt)
    raise MoeConvertError("unrecognised expert tensors", file=str(source.ident), tensor=f"{prefix}.0",
                          expected="weight, or weight_packed + weight_scale", found=", ".join(sorted(suffixes)))


def _check_expert_shapes(source: Source, prefix: str, experts, scheme: Scheme) -> tuple[int, int]:
    """Every expert has the same tensors with the same shapes and dtypes as expert 0; returns (H, I)."""
    t = source.tensors
    first = experts[0]
    want = {(role, suf): (t[n].shape, t[n].dtype) for role, by in first.items() for suf, n in by.items()}
    if isinstance(scheme, WNA16Scheme):
        required = {"weight_packed", "weight_scale", "weight_shape"} | ({"weight_zero_point"} if not scheme.symmetric else set())
        allowed = required | {"bias"}
    else:
        required, allowed = {"weight"}, {"weight", "bias"}
    for e, ex in enumerate(experts):
        for role in ("gate", "up", "down"):
            have = set(ex.get(role, {}))
            for suf in sorted(required - have):
                raise MoeConvertError("missing expert tensor", file=str(source.ident),
                                      tensor=f"{prefix}.{e}.<{role}>.{suf}", expected=", ".join(sorted(required)),
                                      found=", ".join(sorted(have)) or "nothing")
            for suf in sorted(have - allowed):
                raise MoeConvertError(f"unexpected expert tensor for a {scheme.describe()} layer", file=str(source.ident),
                                      tensor=ex[role][suf], expected=", ".join(sorted(allowed)), found=suf)
        got = {(role, suf): (t[n].shape, t[n].dtype) for role, by in ex.items() for suf, n in by.items()}
        if got != want:
            diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[0]
            name = ex.get(diff[0], {}).get(diff[1]) or f"{prefix}.{e}.<{diff[0]}>.{diff[1]}"
            raise MoeConvertError("expert tensors disagree across experts", file=str(source.ident), tensor=name,
                                  expected=_fmt(want.get(diff)) + " (as expert 0)", found=_fmt(got.get(diff)))
    g, u, d = (first[r] for r in ("gate", "up", "down"))
    if isinstance(scheme, WNA16Scheme):
        pf = scheme.pack_factor
        shapes = {r: tuple(int(x) for x in source.read(first[r]["weight_shape"]).tolist()) for r in ("gate", "up", "down")}
        I, H = shapes["gate"]
        _expect(source, g["weight_packed"], t[g["weight_packed"]].shape, (I, -(-H // pf)))
        checks = {"up": (I, H), "down": (H, I)}
        for r, shp in checks.items():
            if shapes[r] != shp:
                raise MoeConvertError("weight_shape disagrees with the gate projection", file=str(source.ident),
                                      tensor=first[r]["weight_shape"], expected=list(shp), found=list(shapes[r]))
        _expect(source, u["weight_packed"], t[u["weight_packed"]].shape, (I, -(-H // pf)))
        _expect(source, d["weight_packed"], t[d["weight_packed"]].shape, (H, -(-I // pf)))
        for r, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            _expect(source, first[r]["weight_scale"], t[first[r]["weight_scale"]].shape, (n, scheme.groups(k)))
            if scheme.group_size > 0 and k % scheme.group_size:
                raise MoeConvertError("input size is not a multiple of the group size", file=str(source.ident),
                                      tensor=first[r]["weight_packed"], expected=f"multiple of {scheme.group_size}", found=k)
            if not scheme.symmetric:
                _expect(source, first[r]["weight_zero_point"], t[first[r]["weight_zero_point"]].shape,
                        (-(-n // pf), scheme.groups(k)))
    else:
        I, H = t[g["weight"]].shape
        _expect(source, u["weight"], t[u["weight"]].shape, (I, H))
        _expect(source, d["weight"], t[d["weight"]].shape, (H, I))
    if "bias" in g:
        for r, n in (("gate", I), ("up", I), ("down", H)):
            if "bias" not in first[r]:
                raise MoeConvertError("expert bias on some projections only", file=str(source.ident),
                                      tensor=f"{prefix}.0.<{r}>.bias", expected="present", found="missing")
            _expect(source, first[r]["bias"], t[first[r]["bias"]].shape, (n,))
    return H, I


def _fmt(x) -> str:
    return "absent" if x is None else f"{list(x[0])} {x[1]}"


def _expect(source: Source, name: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise MoeConvertError("unexpected shape", file=source.tensors[name].file.name, tensor=name,
                              expected=list(want), found=list(got))


def _map_fused(source: Source, fam: Family, cfg: dict) -> list[MoELayerMap]:
    E_cfg, H_cfg, I_cfg = _sizes(cfg, fam, source)
    by_prefix: dict[str, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    layer_of = {}
    for name in source.tensors:
        m = _FUSED.match(name)
        if m:
            by_prefix[m["prefix"]][m["proj"]][m["suffix"] or "weight"] = name
            layer_of[m["prefix"]] = int(m["layer"])
    t = source.tensors
    all_names = sorted(t)
    layers = []
    for prefix, names in by_prefix.items():
        gu, dn = names.get("gate_up_proj", {}), names.get("down_proj", {})
        mxfp4 = any(k in by for by in (gu, dn) for k in ("_blocks", "_scales"))
        if mxfp4:
            # gpt-oss' own MXFP4 form (mxfp4-layouts.md §7): N-first, rows of gate_up interleaved
            # gate/up, low nibble = even k, e8m0 scales per 32 along K
            for proj, by in (("gate_up_proj", gu), ("down_proj", dn)):
                for suffix in ("_blocks", "_scales"):
                    if suffix not in by:
                        raise MoeConvertError("missing expert tensor", file=str(source.ident),
                                              tensor=f"{prefix}.{proj}{suffix}", expected="present", found="missing")
                    if t[by[suffix]].dtype != "U8":
                        raise MoeConvertError("MXFP4 blocks and scales must be uint8", file=t[by[suffix]].file.name,
                                              tensor=by[suffix], expected="U8", found=t[by[suffix]].dtype)
                if "weight" in by:
                    raise MoeConvertError("both MXFP4 blocks and a float weight", file=str(source.ident),
                                          tensor=by["weight"], expected="one of them", found="both")
            for n, k, blocks, scales in ((2 * I_cfg, H_cfg, gu["_blocks"], gu["_scales"]),
                                         (H_cfg, I_cfg, dn["_blocks"], dn["_scales"])):
                if k % 32:
                    raise MoeConvertError("MXFP4 experts need K divisible by 32", tensor=blocks,
                                          expected="a multiple of 32", found=k)
                _expect(source, blocks, t[blocks].shape, (E_cfg, n, k // 32, 16))
                _expect(source, scales, t[scales].shape, (E_cfg, n, k // 32))
            scheme = MXFP4Scheme()
        else:
            for proj, by in (("gate_up_proj", gu), ("down_proj", dn)):
                if "weight" not in by:
                    raise MoeConvertError("missing expert tensor", file=str(source.ident),
                                          tensor=f"{prefix}.{proj}", expected="present", found="missing")
            dt = float_dtype_name(t[gu["weight"]].dtype)
            if dt is None or t[dn["weight"]].dtype != t[gu["weight"]].dtype:
                raise MoeConvertError("fused expert weights must share one float dtype", file=str(source.ident),
                                      tensor=dn["weight"], expected=t[gu["weight"]].dtype,
                                      found=t[dn["weight"]].dtype)
            # transformers' gpt-oss: gate_up_proj [E, H, 2I] (x @ W, gate/up interleaved on the last dim),
            # down_proj [E, I, H].
            _expect(source, gu["weight"], t[gu["weight"]].shape, (E_cfg, H_cfg, 2 * I_cfg))
            _expect(source, dn["weight"], t[dn["weight"]].shape, (E_cfg, I_cfg, H_cfg))
            scheme = FloatScheme(dt)
        has_bias = "_bias" in gu
        if has_bias != ("_bias" in dn):
            raise MoeConvertError("expert bias on one projection only", file=str(source.ident), tensor=prefix)
        if has_bias:
            _expect(source, gu["_bias"], t[gu["_bias"]].shape, (E_cfg, 2 * I_cfg))
            _expect(source, dn["_bias"], t[dn["_bias"]].shape, (E_cfg, H_cfg))
        router, shared = _router_and_shared(source, fam, prefix, all_names)
        params = {"alpha": cfg.get("swiglu_alpha", 1.702), "limit": cfg.get("swiglu_limit", 7.0)}
        layers.append(MoELayerMap(
            prefix=prefix, layer=layer_of[prefix], num_experts=E_cfg, top_k=cfg.get("num_experts_per_tok"),
            hidden_size=H_cfg, intermediate_size=I_cfg, scheme=scheme, activation=fam.activation,
            activation_params=params, has_bias=has_bias,
            bias_dtype=float_dtype_name(t[gu["_bias"]].dtype) if has_bias else None, fused=True,
            fused_names={"gate_up": dict(gu), "down": dict(dn)}, router=router, shared=shared,
        ))
    return layers
