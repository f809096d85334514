"""The model map: which tensors are the experts of which layer, in which role, with which sizes.

One :class:`Family` per model family says how its checkpoints name expert tensors and which config keys
give E, I and top-k. :func:`map_model` finds every MoE layer from the tensor names, checks each layer
against the config (sizes, expert count, which layers the config says are sparse) and against itself
(every expert has every projection, all shapes and dtypes agree), and resolves the layer's scheme.

Every config value used is read through the typed getters of ``sources`` (an error names the key), and
no loop runs to a bound the config alone gives: layers and experts are walked as the tensor names hold
them, and a layer count beyond the highest layer index in those names is refused before any walk.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

from moeconvert.errors import MoeConvertError
from moeconvert.readers import Reader, SourceFormat, source_format
from moeconvert.schemes import Scheme, float_dtype_name
from moeconvert.format import CONFIG_NAME, MODEL_TYPES, config_int, config_number, config_value, family_name, show_value
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

# Any layer's tensors (attention, norms, experts, MTP): bounds what num_hidden_layers may claim.
_ANY_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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

    def sparse_layers(self, cfg: dict, section: str = "") -> "SparseLayers | None":
        """The layers the config says have routed experts (None when it does not say how many layers)."""
        n = config_int(cfg, "num_hidden_layers", default=None, section=section)
        if n is None:
            return None
        if self.name in ("qwen2-moe", "qwen3-moe"):
            # transformers: sparse when not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
            step = config_int(cfg, "decoder_sparse_step", default=1, section=section)
            only = config_value(cfg, "mlp_only_layers", list, default=[], section=section)
            for i in only:
                if type(i) is not int or i < 0:
                    raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=f"{section}mlp_only_layers",
                                          expected="a list of layer indices (integers >= 0)", found=show_value(i))
            return SparseLayers(n, first=step - 1, step=step, skip=frozenset(only))
        if self.name in ("deepseek-v2", "deepseek-v3", "glm4-moe"):
            # transformers: sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0
            k = config_int(cfg, "first_k_dense_replace", min=0, default=0, section=section)
            freq = config_int(cfg, "moe_layer_freq", default=1, section=section)
            return SparseLayers(n, first=-(-k // freq) * freq, step=freq)
        return SparseLayers(n, first=0, step=1)


@dataclass(frozen=True)
class SparseLayers:
    """Layers ``first, first + step, ...`` below ``n``, less ``skip``: a rule, never a materialised set
    (``n`` comes from the config and may be anything)."""

    n: int
    first: int
    step: int
    skip: frozenset = frozenset()

    def __contains__(self, i: int) -> bool:
        return self.first <= i < self.n and (i - self.first) % self.step == 0 and i not in self.skip

    def __iter__(self) -> Iterator[int]:
        """In order; a caller stopping at the first layer it lacks does O(layers found + skip) steps."""
        i = self.first
        while i < self.n:
            if i not in self.skip:
                yield i
            i += self.step


FAMILIES = [
    Family("mixtral", MODEL_TYPES["mixtral"], {"w1": "gate", "w3": "up", "w2": "down"},
           ("num_local_experts",), ("intermediate_size",)),
    Family("qwen2-moe", MODEL_TYPES["qwen2-moe"], {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("num_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_expert", "shared_expert_gate")),
    Family("qwen3-moe", MODEL_TYPES["qwen3-moe"], {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("num_experts", "num_local_experts"), ("moe_intermediate_size",)),
    Family("deepseek-v2", MODEL_TYPES["deepseek-v2"], {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_experts",)),
    Family("deepseek-v3", MODEL_TYPES["deepseek-v3"], {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_experts",)),
    Family("glm4-moe", MODEL_TYPES["glm4-moe"], {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
           ("n_routed_experts", "num_local_experts"), ("moe_intermediate_size",), shared=("shared_experts",)),
    Family("gpt-oss", MODEL_TYPES["gpt-oss"], {"gate_up_proj": "gate_up", "down_proj": "down"},
           ("num_local_experts",), ("intermediate_size",), fused=True, activation="swigluoai", router=("router",)),
]
_BY_NAME = {f.name: f for f in FAMILIES}
assert list(_BY_NAME) == list(MODEL_TYPES), "one Family row per format.config.MODEL_TYPES entry, in its order"


def family_for(cfg: dict) -> Family:
    return _BY_NAME[family_name(cfg)]


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
    #: the registry name of the layer's reader (moeconvert.readers): the checkpoint format its experts are in,
    #: and that format's parsed quantization config, which the reader reads again when it decodes
    format: str = "float"
    format_config: object = None
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
    source_format: SourceFormat = SourceFormat("none")  # what config.json says the weights are

    def moe_tensor_names(self) -> set[str]:
        return {n for layer in self.layers for n in layer.source_tensors()}


def _text_config(cfg: dict) -> tuple[dict, str]:
    """The text model's config (multimodal wrappers nest it) and the key prefix that names it."""
    text = config_value(cfg, "text_config", dict, default=None)
    if text is not None and "hidden_size" in text and "hidden_size" not in cfg:
        return text, "text_config."
    return cfg, ""


def model_dtype(cfg: dict, section: str = "") -> str:
    key = "torch_dtype" if cfg.get("torch_dtype") is not None else "dtype"
    dt = config_value(cfg, key, str, default="bfloat16", section=section)
    return dt if dt in ("bfloat16", "float16", "float32") else "bfloat16"


def map_model(source: Source) -> ModelMap:
    raw_cfg = source.config
    fam = family_for(raw_cfg)
    cfg, section = _text_config(raw_cfg)
    fmt = source_format(raw_cfg)
    sizes = _sizes(cfg, fam, section)
    layers = _map_fused(source, fam, cfg, fmt, sizes) if fam.fused else _map_per_expert(source, fam, cfg, fmt, sizes)
    if not layers:
        raise MoeConvertError(f"no MoE expert tensors found for family {fam.name}", file=str(source.ident),
                              expected=_expected_names(fam), found=_sample_names(source))
    _check_sparse_layers(source, fam, cfg, section, {lm.layer for lm in layers})
    return ModelMap(family=fam, config=raw_cfg, dtype=model_dtype(cfg, section),
                    layers=sorted(layers, key=lambda x: x.layer), source_format=fmt)


def _check_sparse_layers(source: Source, fam: Family, cfg: dict, section: str, found: set[int]) -> None:
    """The layers holding experts are exactly those the config calls sparse (plus DeepSeek's MTP layers
    after the last one). Walks the config's rule only as far as the first layer it lacks."""
    sparse = fam.sparse_layers(cfg, section)
    if sparse is None:
        return
    last = max((int(m[1]) for m in map(_ANY_LAYER.search, source.tensors) if m and len(m[1]) <= 18), default=-1)
    if sparse.n > last + 1:
        raise MoeConvertError("more layers than the checkpoint has tensors for", file=CONFIG_NAME,
                              tensor=f"{section}num_hidden_layers",
                              expected=f"at most {last + 1} (the highest layer index in tensor names is {last})",
                              found=sparse.n)
    for i in sparse:
        if i not in found:
            raise MoeConvertError(f"config says layer {i} has routed experts (num_hidden_layers = {sparse.n}), but "
                                  "the checkpoint has no expert tensors for it", file=str(source.ident),
                                  tensor=f"layers.{i}", expected=_expected_names(fam), found="none")
    nextn = config_int(cfg, "num_nextn_predict_layers", min=0, default=0, section=section)
    for i in sorted(found):
        if i not in sparse and not sparse.n <= i < sparse.n + nextn:
            raise MoeConvertError(f"layer {i} has expert tensors but the config says it is dense"
                                  + (f" (num_hidden_layers = {sparse.n})" if i >= sparse.n else ""),
                                  file=str(source.ident), tensor=f"layers.{i}")


def _expected_names(fam: Family) -> str:
    if fam.fused:
        return "model.layers.L.mlp.experts.{gate_up_proj,down_proj}"
    return "…layers.L." + ("block_sparse_moe" if fam.name == "mixtral" else "mlp") + ".experts.E.{" + ",".join(fam.roles) + "}.weight"


def _sample_names(source: Source) -> str:
    names = [n for n in source.tensors if "expert" in n][:3] or list(source.tensors)[:3]
    return ", ".join(names) or "no tensors"


@dataclass(frozen=True)
class ConfigSizes:
    """E, H, I and top-k from the config, with the keys they came from (errors name those)."""

    E: int
    E_key: str
    H: int
    I: int
    I_key: str
    top_k: int | None
    section: str  # "text_config." when the sizes come from a nested text config


def _present_key(cfg: dict, keys: tuple[str, ...]) -> str:
    """The first of ``keys`` the config sets (not null); the first one when none is set."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


def _sizes(cfg: dict, fam: Family, section: str) -> ConfigSizes:
    E_key, I_key = _present_key(cfg, fam.experts_key), _present_key(cfg, fam.intermediate_key)
    E = config_int(cfg, E_key, section=section)
    H = config_int(cfg, "hidden_size", section=section)
    I = config_int(cfg, I_key, section=section)
    top_k = _routing_top_k(cfg, fam, E, E_key, section)
    return ConfigSizes(E, section + E_key, H, I, section + I_key, top_k, section)


def _routing_top_k(cfg: dict, fam: Family, E: int, E_key: str, section: str) -> int | None:
    """Top-k and the routing parameters the runtime's router reads from the copied config.json, checked
    now so that a config the router cannot follow is refused before converting, not at the first token."""
    top_k = config_int(cfg, "num_experts_per_tok", default=None, section=section)
    if top_k is not None and top_k > E:
        raise MoeConvertError("top-k is larger than the number of routed experts", file=CONFIG_NAME,
                              tensor=f"{section}num_experts_per_tok", expected=f"at most {E} ({section}{E_key})",
                              found=top_k)
    if fam.name in ("qwen2-moe", "qwen3-moe", "deepseek-v2", "deepseek-v3", "glm4-moe"):
        config_value(cfg, "norm_topk_prob", bool, default=None, section=section)
    if fam.name in ("deepseek-v2", "deepseek-v3", "glm4-moe"):
        config_number(cfg, "routed_scaling_factor", default=None, positive=True, section=section)
        method = config_value(cfg, "topk_method", str, default="greedy", section=section)
        n_group = config_int(cfg, "n_group", default=1, section=section)
        topk_group = config_int(cfg, "topk_group", default=1, section=section)
        if E % n_group:
            raise MoeConvertError("experts cannot be split into n_group equal groups", file=CONFIG_NAME,
                                  tensor=f"{section}n_group", expected=f"a divisor of {E} ({section}{E_key})",
                                  found=n_group)
        if topk_group > n_group:
            raise MoeConvertError("topk_group is larger than n_group", file=CONFIG_NAME, tensor=f"{section}topk_group",
                                  expected=f"at most {n_group} (n_group)", found=topk_group)
        grouped = fam.name != "deepseek-v2" or method == "group_limited_greedy"
        if fam.name != "deepseek-v2" and E // n_group < 2:
            # noaux_tc ranks a group by the sum of its two best scores (transformers' topk(2) per group)
            raise MoeConvertError("grouped routing needs at least 2 experts per group", file=CONFIG_NAME,
                                  tensor=f"{section}n_group", expected=f"at most {E // 2} ({E} experts / 2)",
                                  found=n_group)
        if grouped and top_k is not None and top_k > topk_group * (E // n_group):
            raise MoeConvertError("top-k is larger than the experts the kept groups hold", file=CONFIG_NAME,
                                  tensor=f"{section}num_experts_per_tok",
                                  expected=f"at most {topk_group * (E // n_group)} (topk_group x experts per group)",
                                  found=top_k)
    return top_k


def _index(source: Source, name: str, digits: str) -> int:
    """A layer or expert index from a tensor name, written as Python and transformers write it: "01" would
    silently alias expert 1, and a 5000-digit index is not an index."""
    if len(digits) > 18 or digits != str(int(digits)):
        raise MoeConvertError("layer or expert index in the tensor name is not a plain number",
                              file=source.tensors[name].file.name, tensor=name,
                              expected="0, 1, 2, ... without leading zeros", found=digits[:24])
    return int(digits)


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


def _map_per_expert(source: Source, fam: Family, cfg: dict, fmt: SourceFormat, sizes: ConfigSizes) -> list[MoELayerMap]:
    E_cfg, H_cfg, I_cfg = sizes.E, sizes.H, sizes.I
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
        by_prefix[m["prefix"]][_index(source, name, m["e"])][fam.roles[proj]][m["suffix"]] = name
        layer_of[m["prefix"]] = _index(source, name, m["layer"])

    names = sorted(source.tensors)
    layers = []
    for prefix, experts in by_prefix.items():
        ids = sorted(experts)
        if len(ids) != E_cfg or ids[-1] != E_cfg - 1:  # sorted distinct ids: exactly 0..E-1 (no range(E))
            first_gap = next((i for i, e in enumerate(ids) if e != i), len(ids))
            raise MoeConvertError("layer does not hold every routed expert", file=str(source.ident),
                                  tensor=prefix, expected=f"experts 0..{E_cfg - 1} ({sizes.E_key} = {E_cfg})",
                                  found=(f"expert {first_gap} missing" if first_gap < E_cfg else f"expert {ids[-1]}"))
        first = experts[0]
        for role in ("gate", "up", "down"):
            if role not in first:
                raise MoeConvertError(f"expert 0 has no {role} projection", file=str(source.ident),
                                      tensor=f"{prefix}.0", expected="gate, up and down", found=", ".join(sorted(first)))
        ex_list = [experts[e] for e in ids]
        reader = fmt.reader_for(prefix, {role: _module(names) for role, names in first.items()})
        scheme = reader.scheme(source, prefix, first, fmt.config)
        H, I = reader.check(source, prefix, ex_list, scheme)
        if H != H_cfg:
            raise MoeConvertError("expert hidden size disagrees with config.json hidden_size", tensor=prefix,
                                  file=str(source.ident), expected=H_cfg, found=H)
        if I != I_cfg:
            raise MoeConvertError(f"expert intermediate size disagrees with config.json {sizes.I_key}",
                                  tensor=prefix, file=str(source.ident), expected=I_cfg, found=I)
        has_bias = "bias" in first["gate"]
        router, shared = _router_and_shared(source, fam, prefix, names)
        layers.append(MoELayerMap(
            prefix=prefix, layer=layer_of[prefix], num_experts=E_cfg, top_k=sizes.top_k,
            hidden_size=H, intermediate_size=I, scheme=scheme, activation=fam.activation, activation_params={},
            has_bias=has_bias,
            bias_dtype=float_dtype_name(source.tensors[first["gate"]["bias"]].dtype) if has_bias else None,
            fused=False, format=reader.name, format_config=fmt.config, experts=ex_list, router=router, shared=shared,
        ))
    return layers


def _module(names: dict[str, str]) -> str:
    """The module a projection's tensors belong to (``…experts.0.gate_proj``), from any one of them."""
    return next(iter(names.values())).rsplit(".", 1)[0]


def _map_fused(source: Source, fam: Family, cfg: dict, fmt: SourceFormat, sizes: ConfigSizes) -> list[MoELayerMap]:
    E_cfg, H_cfg, I_cfg = sizes.E, sizes.H, sizes.I
    by_prefix: dict[str, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    layer_of = {}
    for name in source.tensors:
        m = _FUSED.match(name)
        if m:
            by_prefix[m["prefix"]][m["proj"]][m["suffix"] or "weight"] = name
            layer_of[m["prefix"]] = _index(source, name, m["layer"])
    t = source.tensors
    all_names = sorted(t)
    layers = []
    for prefix, names in by_prefix.items():
        gu, dn = dict(names.get("gate_up_proj", {})), dict(names.get("down_proj", {}))
        fused_names = {"gate_up": gu, "down": dn}
        reader: Reader = fmt.reader_for(prefix, {role: f"{prefix}.{proj}" for role, proj in
                                         (("gate_up", "gate_up_proj"), ("down", "down_proj"))})
        scheme = reader.fused_scheme(source, prefix, fused_names, E_cfg, H_cfg, I_cfg)
        has_bias = "_bias" in gu
        router, shared = _router_and_shared(source, fam, prefix, all_names)
        params = {"alpha": config_number(cfg, "swiglu_alpha", default=1.702, section=sizes.section),
                  "limit": config_number(cfg, "swiglu_limit", default=7.0, section=sizes.section)}
        layers.append(MoELayerMap(
            prefix=prefix, layer=layer_of[prefix], num_experts=E_cfg, top_k=sizes.top_k,
            hidden_size=H_cfg, intermediate_size=I_cfg, scheme=scheme, activation=fam.activation,
            activation_params=params, has_bias=has_bias,
            bias_dtype=float_dtype_name(t[gu["_bias"]].dtype) if has_bias else None, fused=True,
            format=reader.name, format_config=fmt.config, fused_names=fused_names, router=router, shared=shared,
        ))
    return layers
