"""The model families moeconvert converts, as one declared table (docs/families.md is generated from it).

Each :class:`FamilySpec` says, as data, what a family's config.json and checkpoint hold: the config keys
that give E / top-k / H / I and which decoder layers are MoE, every config key read with its type and
whether transformers accepts null for it, where the routed experts' tensors are and in which orientation,
the activation and routing, and which transformers / vLLM classes serve the family. The conversion
(:mod:`moeconvert.modelmap`) and the runtime's router read these facts from here; nothing else names a
family. Adding a family is one entry here (plus a fixture); a family whose facts do not fit says why in
``refused``.

This module is part of the bottom layer: it imports nothing of moeconvert but the error type and the
config getters' helpers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeconvert.errors import MoeConvertError
from moeconvert.format.safetensors import show_value

CONFIG_NAME = "config.json"

#: a declared key without a default: absent or null is refused
REQUIRED = object()

# -- how the experts are stored ----------------------------------------------------------------------

#: ``{block}.experts.{e}.{proj}.weight`` (or compressed-tensors' ``weight_packed`` ...), ``[N, K]`` each
PER_EXPERT = "per-expert"
#: ``{block}.experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows), ``down_proj [E, H, I]``
FUSED = "fused"
#: ``{block}.experts.gate_up_proj [E, H, 2I]`` (``x @ W``: gate columns, then up columns), ``down_proj [E, I, H]``
FUSED_TRANSPOSED = "fused-transposed"
#: gpt-oss: ``gate_up_proj [E, H, 2I]`` with gate/up interleaved on the last dim, ``down_proj [E, I, H]``, biases;
#: or its MXFP4 form (``_blocks`` / ``_scales``, N-first, gate/up rows interleaved)
FUSED_INTERLEAVED = "fused-transposed-interleaved"
#: Step-3.5: three 3-D tensors held by the MoE block itself, ``{block}.gate_proj.weight [E, I, H]``,
#: ``{block}.up_proj.weight [E, I, H]``, ``{block}.down_proj.weight [E, H, I]`` (vLLM's Step3p5Model.load_weights:
#: "Old packed 3D format"), float only; the layer's experts are written under ``{block}.experts``, vLLM's FusedMoE
#: prefix
FUSED_SEPARATE = "fused-separate"
STORAGES = (PER_EXPERT, FUSED, FUSED_TRANSPOSED, FUSED_INTERLEAVED, FUSED_SEPARATE)

# -- which decoder layers are MoE (each rule as transformers' decoder layer decides it) --------------

ALL_LAYERS = "all"                  # every decoder layer
SPARSE_STEP = "sparse-step"         # (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
FIRST_K_DENSE = "first-k-dense"     # i >= first_k_dense_replace and i % moe_layer_freq == 0
MLP_LAYER_TYPES = "mlp-layer-types" # mlp_layer_types[i] == "sparse"; absent: i >= first_k_dense_replace
INTERLEAVE = "interleave"           # (i + 1) % interleave_moe_layer_step == 0 (moe_layers, when given, agrees)
LAYER_RANGE = "range"               # start <= i <= end and (i + 1) % interval == 0 (ERNIE-4.5)
#: Step-3.5: mlp_layer_types[i] == "sparse"; absent: i in moe_layers_enum ("3,4,..."); both absent: refused
#: (transformers' Step3p7TextConfig then makes layers 3.. sparse, vLLM's _is_moe_layer layers 1..)
LISTED = "listed"
LAYER_RULES = (ALL_LAYERS, SPARSE_STEP, FIRST_K_DENSE, MLP_LAYER_TYPES, INTERLEAVE, LAYER_RANGE, LISTED)

# -- routing (the runtime's router, moeconvert/runtime/routing.py) -----------------------------------

#: None: the family's router is not one the runtime reproduces; load() gives the layer no router and the
#: caller routes (the experts still run)
ROUTINGS = ("softmax", "grouped", "softmax_group_limited", "topk_softmax", "topk_sigmoid", None)


@dataclass(frozen=True)
class Key:
    """A config.json value the family's conversion or routing reads.

    ``kind``: ``int>=1``, ``int>=0``, ``int``, ``number``, ``number>0``, ``bool``, ``str``, ``list[int>=0]``,
    ``list[str]``. ``nullable``: transformers' config class accepts ``null`` for it (its annotation
    allows None); a null where it does not is refused, never read as the default. ``default``: the value
    when the key is absent (transformers' config default), or :data:`REQUIRED`.
    """

    name: str
    kind: str
    default: object = REQUIRED
    nullable: bool = False
    #: other names a config may give it (transformers' ``attribute_map``: Qwen3-MoE's config writes
    #: ``num_local_experts`` for ``num_experts``); the first one the config sets is read
    aliases: tuple[str, ...] = ()

    def present(self, cfg: dict) -> str:
        """The name this config gives the key (the first of name and aliases it sets, not null)."""
        return next((n for n in (self.name, *self.aliases) if cfg.get(n) is not None),
                    next((n for n in (self.name, *self.aliases) if n in cfg), self.name))


#: the vLLM versions whose model registry (``vllm/model_executor/models/registry.py``) names a class; a
#: family's ``vllm_versions`` defaults to these (tests/test_families.py checks each entry against the
#: registries in the wheels)
VLLM_REGISTRIES = ("0.33.0", "0.34.0")

KINDS = ("int>=1", "int>=0", "int", "number", "number>0", "bool", "str", "list[int>=0]", "list[str]",
         "list[number|null]")


@dataclass(frozen=True)
class FamilySpec:
    name: str  # the manifest's ``family``
    model_types: tuple[str, ...]  # config ``model_type`` values naming it (a text_config's, for wrappers)
    hf_classes: tuple[str, ...]  # transformers classes its facts were read from
    vllm_classes: tuple[str, ...]  # vLLM classes serving it (architecture names of vLLM's registry)
    keys: tuple[Key, ...] = ()  # every config key read, typed
    experts_key: str = "num_experts"  # E (routed experts)
    intermediate_key: str = "moe_intermediate_size"  # I of one routed expert
    top_k_key: str = "num_experts_per_tok"
    hidden_key: str = "hidden_size"  # H the experts see (Kimi-K3's latent MoE: routed_expert_hidden_size)
    layers_key: str = "num_hidden_layers"
    moe_layers: str = ALL_LAYERS
    block: str = "mlp"  # the MoE block's module under the decoder layer
    storage: tuple[str, ...] = (PER_EXPERT,)  # the storages a checkpoint of the family may use
    roles: dict = field(default_factory=lambda: {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
    activation: str = "silu"
    #: (config key, the manifest's activation_params name) of each activation parameter (gpt-oss' swiglu_*)
    activation_params: tuple[tuple[str, str], ...] = ()
    #: a config key that must name ``activation`` (Kimi-K3's hidden_act), or None
    activation_key: str | None = None
    #: an activation some MoE layers run instead of ``activation``: (config key of a per-layer list, that
    #: activation, the manifest's name of the parameter the list's entry gives); a layer whose entry is
    #: absent, null or 0 runs ``activation`` (Step-3.5's swiglu_limits)
    layer_activation: tuple[str, str, str] | None = None
    routing: str | None = "softmax"
    #: the router weight scales the expert's input, not its output (vLLM: apply_router_weight_on_input)
    router_on_input: bool = False
    #: fused experts: True, every checkpoint has gate_up_proj_bias and down_proj_bias; False: none has;
    #: None: either
    expert_bias: bool | None = None
    router: tuple[str, ...] = ("gate",)  # module names under the block holding the router's tensors
    shared: tuple[str, ...] = ()  # module names under the block holding shared experts (copied through)
    #: the shared experts' modules are under the decoder layer, beside the block (Step-3.5's share_expert)
    shared_beside_block: bool = False
    #: config key of the number of zero-computation experts the router may pick besides the routed experts
    #: (LongCat-Flash's zero_expert_num): they have no tensors; ids E .. E + Z - 1 each add weight * x
    zero_experts_key: str | None = None
    mtp_key: str | None = None  # config key of the MTP layers stored after the last decoder layer
    #: wrapper model_types whose ``text_config`` holds this family's config (multimodal wrappers)
    wrappers: tuple[str, ...] = ()
    #: one line: why this family's facts do not fit the table (the family is then refused with it)
    refused: str | None = None
    #: one line: why conversions of this family are planned (``--dry-run``) but not written
    plan_only: str | None = None
    #: the vLLM versions (of :data:`VLLM_REGISTRIES`) whose model registry names every one of ``vllm_classes``
    vllm_versions: tuple[str, ...] = VLLM_REGISTRIES
    #: the block name in the prefix vLLM's model class gives the MoE layer, where it is not ``block`` (vLLM's
    #: MiniMaxM2DecoderLayer holds ``block_sparse_moe`` but builds it with the prefix ``....mlp``)
    vllm_block: str | None = None
    #: the vLLM plugin was proven on this family on vLLM's CPU platform (tests/test_vllm_plugin.py: vLLM's
    #: layer holds the bytes its own processing makes from the source); the plugin refuses any other
    plugin_proven: bool = False
    #: one line: why the plugin cannot be proven on this family on vLLM's CPU platform (what it lacks), where
    #: that is known; the plugin's refusal says it
    plugin_unprovable: str | None = None

    def key(self, name: str) -> Key:
        return next(k for k in self.keys if k.name == name)

    def vllm_prefix(self, prefix: str) -> str:
        """The prefix vLLM's model class gives the MoE layer the checkpoint holds at ``prefix``."""
        return prefix if self.vllm_block is None else prefix.replace(f".{self.block}.", f".{self.vllm_block}.")


def _k(name: str, kind: str, default: object = REQUIRED, nullable: bool = False, aliases: tuple = ()) -> Key:
    return Key(name, kind, default, nullable, aliases)


# Keys shared by several families (names as transformers' configs spell them).
_H = _k("hidden_size", "int>=1")
_QWEN_ROUTING = (_k("norm_topk_prob", "bool", False),)
_DEEPSEEK_ROUTING = (_k("norm_topk_prob", "bool", None), _k("routed_scaling_factor", "number>0", 1.0),
                     _k("n_group", "int>=1", 1), _k("topk_group", "int>=1", 1), _k("topk_method", "str", "greedy"))


def _deepseek_style(name, model_types, hf, vllm, *, rule=FIRST_K_DENSE, extra=(), first_dense=0, nullable=(),
                    **kw) -> FamilySpec:
    """``nullable``: the keys this family's transformers config annotates as accepting None."""
    keys = (_H, _k("n_routed_experts", "int>=1", aliases=("num_local_experts",)), _k("moe_intermediate_size", "int>=1"),
            _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None),
            _k("first_k_dense_replace", "int>=0", first_dense), _k("moe_layer_freq", "int>=1", 1),
            _k("num_nextn_predict_layers", "int>=0", 0), *_DEEPSEEK_ROUTING, *extra)
    keys = tuple(Key(k.name, k.kind, k.default, k.nullable or k.name in nullable, k.aliases) for k in keys)
    return FamilySpec(name, model_types, hf, vllm, keys=keys, experts_key="n_routed_experts", moe_layers=rule,
                      routing=kw.pop("routing", "grouped"), shared=("shared_experts",), mtp_key="num_nextn_predict_layers",
                      **kw)


FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "mixtral", ("mixtral",), ("MixtralConfig", "MixtralForCausalLM"), ("MixtralForCausalLM",),
        keys=(_H, _k("num_local_experts", "int>=1"), _k("intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None)),
        experts_key="num_local_experts", intermediate_key="intermediate_size", block="block_sparse_moe",
        roles={"w1": "gate", "w3": "up", "w2": "down"}, plugin_proven=True),
    FamilySpec(
        "qwen2-moe", ("qwen2_moe",), ("Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock"), ("Qwen2MoeForCausalLM",),
        keys=(_H, _k("num_experts", "int>=1", aliases=("num_local_experts",)), _k("moe_intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None),
              _k("decoder_sparse_step", "int>=1", 1), _k("mlp_only_layers", "list[int>=0]", [], nullable=True),
              *_QWEN_ROUTING),
        moe_layers=SPARSE_STEP, shared=("shared_expert", "shared_expert_gate"), plugin_proven=True),
    FamilySpec(
        "qwen3-moe", ("qwen3_moe",), ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"), ("Qwen3MoeForCausalLM",),
        keys=(_H, _k("num_experts", "int>=1", aliases=("num_local_experts",)), _k("moe_intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None),
              _k("decoder_sparse_step", "int>=1", 1), _k("mlp_only_layers", "list[int>=0]", [], nullable=True),
              *_QWEN_ROUTING),
        moe_layers=SPARSE_STEP, plugin_proven=True),
    _deepseek_style("deepseek-v2", ("deepseek_v2",), ("DeepseekV2Config", "DeepseekV2Moe"), ("DeepseekV2ForCausalLM",),
                    routing="softmax_group_limited", plugin_proven=True,
                    nullable=("topk_method", "num_experts_per_tok", "norm_topk_prob", "n_group", "topk_group")),
    _deepseek_style("deepseek-v3", ("deepseek_v3", "kimi_k2"), ("DeepseekV3Config", "DeepseekV3MoE"),
                    ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"), wrappers=("kimi_k25",), plugin_proven=True,
                    nullable=("first_k_dense_replace", "num_experts_per_tok", "norm_topk_prob", "n_group", "topk_group")),
    _deepseek_style("glm4-moe", ("glm4_moe",), ("Glm4MoeConfig", "Glm4MoeMoE"), ("Glm4MoeForCausalLM",), plugin_proven=True),
    FamilySpec(
        "gpt-oss", ("gpt_oss",), ("GptOssConfig", "GptOssExperts"), ("GptOssForCausalLM",),
        keys=(_H, _k("num_local_experts", "int>=1"), _k("intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None),
              # transformers' GptOssConfig types both as float (no None): a null is refused, not read as 7.0
              _k("swiglu_alpha", "number", 1.702), _k("swiglu_limit", "number", 7.0)),
        experts_key="num_local_experts", intermediate_key="intermediate_size", storage=(FUSED_INTERLEAVED,),
        roles={"gate_up_proj": "gate_up", "down_proj": "down"}, activation="swigluoai",
        activation_params=(("swiglu_alpha", "alpha"), ("swiglu_limit", "limit")), routing="topk_softmax", router=("router",),
        expert_bias=True, plugin_proven=True),
    # -- added with the declared table ----------------------------------------------------------------
    FamilySpec(
        "qwen3.5-moe", ("qwen3_5_moe_text",),
        ("Qwen3_5MoeTextConfig", "Qwen3_5MoeExperts", "Qwen3_5MoeTopKRouter"),
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        keys=(_H, _k("num_experts", "int>=1"), _k("moe_intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None)),
        # published checkpoints keep the experts fused as the model holds them; save_pretrained splits them
        storage=(FUSED, PER_EXPERT), expert_bias=False, routing="softmax", shared=("shared_expert", "shared_expert_gate"),
        wrappers=("qwen3_5_moe",), plugin_proven=True),
    FamilySpec(
        "qwen3-next", ("qwen3_next",), ("Qwen3NextConfig", "Qwen3NextSparseMoeBlock"), ("Qwen3NextForCausalLM",),
        keys=(_H, _k("num_experts", "int>=1", aliases=("num_local_experts",)), _k("moe_intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None),
              _k("decoder_sparse_step", "int>=1", 1), _k("mlp_only_layers", "list[int>=0]", [], nullable=True),
              *_QWEN_ROUTING),
        moe_layers=SPARSE_STEP, shared=("shared_expert", "shared_expert_gate"), plugin_proven=True),
    FamilySpec(
        "minimax-m2", ("minimax_m2",), ("MiniMaxM2Config", "MiniMaxM2SparseMoeBlock", "MiniMaxM2TopKRouter"),
        ("MiniMaxM2ForCausalLM",),
        keys=(_H, _k("num_local_experts", "int>=1"), _k("intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None)),
        experts_key="num_local_experts", intermediate_key="intermediate_size", block="block_sparse_moe",
        roles={"w1": "gate", "w3": "up", "w2": "down"},
        # sigmoid scores, e_score_correction_bias for the choice, unbiased weights renormalised: the grouped
        # router with one group
        routing="grouped", router=("gate", "e_score_correction_bias"), vllm_block="mlp", plugin_proven=True),
    FamilySpec(
        "llama4", ("llama4_text",), ("Llama4TextConfig", "Llama4TextExperts", "Llama4TextMoe", "Llama4Router"),
        ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
        keys=(_H, _k("num_local_experts", "int>=1"), _k("intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None),
              _k("interleave_moe_layer_step", "int>=1", 1), _k("moe_layers", "list[int>=0]", None, nullable=True)),
        experts_key="num_local_experts", intermediate_key="intermediate_size", moe_layers=INTERLEAVE,
        # quantized checkpoints hold the experts per expert (llm-compressor's Llama 4 calibration module unfuses
        # them into one MLP per expert); vLLM's Llama4Model.load_weights maps both forms
        block="feed_forward", storage=(FUSED_TRANSPOSED, PER_EXPERT), expert_bias=False, routing="topk_sigmoid",
        router_on_input=True,
        router=("router",), shared=("shared_expert",), wrappers=("llama4",), plugin_proven=True),
    _deepseek_style("glm-moe-dsa", ("glm_moe_dsa",), ("GlmMoeDsaConfig", "GlmMoeDsaMoE"), ("GlmMoeDsaForCausalLM",),
                    rule=MLP_LAYER_TYPES, extra=(_k("mlp_layer_types", "list[str]", None, nullable=True),),
                    # proven for its weights: vLLM's CPU platform has no sparse attention backend
                    # (vllm/platforms/cpu.py get_attn_backend_cls raises for use_sparse), which the test stands in
                    plugin_proven=True),
    _deepseek_style("glm4-moe-lite", ("glm4_moe_lite",), ("Glm4MoeLiteConfig", "Glm4MoeLiteMoE"),
                    ("Glm4MoeLiteForCausalLM",), rule=MLP_LAYER_TYPES,
                    # transformers' Glm4MoeLiteConfig: layer 0 dense when mlp_layer_types is not given
                    first_dense=1, extra=(_k("mlp_layer_types", "list[str]", None, nullable=True),), plugin_proven=True),
    # vLLM 0.33.0 / 0.34.0 list Dots1ForCausalLM among the models they no longer support (registry.py's
    # _PREVIOUSLY_SUPPORTED_MODELS, last in 0.23.0): no vLLM the plugin serves has it
    _deepseek_style("dots1", ("dots1",), ("Dots1Config", "Dots1MoE", "Dots1TopkRouter"), ("Dots1ForCausalLM",),
                    nullable=("n_routed_experts", "first_k_dense_replace", "num_experts_per_tok", "n_group",
                              "topk_group", "norm_topk_prob", "n_shared_experts"), vllm_versions=()),
    FamilySpec(
        "ernie4.5-moe", ("ernie4_5_moe",), ("Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock"),
        ("Ernie4_5_MoeForCausalLM",),
        keys=(_H, _k("moe_num_experts", "int>=1", nullable=True), _k("moe_intermediate_size", "int>=1"),
              _k("moe_k", "int>=1", None, nullable=True), _k("num_hidden_layers", "int>=1", None),
              _k("moe_layer_start_index", "int>=0", 1, nullable=True), _k("moe_layer_end_index", "int", -1, nullable=True),
              _k("moe_layer_interval", "int>=1", 1, nullable=True)),
        experts_key="moe_num_experts", top_k_key="moe_k", moe_layers=LAYER_RANGE,
        # softmax then the moe_statics bias for the choice, renormalised with moe_norm_min: not reproduced
        # moe_statics.e_score_correction_bias: vLLM's Ernie4_5_MoeModel.load_weights renames it to the gate's
        routing=None, router=("gate", "moe_statics"), shared=("shared_experts",), plugin_proven=True),
    # vLLM serves it through its transformers backend (registry.py maps it to TransformersMoEForCausalLM)
    FamilySpec(
        "hunyuan-v1-moe", ("hunyuan_v1_moe",), ("HunYuanMoEV1Config", "HunYuanMoEV1Experts"),
        ("HunYuanMoEV1ForCausalLM",),
        # num_experts / moe_topk may be per-layer lists in transformers; a list is refused by the int type
        keys=(_H, _k("num_experts", "int>=1"), _k("intermediate_size", "int>=1"),
              _k("moe_topk", "int>=1", None), _k("num_hidden_layers", "int>=1", None)),
        intermediate_key="intermediate_size", top_k_key="moe_topk", routing=None, router=("gate",),
        shared=("shared_mlp",), plugin_proven=True),
    # MiMo-V2-Flash: transformers' MiMoV2Flash classes; vLLM's MiMoV2MoE (vllm/model_executor/models/mimo_v2.py)
    # routes the same way (sigmoid, gate.e_score_correction_bias for the choice, n_group / topk_group) and its
    # MiMoV2FlashDecoderLayer.is_moe_layer reads the published per-layer moe_layer_freq list, which must agree
    # with transformers' mlp_layer_types
    FamilySpec(
        "mimo-v2", ("mimo_v2_flash",), ("MiMoV2FlashConfig", "MiMoV2FlashMoE", "MiMoV2FlashTopkRouter"),
        ("MiMoV2FlashForCausalLM",),
        keys=(_H, _k("n_routed_experts", "int>=1", aliases=("num_local_experts",)), _k("moe_intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1", None), _k("num_hidden_layers", "int>=1", None),
              # transformers' MiMoV2FlashConfig: layer 0 dense when mlp_layer_types is not given
              _k("first_k_dense_replace", "int>=0", 1), _k("mlp_layer_types", "list[str]", None, nullable=True),
              _k("moe_layer_freq", "list[int>=0]", None, nullable=True), _k("norm_topk_prob", "bool", True),
              # the published config.json writes null (transformers reads it as 1.0)
              _k("routed_scaling_factor", "number>0", 1.0, nullable=True), _k("n_group", "int>=1", 1),
              _k("topk_group", "int>=1", 1)),
        experts_key="n_routed_experts", moe_layers=MLP_LAYER_TYPES, routing="grouped", plugin_proven=True),
    # No transformers class: the keys are those vLLM 0.33.0's BailingMoE reads from the checkpoint's own config
    # (vllm/model_executor/models/bailing_moe.py; Ling-lite writes model_type bailing_moe, Ling 2.0
    # bailing_moe_v2), the tensor names those its BailingMoeModel loads (mlp.experts.E.{gate,up,down}_proj,
    # mlp.gate.weight and mlp.gate.expert_bias, mlp.shared_experts), the MoE layer rule its BailingMoeBlock's
    # (layer_idx >= first_k_dense_replace; no layer frequency). Its router is softmax or sigmoid with the expert
    # bias as score_function says, grouped when n_group is set: the caller routes.
    FamilySpec(
        "bailing-moe", ("bailing_moe", "bailing_moe_v2"), (), ("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM"),
        keys=(_H, _k("num_experts", "int>=1"), _k("moe_intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1"), _k("num_hidden_layers", "int>=1"),
              _k("first_k_dense_replace", "int>=0")),
        moe_layers=FIRST_K_DENSE, routing=None, shared=("shared_experts",),
        plugin_unprovable="vLLM builds its config from the checkpoint's own remote code (--trust-remote-code: "
                          "transformers has no bailing_moe class), which no checkpoint made here can ship"),
    # Step-3.5: the keys of transformers' Step3p7TextConfig (model_type step3p5; its attribute_map reads
    # moe_num_experts / moe_top_k, the published config's names, as n_routed_experts / num_experts_per_tok); the
    # tensor names those vLLM's Step3p5Model.load_weights maps (vllm/model_executor/models/step3p5.py, the same in
    # 0.33.0 and 0.34.0): model.layers.L.moe.{gate,up,down}_proj.weight, 3-D over experts, moe.gate.weight,
    # moe.router_bias, and share_expert.* beside moe (its hf_to_vllm_mapper moves them under moe); the MoE
    # layer rule its _is_moe_layer's. Routed by sigmoid scores with router_bias for the choice, renormalised
    # where norm_expert_weight says (vLLM's FusedMoEBlock) or always (transformers' Step3p7TopKRouter): the
    # caller routes. A layer whose swiglu_limits entry is set runs vLLM's swiglustep (FusedMoEBlock picks
    # activation "swiglustep" there and asserts the entry is 7.0), the others SiLU.
    FamilySpec(
        "step3p5", ("step3p5",), ("Step3p7TextConfig", "Step3p7Experts", "Step3p7SparseMoeBlock"),
        ("Step3p5ForCausalLM",),
        keys=(_H, _k("n_routed_experts", "int>=1", aliases=("moe_num_experts", "num_local_experts")),
              _k("moe_intermediate_size", "int>=1"), _k("num_experts_per_tok", "int>=1", None, aliases=("moe_top_k",)),
              _k("num_hidden_layers", "int>=1", None), _k("mlp_layer_types", "list[str]", None, nullable=True),
              _k("moe_layers_enum", "str", None, nullable=True), _k("num_nextn_predict_layers", "int>=0", 0),
              _k("swiglu_limits", "list[number|null]", None, nullable=True)),
        # quantized checkpoints hold the experts per expert (vLLM's loader: "New per-expert format from LLM
        # Compressor", moe.experts.E.{gate,up,down}_proj.*)
        experts_key="n_routed_experts", moe_layers=LISTED, block="moe", storage=(FUSED_SEPARATE, PER_EXPERT),
        expert_bias=False,
        layer_activation=("swiglu_limits", "swiglustep", "limit"), routing=None, router=("gate", "router_bias"),
        shared=("share_expert",), shared_beside_block=True, mtp_key="num_nextn_predict_layers", plugin_proven=True),
    # DeepSeek-V4: the keys of transformers' DeepseekV4Config; the tensor names of the published checkpoints,
    # as vLLM 0.33.0's DeepseekV4 loader maps them (vllm/models/deepseek_v4/{cpu,nvidia}/model.py:
    # layers.L.ffn.experts.E.w1/w2/w3 with ckpt_gate_proj_name "w1", ffn.gate.{weight,bias,tid2eid},
    # ffn.shared_experts.w1/w2/w3; the MTP layers under mtp.N, not layers.N). Every decoder layer is MoE
    # (its DeepseekV4DecoderLayer always builds DeepseekV4MoE). The first mlp_layer_types.count("hash_moe")
    # layers choose experts by token id (the gate's tid2eid table), the others by sqrtsoftplus scores with
    # the gate's bias: neither is a router the runtime reproduces, so the caller routes. The experts run
    # SiLU-and-mul with gate and up clamped at swiglu_limit (vLLM's swiglu_limit on FusedMoE): the
    # activation parameter ``limit``. The experts' formats are readers/deepseek_v4.py's (expert_dtype).
    FamilySpec(
        "deepseek-v4", ("deepseek_v4",), ("DeepseekV4Config", "DeepseekV4ForCausalLM"), ("DeepseekV4ForCausalLM",),
        keys=(_H, _k("n_routed_experts", "int>=1"), _k("moe_intermediate_size", "int>=1"),
              _k("num_experts_per_tok", "int>=1"), _k("num_hidden_layers", "int>=1"),
              _k("mlp_layer_types", "list[str]", None, nullable=True), _k("swiglu_limit", "number", 10.0)),
        experts_key="n_routed_experts", block="ffn", roles={"w1": "gate", "w3": "up", "w2": "down"},
        activation_params=(("swiglu_limit", "limit"),), routing=None, router=("gate",), shared=("shared_experts",),
        # proven for its weights: its CPU attention and FP8 linear kernels are the CPU build's (AMX), which the
        # published wheel lacks and the test stands in
        plugin_proven=True),
    # LongCat-Flash: the keys of transformers' LongcatFlashConfig (num_layers decoder layers, each with one MoE
    # block beside its two dense MLPs and two attentions), the tensor names its save_pretrained writes and vLLM's
    # FlashModel.load_weights maps (mlp.experts.E.{gate,up,down}_proj.weight, mlp.router.classifier.weight,
    # mlp.router.e_score_correction_bias). The router scores E + zero_expert_num experts; the zero experts have
    # no tensors: vLLM's FusedMoE holds the E routed experts only, and its ZeroExpertRouter adds weight * x for
    # each zero expert picked (zero_expert_type "identity", the only type zero_experts_compute_triton has;
    # transformers' LongcatFlashMoE does the same). Softmax over all, the bias for the choice, no
    # renormalisation, times routed_scaling_factor: the caller routes.
    FamilySpec(
        "longcat-flash", ("longcat_flash",), ("LongcatFlashConfig", "LongcatFlashExperts", "LongcatFlashMoE"),
        ("LongcatFlashForCausalLM",),
        keys=(_H, _k("n_routed_experts", "int>=1", aliases=("num_local_experts",)),
              _k("expert_ffn_hidden_size", "int>=1", aliases=("moe_intermediate_size",)),
              _k("moe_topk", "int>=1", None, aliases=("num_experts_per_tok",)), _k("num_layers", "int>=1", None),
              _k("zero_expert_num", "int>=0", 256), _k("zero_expert_type", "str", None, nullable=True)),
        experts_key="n_routed_experts", intermediate_key="expert_ffn_hidden_size", top_k_key="moe_topk",
        layers_key="num_layers", routing=None, router=("router",), zero_experts_key="zero_expert_num",
        plugin_proven=True),
    # No transformers class: the keys are those of vLLM 0.33.0's KimiK3Config (its text_config is a
    # KimiLinearConfig, vllm/transformers_utils/configs/kimi_k3.py, kimi_linear.py), the tensor names those
    # its loader maps (vllm/models/kimi_k3: block_sparse_moe.experts.N.w1/w2/w3, ckpt_gate_proj_name "w1"),
    # the MoE layer rule its KimiDecoderLayer's is_moe_layer, the activation its SituAndMul.
    FamilySpec(
        "kimi-k3", ("kimi_linear",), (), ("KimiK3ForConditionalGeneration",),
        keys=(_H, _k("routed_expert_hidden_size", "int>=1", None, nullable=True), _k("num_experts", "int>=1"),
              _k("moe_intermediate_size", "int>=1"), _k("num_experts_per_token", "int>=1", None, nullable=True),
              _k("num_hidden_layers", "int>=1", None), _k("first_k_dense_replace", "int>=0", 0),
              _k("moe_layer_freq", "int>=1", 1), _k("hidden_act", "str", "silu"),
              _k("activation_situ_beta", "number>0", 1.0, nullable=True),
              _k("activation_situ_linear_beta", "number>0", None, nullable=True)),
        hidden_key="routed_expert_hidden_size", top_k_key="num_experts_per_token", moe_layers=FIRST_K_DENSE,
        block="block_sparse_moe", roles={"w1": "gate", "w3": "up", "w2": "down"}, activation="situ",
        activation_params=(("activation_situ_beta", "beta"), ("activation_situ_linear_beta", "linear_beta")),
        activation_key="hidden_act", routing=None, shared=("shared_experts",), wrappers=("kimi_k3",),
        plugin_unprovable="vLLM's KimiK3ForConditionalGeneration holds a MoonViT vision tower and KimiLinear "
                          "decoder layers (KDA linear attention, NoPE MLA, a latent projection around each MoE: "
                          "vllm/models/kimi_k3/nvidia/model.py) that the tiny checkpoint here does not carry; the "
                          "plugin has not been run on that class on vLLM's CPU platform"),
)

#: family name -> the config ``model_type`` values that name it
MODEL_TYPES: dict[str, tuple[str, ...]] = {f.name: f.model_types for f in FAMILIES}
BY_NAME: dict[str, FamilySpec] = {f.name: f for f in FAMILIES}
#: wrapper model_type -> the families its text_config may hold
WRAPPERS: dict[str, tuple[str, ...]] = {}
for _f in FAMILIES:
    for _w in _f.wrappers:
        WRAPPERS[_w] = WRAPPERS.get(_w, ()) + (_f.name,)


def _check_table() -> None:
    """The table is consistent with itself (import time: a wrong entry never reaches a user)."""
    seen: dict[str, str] = {}
    for f in FAMILIES:
        for mt in f.model_types:
            assert mt not in seen, f"model_type {mt} named by {seen[mt]} and {f.name}"
            seen[mt] = f.name
        if f.refused:
            continue
        names = {k.name for k in f.keys}
        for key in (f.experts_key, f.intermediate_key, f.top_k_key, f.layers_key, f.hidden_key,
                    *(k for k, _ in f.activation_params), *((f.mtp_key,) if f.mtp_key else ()),
                    *((f.activation_key,) if f.activation_key else ()),
                    *((f.layer_activation[0],) if f.layer_activation else ()),
                    *((f.zero_experts_key,) if f.zero_experts_key else ())):
            assert key in names, f"{f.name}: {key} is read but not declared"
        assert all(k.kind in KINDS for k in f.keys), f.name
        assert set(f.storage) <= set(STORAGES) and f.moe_layers in LAYER_RULES and f.routing in ROUTINGS, f.name


_check_table()


# -- reading a declared key ----------------------------------------------------------------------------

_WORDS = {"int>=1": "a positive integer", "int>=0": "an integer >= 0", "int": "an integer",
          "number": "a finite number", "number>0": "a finite number > 0", "bool": "true or false",
          "str": "a string", "list[int>=0]": "a list of layer indices (integers >= 0)", "list[str]": "a list of strings",
          "list[number|null]": "a list of finite numbers or nulls"}


def _fits(kind: str, v) -> bool:
    if kind.startswith("int"):
        return type(v) is int and v >= {"int>=1": 1, "int>=0": 0, "int": -(1 << 62)}[kind]
    if kind.startswith("number"):
        return type(v) in (int, float) and math.isfinite(v) and (kind == "number" or v > 0)
    if kind == "bool":
        return type(v) is bool
    if kind == "str":
        return type(v) is str
    if kind == "list[int>=0]":
        return type(v) is list and all(type(x) is int and x >= 0 for x in v)
    if kind == "list[str]":
        return type(v) is list and all(type(x) is str for x in v)
    if kind == "list[number|null]":
        return type(v) is list and all(x is None or (type(x) in (int, float) and math.isfinite(x)) for x in v)
    raise AssertionError(kind)


def read_key(cfg: dict, key: Key, section: str = ""):
    """``cfg[key.name]`` checked against its declaration: absent gives the default (refused when
    required); null is refused unless the key is nullable (then it gives the default too), so a null is
    never silently read as a number it does not say; a value of another type is refused."""
    name = key.present(cfg)
    where = section + name
    expected = _WORDS[key.kind] + (" or null" if key.nullable else "")
    if name not in cfg:
        if key.default is REQUIRED:
            raise MoeConvertError("missing", file=CONFIG_NAME, tensor=where, expected=expected)
        return key.default
    value = cfg[name]
    if value is None:
        if key.nullable and key.default is not REQUIRED:
            return key.default
        raise MoeConvertError("must not be null" + (" (transformers refuses it)" if key.default is not REQUIRED else ""),
                              file=CONFIG_NAME, tensor=where, expected=_WORDS[key.kind])
    if not _fits(key.kind, value):
        raise MoeConvertError("invalid value", file=CONFIG_NAME, tensor=where, expected=expected,
                              found=show_value(value))
    return value


def read_keys(cfg: dict, spec: FamilySpec, section: str = "") -> dict:
    """Every key ``spec`` declares, read with :func:`read_key` (so an error names the first bad key)."""
    return {k.name: read_key(cfg, k, section) for k in spec.keys}


def table_markdown() -> str:
    """The table as docs/families.md shows it (a test keeps the page equal to this)."""
    rows = ["| family | `model_type` | E / top-k / I keys | MoE layers | experts stored | activation, routing "
            "| shared experts | transformers | vLLM | vLLM plugin |", "|---|---|---|---|---|---|---|---|---|---|"]
    for f in FAMILIES:
        types = ", ".join(f"`{t}`" for t in f.model_types) + "".join(f" (in `{w}`'s text_config)" for w in f.wrappers)
        if f.refused:
            rows.append(f"| {f.name} | {types} | refused: {f.refused} ||||||{_vllm_cell(f)} | refused |")
            continue
        keys = " / ".join(f"`{k}`" for k in (f.experts_key, f.top_k_key, f.intermediate_key))
        names = "/".join(f.roles) if PER_EXPERT in f.storage else ""
        stored = "; ".join(f"{st}" + (f" (`{f.block}.experts.E.{{{names}}}`)" if st == PER_EXPERT
                                      else f" (`{f.block}.{{{'/'.join(f.roles)}}}.weight`, float only)"
                                      if st == FUSED_SEPARATE else f" (`{f.block}.experts.gate_up_proj`"
                                      + (", float only" if st in (FUSED, FUSED_TRANSPOSED) else "") + ")")
                           for st in f.storage)
        params = f" ({', '.join(n for _, n in f.activation_params)})" if f.activation_params else ""
        per_layer = (f"; {f.layer_activation[1]} ({f.layer_activation[2]}) where `{f.layer_activation[0]}` sets "
                     "the layer's entry" if f.layer_activation else "")
        routing = (f"{f.activation}{params}{per_layer}, {f.routing or 'caller routes'}"
                   + (", router weight on the input" if f.router_on_input else "")
                   + (f", zero experts (`{f.zero_experts_key}`, no tensors)" if f.zero_experts_key else ""))
        shared = ", ".join(f"`{s}`" for s in f.shared) + (" (beside the block)" if f.shared_beside_block else "") or "none"
        name = f.name + (f" (planned only: {f.plan_only})" if f.plan_only else "")
        hf = ", ".join(f.hf_classes) or "none (the keys vLLM's model reads)"
        rows.append(f"| {name} | {types} | {keys} | {f.moe_layers} | {stored} | {routing} | {shared} | "
                    f"{hf} | {_vllm_cell(f)} | {_plugin_cell(f)} |")
    return "\n".join(rows) + "\n"


def _plugin_cell(f: FamilySpec) -> str:
    if f.plugin_proven and f.vllm_versions:
        return "served"
    return "refused" + (f": {f.plugin_unprovable}" if f.plugin_unprovable else "")


def _vllm_cell(f: FamilySpec) -> str:
    """The vLLM classes serving a family, and the vLLM versions whose registry has them."""
    return f"{', '.join(f.vllm_classes)} ({', '.join(f.vllm_versions) or 'in no vLLM ' + ' / '.join(VLLM_REGISTRIES)})"
