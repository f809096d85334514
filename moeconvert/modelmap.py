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
from moeconvert.readers import LayerNames, SourceFormat, source_format
from moeconvert.schemes import Scheme, float_dtype_name
from moeconvert.format import CONFIG_NAME, MANIFEST_NAME, config_value, family_name, show_value
from moeconvert.format.families import (FAMILIES as TABLE, FIRST_K_DENSE, FUSED_SEPARATE, INTERLEAVE, LAYER_RANGE,
                                       LISTED, MLP_LAYER_TYPES, PER_EXPERT, SPARSE_STEP, FamilySpec, read_keys)
from moeconvert.sources import Source

# Per-expert tensors: {prefix}.{e}.{proj}.{suffix}; prefix ends in "<layers>.<L>.<block>.experts" (the
# block names of the family table: mlp, block_sparse_moe, feed_forward, ffn, moe).
_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe|feed_forward|ffn|moe)\.experts)"
    r"\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<suffix>[A-Za-z0-9_]+)$"
)
# Fused tensors: {prefix}.gate_up_proj[_bias|_blocks|_scales], {prefix}.down_proj[...]
_FUSED = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe|feed_forward|ffn)\.experts)"
    r"\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>|_bias|_blocks|_scales)$"
)
# A fused projection with a further suffix (``experts.gate_up_proj.qweight``, ``experts.down_proj_weight_scale``):
# a quantized fused form, which no reader takes
_FUSED_OTHER = re.compile(
    r"^(?:.*\.)?layers\.\d+\.(?:mlp|block_sparse_moe|feed_forward|ffn)\.experts\.(?:gate_up_proj|down_proj)[._]\w"
)


def _separate(fam: "FamilySpec") -> re.Pattern:
    """The ``fused-separate`` form (Step-3.5): ``{block}.{gate,up,down}_proj.{suffix}`` held by the MoE block
    itself, 3-D over experts."""
    return re.compile(rf"^(?P<block>(?:.*\.)?layers\.(?P<layer>\d+)\.{re.escape(fam.block)})"
                      rf"\.(?P<proj>{'|'.join(map(re.escape, fam.roles))})\.(?P<suffix>[A-Za-z0-9_]+)$")


# Any layer's tensors (attention, norms, experts, MTP): bounds what num_hidden_layers may claim.
_ANY_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: a family's declared facts (moeconvert/format/families.py)
Family = FamilySpec


def sparse_layers(fam: Family, values: dict, section: str = "") -> "SparseLayers | None":
    """The layers the config says have routed experts (None when it does not say how many layers), by
    the family's declared rule (``values``: its keys as :func:`read_keys` read them)."""
    n = values[fam.layers_key]
    if n is None:
        return None
    rule = fam.moe_layers
    if rule == SPARSE_STEP:
        # transformers' Qwen MoE decoder layer: sparse when not in mlp_only_layers and (i + 1) % step == 0
        step = values["decoder_sparse_step"]
        return SparseLayers(n, first=step - 1, step=step, skip=frozenset(values["mlp_only_layers"] or ()))
    if rule == FIRST_K_DENSE:
        # transformers' DeepSeek decoder layer: sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0
        # (a family whose model reads no layer frequency, Bailing's, declares none: every layer from k on)
        k, freq = values["first_k_dense_replace"], values.get("moe_layer_freq", 1)
        return SparseLayers(n, first=-(-k // freq) * freq, step=freq)
    if rule == MLP_LAYER_TYPES:
        types = values["mlp_layer_types"]
        if types is None:  # transformers' default: the first first_k_dense_replace layers dense
            sparse = SparseLayers(n, first=values["first_k_dense_replace"], step=1)
        elif len(types) != n or any(t not in ("dense", "sparse") for t in types):
            raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=f"{section}mlp_layer_types",
                                  expected=f'{n} entries ({section}num_hidden_layers), each "dense" or "sparse"',
                                  found=show_value(types))
        else:
            sparse = SparseLayers(n, first=0, step=1, skip=frozenset(i for i, t in enumerate(types) if t != "sparse"))
        flags = values.get("moe_layer_freq")
        # MiMo-V2: vLLM's MiMoV2FlashDecoderLayer.is_moe_layer reads a per-layer list instead; both must agree
        if isinstance(flags, list) and (len(flags) < n or any(bool(flags[i]) != (i in sparse) for i in range(n))):
            raise MoeConvertError("moe_layer_freq disagrees with mlp_layer_types", file=CONFIG_NAME,
                                  tensor=f"{section}moe_layer_freq",
                                  expected=f"at least {n} entries, nonzero exactly at the sparse layers",
                                  found=show_value(flags))
        return sparse
    if rule == INTERLEAVE:
        # vLLM's Llama4DecoderLayer: MoE when (i + 1) % interleave_moe_layer_step == 0; transformers'
        # moe_layers list, when written, must say the same
        step = values["interleave_moe_layer_step"]
        sparse = SparseLayers(n, first=step - 1, step=step)
        listed = values["moe_layers"]
        if listed is not None and (len(listed) != len(range(step - 1, n, step)) or any(i not in sparse for i in listed)):
            raise MoeConvertError("moe_layers disagrees with interleave_moe_layer_step", file=CONFIG_NAME,
                                  tensor=f"{section}moe_layers", expected=f"every {step}th layer below {n}",
                                  found=show_value(listed))
        return sparse
    if rule == LISTED:
        # Step-3.5: vLLM's _is_moe_layer reads mlp_layer_types, else the published config's moe_layers_enum
        # ("3,4,..."); without either, transformers (layers 3..) and vLLM (layers 1..) build different models
        types, listed = values["mlp_layer_types"], values["moe_layers_enum"]
        if types is not None:
            # published configs pad the list with the MTP layers' entries (transformers' Step3p7TextConfig cuts
            # a list of num_hidden_layers + num_nextn_predict_layers back to num_hidden_layers)
            nextn = values["num_nextn_predict_layers"]
            if len(types) not in (n, n + nextn) or any(t not in ("dense", "sparse") for t in types):
                raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=f"{section}mlp_layer_types",
                                      expected=f'{n} entries ({section}num_hidden_layers'
                                      + (f", or {n + nextn} with the MTP layers" if nextn else "")
                                      + '), each "dense" or "sparse"', found=show_value(types))
            return SparseLayers(n, first=0, step=1, skip=frozenset(i for i, t in enumerate(types[:n]) if t != "sparse"))
        if listed is None:
            raise MoeConvertError("the config does not say which layers are MoE (transformers then makes layers 3.. "
                                  "MoE, vLLM layers 1..)", file=CONFIG_NAME, tensor=f"{section}mlp_layer_types",
                                  expected="mlp_layer_types or moe_layers_enum", found="neither")
        items = [x.strip() for x in listed.split(",") if x.strip()]
        if not all(x.isascii() and x.isdigit() and len(x) <= 18 for x in items):
            raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=f"{section}moe_layers_enum",
                                  expected="comma-separated layer indices", found=show_value(listed))
        moe = {int(x) for x in items}
        return SparseLayers(n, first=0, step=1, skip=frozenset(i for i in range(n) if i not in moe))
    if rule == LAYER_RANGE:
        # transformers' Ernie4_5_MoeDecoderLayer: (i + 1) % interval == 0 and start <= i <= end (-1: the last)
        start = values["moe_layer_start_index"]
        end = values["moe_layer_end_index"]
        end = n - 1 if end == -1 else end
        step = values["moe_layer_interval"]
        return SparseLayers(n, first=start + (-(start + 1)) % step, step=step, stop=max(0, min(n, end + 1)))
    return SparseLayers(n, first=0, step=1)


@dataclass(frozen=True)
class SparseLayers:
    """Layers ``first, first + step, ...`` below ``n``, less ``skip``: a rule, never a materialised set
    (``n`` comes from the config and may be anything)."""

    n: int
    first: int
    step: int
    skip: frozenset = frozenset()
    stop: int | None = None  # no sparse layer at or after it (ERNIE's moe_layer_end_index + 1); None: n

    def __contains__(self, i: int) -> bool:
        stop = self.n if self.stop is None else self.stop
        return self.first <= i < stop and (i - self.first) % self.step == 0 and i not in self.skip

    def __iter__(self) -> Iterator[int]:
        """In order; a caller stopping at the first layer it lacks does O(layers found + skip) steps."""
        i = self.first
        while i < (self.n if self.stop is None else self.stop):
            if i not in self.skip:
                yield i
            i += self.step


FAMILIES = [f for f in TABLE if not f.refused]
_BY_NAME = {f.name: f for f in TABLE}


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
    #: how the source stores the experts (families.py: per-expert, fused, fused-transposed, ...)
    storage: str = PER_EXPERT
    #: the router weight scales the expert's input (Llama 4; vLLM's apply_router_weight_on_input)
    router_on_input: bool = False
    #: the registry name of the layer's reader (moeconvert.readers): the checkpoint format its experts are in,
    #: and that format's parsed quantization config, which the reader reads again when it decodes
    format: str = "float"
    format_config: object = None
    #: per-expert form: experts[e][role][suffix] = tensor name; fused form: fused_names[role][suffix]
    experts: list[dict[str, dict[str, str]]] = field(default_factory=list)
    fused_names: dict[str, dict[str, str]] = field(default_factory=dict)
    router: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    #: zero-computation experts the router may pick besides the routed ones (ids E .. E + n - 1; LongCat-Flash),
    #: and what each computes ("identity": weight * x)
    zero_experts: int = 0
    zero_expert_type: str | None = None

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
    if (source.root / MANIFEST_NAME).is_file():
        raise MoeConvertError("a folder moeconvert wrote is not a source checkpoint: `moeconvert verify` checks it, "
                              "moeconvert.runtime.load and vLLM with the plugin serve it", file=str(source.ident),
                              tensor=MANIFEST_NAME, expected="a checkpoint's own folder", found="a moeconvert folder")
    raw_cfg = source.config
    fam = family_for(raw_cfg)
    cfg, section = _text_config(raw_cfg)
    values = read_keys(cfg, fam, section)
    if fam.activation_key and values[fam.activation_key] != fam.activation:
        raise MoeConvertError(f"{fam.name}'s experts run {fam.activation}", file=CONFIG_NAME,
                              tensor=section + fam.activation_key, expected=fam.activation,
                              found=show_value(values[fam.activation_key]))
    fmt = source_format(raw_cfg)
    sizes = _sizes(cfg, values, fam, section)
    odd = next((n for n in source.tensors if _FUSED_OTHER.match(n) and not _FUSED.match(n)), None)
    if odd is not None:
        raise MoeConvertError("quantized experts stored fused (3-D) are not read: quantized experts are read per "
                              "expert", file=source.tensors[odd].file.name, tensor=odd,
                              expected=_expected_names(fam, per_expert=True))
    fused = any(m and m["block"] == fam.block for m in map(_FUSED.match, source.tensors))
    if FUSED_SEPARATE in fam.storage:
        separate = [m for m in map(_separate(fam).match, source.tensors) if m]
        quantized = next((m[0] for m in separate if m["suffix"] != "weight"), None)
        if quantized is not None:  # vLLM's loader maps FP8 / NVFP4 scales beside them; no reader here takes those
            raise MoeConvertError("quantized experts stored fused (3-D) are not read: quantized experts are read per "
                                  "expert", file=source.tensors[quantized].file.name, tensor=quantized,
                                  expected=_expected_names(fam))
        fused = bool(separate)
    if fused and not set(fam.storage) - {PER_EXPERT}:
        name = next(n for n in source.tensors if _FUSED.match(n))
        raise MoeConvertError(f"{fam.name} stores its experts per expert, but this tensor is a fused 3-D one",
                              file=source.tensors[name].file.name, tensor=name, expected=_expected_names(fam))
    if fused:
        layers = _map_fused(source, fam, values, fmt, sizes)
    else:
        layers = _map_per_expert(source, fam, values, fmt, sizes) if PER_EXPERT in fam.storage else []
    if not layers:
        raise MoeConvertError(f"no MoE expert tensors found for family {fam.name}", file=str(source.ident),
                              expected=_expected_names(fam), found=_sample_names(source))
    _check_sparse_layers(source, fam, values, section, {lm.layer for lm in layers})
    return ModelMap(family=fam, config=raw_cfg, dtype=model_dtype(cfg, section),
                    layers=sorted(layers, key=lambda x: x.layer), source_format=fmt)


def _check_sparse_layers(source: Source, fam: Family, values: dict, section: str, found: set[int]) -> None:
    """The layers holding experts are exactly those the config calls sparse (plus DeepSeek's MTP layers
    after the last one). Walks the config's rule only as far as the first layer it lacks."""
    sparse = sparse_layers(fam, values, section)
    if sparse is None:
        return
    last = max((int(m[1]) for m in map(_ANY_LAYER.search, source.tensors) if m and len(m[1]) <= 18), default=-1)
    if sparse.n > last + 1:
        raise MoeConvertError("more layers than the checkpoint has tensors for", file=CONFIG_NAME,
                              tensor=f"{section}{fam.layers_key}",
                              expected=f"at most {last + 1} (the highest layer index in tensor names is {last})",
                              found=sparse.n)
    for i in sparse:
        if i not in found:
            raise MoeConvertError(f"config says layer {i} has routed experts ({fam.layers_key} = {sparse.n}), but "
                                  "the checkpoint has no expert tensors for it", file=str(source.ident),
                                  tensor=f"layers.{i}", expected=_expected_names(fam), found="none")
    nextn = values[fam.mtp_key] if fam.mtp_key else 0
    for i in sorted(found):
        if i not in sparse and not sparse.n <= i < sparse.n + nextn:
            raise MoeConvertError(f"layer {i} has expert tensors but the config says it is dense"
                                  + (f" ({fam.layers_key} = {sparse.n})" if i >= sparse.n else ""),
                                  file=str(source.ident), tensor=f"layers.{i}")


def _expected_names(fam: Family, per_expert: bool = False) -> str:
    if FUSED_SEPARATE in fam.storage and not per_expert:
        return f"model.layers.L.{fam.block}.{{" + ",".join(fam.roles) + "}.weight (3-D over experts)"
    if PER_EXPERT not in fam.storage and not per_expert:
        return f"model.layers.L.{fam.block}.experts.{{gate_up_proj,down_proj}}"
    return f"…layers.L.{fam.block}.experts.E.{{" + ",".join(fam.roles) + "}.weight"


def _sample_names(source: Source) -> str:
    names = [n for n in source.tensors if "expert" in n][:3] or list(source.tensors)[:3]
    return ", ".join(names) or "no tensors"


@dataclass(frozen=True)
class ConfigSizes:
    """E, H, I and top-k from the config, with the keys they came from (errors name those)."""

    E: int
    E_key: str
    H: int
    H_key: str
    I: int
    I_key: str
    top_k: int | None
    section: str  # "text_config." when the sizes come from a nested text config


def _sizes(cfg: dict, values: dict, fam: Family, section: str) -> ConfigSizes:
    E, H, I = values[fam.experts_key], values[fam.hidden_key] or values["hidden_size"], values[fam.intermediate_key]
    E_key, I_key = (fam.key(k).present(cfg) for k in (fam.experts_key, fam.intermediate_key))
    top_k = _routing_top_k(values, fam, E, E_key, section)
    H_key = fam.hidden_key if values[fam.hidden_key] is not None else "hidden_size"
    return ConfigSizes(E, section + E_key, H, section + H_key, I, section + I_key, top_k, section)


def _routing_top_k(values: dict, fam: Family, E: int, E_key: str, section: str) -> int | None:
    """Top-k and the routing parameters the runtime's router reads from the copied config.json, checked
    now so that a config the router cannot follow is refused before converting, not at the first token."""
    top_k = values[fam.top_k_key]
    zero = values[fam.zero_experts_key] if fam.zero_experts_key else 0
    if top_k is not None and top_k > E + zero:
        raise MoeConvertError("top-k is larger than the number of routed experts", file=CONFIG_NAME,
                              tensor=f"{section}{fam.top_k_key}", expected=f"at most {E} ({section}{E_key})"
                              + (f" + {zero} ({section}{fam.zero_experts_key})" if zero else ""), found=top_k)
    if fam.routing in ("grouped", "softmax_group_limited"):
        method = values.get("topk_method", "greedy")
        n_group, topk_group = values.get("n_group") or 1, values.get("topk_group") or 1
        if E % n_group:
            raise MoeConvertError("experts cannot be split into n_group equal groups", file=CONFIG_NAME,
                                  tensor=f"{section}n_group", expected=f"a divisor of {E} ({section}{E_key})",
                                  found=n_group)
        if topk_group > n_group:
            raise MoeConvertError("topk_group is larger than n_group", file=CONFIG_NAME, tensor=f"{section}topk_group",
                                  expected=f"at most {n_group} (n_group)", found=topk_group)
        grouped = fam.routing == "grouped" or method == "group_limited_greedy"
        if fam.routing == "grouped" and E // n_group < 2:
            # noaux_tc ranks a group by the sum of its two best scores (transformers' topk(2) per group)
            raise MoeConvertError("grouped routing needs at least 2 experts per group", file=CONFIG_NAME,
                                  tensor=f"{section}n_group", expected=f"at most {E // 2} ({E} experts / 2)",
                                  found=n_group)
        if grouped and top_k is not None and top_k > topk_group * (E // n_group):
            raise MoeConvertError("top-k is larger than the experts the kept groups hold", file=CONFIG_NAME,
                                  tensor=f"{section}{fam.top_k_key}",
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
    beside = block.rsplit(".", 1)[0] if fam.shared_beside_block else block
    # a module's tensors, or a tensor held by the block itself (MiniMax-M2's e_score_correction_bias)
    router = sorted(n for r in fam.router for n in _with_prefix(names, f"{block}.{r}.")
                    + ([f"{block}.{r}"] if f"{block}.{r}" in source.tensors else []))
    shared = sorted(n for s in fam.shared for n in _with_prefix(names, f"{beside}.{s}."))
    return router, shared


def activation_params(fam: Family, values: dict) -> dict:
    """The activation's parameters, as the family's declared keys give them (never a null read as a
    default: families.read_key); a parameter the config leaves unset (null where allowed) is omitted."""
    return {name: values[key] for key, name in fam.activation_params if values[key] is not None}


#: Step-3.5's swiglustep: vLLM's FusedMoEBlock asserts a set swiglu_limits entry is 7.0, and its fused-MoE
#: swiglustep (swiglustep_and_mul_triton, called without a limit by apply_moe_activation) clamps at 7.0
SWIGLUSTEP_LIMIT = 7.0


def layer_activation(fam: Family, values: dict, layer: int, section: str = "") -> tuple[str, dict]:
    """The activation of MoE layer ``layer`` and its parameters: the family's, or, where the family's
    per-layer list sets the layer's entry (not absent, null or 0), the activation that list selects
    (vLLM's Step3p5 FusedMoEBlock: ``swiglu_limits[layer_idx]`` when ``layer_idx < len(swiglu_limits)``)."""
    if fam.layer_activation is not None:
        key, name, param = fam.layer_activation
        entries = values[key] or []
        value = entries[layer] if layer < len(entries) else None
        if value not in (None, 0):
            if name == "swiglustep" and value != SWIGLUSTEP_LIMIT:
                raise MoeConvertError(f"vLLM's swiglustep clamps at {SWIGLUSTEP_LIMIT} only (its Step3p5 MoE block "
                                      "asserts it)", file=CONFIG_NAME, tensor=f"{section}{key}[{layer}]",
                                      expected=f"{SWIGLUSTEP_LIMIT}, 0 or null", found=show_value(value))
            return name, {param: float(value)}
    return fam.activation, activation_params(fam, values)


def zero_experts(fam: Family, values: dict, section: str = "") -> tuple[int, str | None]:
    """(how many zero-computation experts the router picks besides the routed ones, their type)."""
    if fam.zero_experts_key is None or not values[fam.zero_experts_key]:
        return 0, None
    kind = values.get("zero_expert_type")
    if kind not in (None, "identity"):
        # vLLM's zero_experts_compute_triton computes "identity" only; transformers' LongcatFlashMoE always does
        raise MoeConvertError("zero experts of another type than identity are not computed by vLLM",
                              file=CONFIG_NAME, tensor=f"{section}zero_expert_type", expected="identity",
                              found=show_value(kind))
    return values[fam.zero_experts_key], "identity"


def _map_per_expert(source: Source, fam: Family, values: dict, fmt: SourceFormat, sizes: ConfigSizes) -> list[MoELayerMap]:
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
        reader, format_config = fmt.layer(LayerNames(
            prefix, fam.vllm_prefix(prefix), {role: _module(names) for role, names in first.items()},
            tuple(_module(names) for ex in ex_list for names in ex.values())))
        scheme = reader.scheme(source, prefix, first, format_config)
        H, I = reader.check(source, prefix, ex_list, scheme)
        if H != H_cfg:
            raise MoeConvertError(f"expert hidden size disagrees with config.json {sizes.H_key}", tensor=prefix,
                                  file=str(source.ident), expected=H_cfg, found=H)
        if I != I_cfg:
            raise MoeConvertError(f"expert intermediate size disagrees with config.json {sizes.I_key}",
                                  tensor=prefix, file=str(source.ident), expected=I_cfg, found=I)
        has_bias = "bias" in first["gate"]
        router, shared = _router_and_shared(source, fam, prefix, names)
        activation, params = layer_activation(fam, values, layer_of[prefix], sizes.section)
        zero, zero_type = zero_experts(fam, values, sizes.section)
        layers.append(MoELayerMap(
            prefix=prefix, layer=layer_of[prefix], num_experts=E_cfg, top_k=sizes.top_k,
            hidden_size=H, intermediate_size=I, scheme=scheme, activation=activation,
            activation_params=params, zero_experts=zero, zero_expert_type=zero_type,
            has_bias=has_bias,
            bias_dtype=float_dtype_name(source.tensors[first["gate"]["bias"]].dtype) if has_bias else None,
            fused=False, format=reader.name, format_config=format_config, experts=ex_list, router=router, shared=shared,
            router_on_input=fam.router_on_input,
        ))
    return layers


def _module(names: dict[str, str]) -> str:
    """The module a projection's tensors belong to (``…experts.0.gate_proj``), from any one of them."""
    return next(iter(names.values())).rsplit(".", 1)[0]


def _map_fused(source: Source, fam: Family, values: dict, fmt: SourceFormat, sizes: ConfigSizes) -> list[MoELayerMap]:
    """Layers whose experts are 3-D tensors, in the orientation the family declares (families.py); the
    reader of the checkpoint's format checks and decodes them in that orientation."""
    E_cfg, H_cfg, I_cfg = sizes.E, sizes.H, sizes.I
    storage = next(st for st in fam.storage if st != PER_EXPERT)
    by_prefix: dict[str, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    layer_of = {}
    if storage == FUSED_SEPARATE:
        # Step-3.5: the block's own {gate,up,down}_proj.weight; the experts are written under {block}.experts
        pattern = _separate(fam)
        for name in source.tensors:
            if m := pattern.match(name):
                by_prefix[f"{m['block']}.experts"][fam.roles[m["proj"]]]["weight"] = name
                layer_of[f"{m['block']}.experts"] = _index(source, name, m["layer"])
    else:
        for name in source.tensors:
            m = _FUSED.match(name)
            if m and m["block"] == fam.block:
                by_prefix[m["prefix"]][m["proj"]][m["suffix"] or "weight"] = name
                layer_of[m["prefix"]] = _index(source, name, m["layer"])
    t = source.tensors
    all_names = sorted(t)
    layers = []
    for prefix, names in by_prefix.items():
        if storage == FUSED_SEPARATE:
            fused_names = {role: dict(names.get(role, {})) for role in ("gate", "up", "down")}
            gu, dn = fused_names["gate"], fused_names["down"]
        else:
            gu, dn = dict(names.get("gate_up_proj", {})), dict(names.get("down_proj", {}))
            fused_names = {"gate_up": gu, "down": dn}
        has_bias = "_bias" in gu
        if fam.expert_bias is not None and (has_bias != fam.expert_bias or ("_bias" in dn) != fam.expert_bias):
            # gpt-oss' experts always have both biases (transformers' GptOssExperts); the other fused
            # families have none: one bias, or a bias the family does not have, is not a checkpoint of it
            missing = [f"{prefix}.{p}_bias" for p, by in (("gate_up_proj", gu), ("down_proj", dn))
                       if ("_bias" in by) != fam.expert_bias]
            raise MoeConvertError(f"{fam.name} experts " + ("have" if fam.expert_bias else "have no")
                                  + " gate_up_proj_bias and down_proj_bias", file=str(source.ident),
                                  tensor=missing[0], expected="present" if fam.expert_bias else "absent",
                                  found="missing" if fam.expert_bias else "present")
        modules = ({role: f"{prefix.rsplit('.', 1)[0]}.{proj}" for proj, role in fam.roles.items()}
                   if storage == FUSED_SEPARATE else
                   {role: f"{prefix}.{proj}" for role, proj in (("gate_up", "gate_up_proj"), ("down", "down_proj"))})
        reader, format_config = fmt.layer(LayerNames(prefix, fam.vllm_prefix(prefix), modules,
                                                     tuple(modules.values())))
        scheme = reader.fused_scheme(source, prefix, fused_names, sizes, storage)
        router, shared = _router_and_shared(source, fam, prefix, all_names)
        # the activation's parameters, as the family's declared keys give them (never a null read as a default)
        activation, params = layer_activation(fam, values, layer_of[prefix], sizes.section)
        zero, zero_type = zero_experts(fam, values, sizes.section)
        layers.append(MoELayerMap(
            prefix=prefix, layer=layer_of[prefix], num_experts=E_cfg, top_k=sizes.top_k,
            hidden_size=H_cfg, intermediate_size=I_cfg, scheme=scheme, activation=activation,
            activation_params=params, has_bias=has_bias, zero_experts=zero, zero_expert_type=zero_type,
            bias_dtype=float_dtype_name(t[gu["_bias"]].dtype) if has_bias else None, fused=True,
            format=reader.name, format_config=format_config, fused_names=fused_names, router=router, shared=shared,
            storage=storage, router_on_input=fam.router_on_input,
        ))
    return layers

