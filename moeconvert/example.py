"""Small but real MoE checkpoints, made by the real producers.

``moeconvert example OUT_DIR --family ... --scheme ...`` and the test suite both use
:func:`make_example`. The point is that nothing here imitates a checkpoint format by hand:

* the model is a genuine ``transformers`` model of that family (``AutoConfig.for_model`` +
  ``AutoModelForCausalLM.from_config``) and the float checkpoint is whatever its
  ``save_pretrained`` writes (tensor names, dtypes, config.json keys, sharding, index);
* the int checkpoints (``w4a16``/``w8a16``) are compressed-tensors ``pack-quantized`` checkpoints
  written by compressed-tensors itself (``apply_quantization_config`` -> qparams from per-group
  min/max with ``calculate_qparams``, as llm-compressor's min/max observer does ->
  ``ModelCompressor.compress_model`` -> ``ModelCompressor.update_config``);
* ``mxfp4`` / ``nvfp4`` are compressed-tensors ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized``
  checkpoints made the same way from its ``MXFP4`` / ``NVFP4`` presets (NVFP4's per-tensor global scale
  from ``generate_gparam`` of the weight's min/max, as llm-compressor's observer computes it; the input
  global scale, which needs calibration data, from an activation range of [-1, 1]);
* ``fp8-block`` is the DeepSeek-V3 FP8 format (``quant_method: fp8``, e4m3 weights, one fp32
  ``weight_scale_inv`` per 128x128 block), quantized by transformers' own ``FineGrainedFP8`` quantizer
  op (``Fp8Quantize``, the one ``save_pretrained`` runs; transformers refuses to quantize a whole model
  without a GPU, so the op is applied to the saved float tensors): every Linear weight whose sizes are
  multiples of 128, routers, ``lm_head`` and embeddings left as they are.

Why int checkpoints are quantized from the *saved* float tensors, not from the model in memory:
transformers >= 5 keeps the routed experts fused in memory (one 3-D parameter per projection,
e.g. ``mlp.experts.gate_up_proj [E, 2I, H]``) and splits them into per-expert tensors
(``mlp.experts.{e}.gate_proj.weight``) only inside ``save_pretrained``. compressed-tensors
quantizes ``nn.Linear`` modules, so applied to the in-memory model it would find no expert to
quantize. We therefore save the float model first, rebuild a module tree holding one
``nn.Linear`` per saved 2-D weight (module name = tensor name minus ``.weight``) and quantize that
- which is what an llm-compressor run over a transformers-4 model (per-expert Linears) produces.

gpt-oss keeps its experts fused even on disk (``mlp.experts.gate_up_proj [E, H, 2I]``, gate/up
interleaved along the last dim, plus biases); compressed-tensors cannot quantize those as Linear,
so gpt-oss is offered in bf16/fp16 only.

Everything is deterministic: the same arguments give byte-identical files (all parameters are
re-drawn from one seeded generator; no timestamps are written anywhere).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moeconvert.errors import MoeConvertError

FAMILIES = ("qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v2", "deepseek-v3", "glm4-moe", "gpt-oss")
SCHEMES = ("bf16", "fp16", "w4a16", "w8a16", "mxfp4", "nvfp4", "fp8-block")
#: the compressed-tensors preset and format of each float-4 scheme
_FP4 = {"mxfp4": ("MXFP4", "mxfp4-pack-quantized"), "nvfp4": ("NVFP4", "nvfp4-pack-quantized")}
FP8_BLOCK = 128

# transformers >= 5's own default shard size; with it our tiny checkpoints are one file.
_DEFAULT_SHARD_SIZE = "50GB"
_VOCAB_SIZE = 256
_NUM_HEADS = 4
_NUM_KV_HEADS = 2
_TOP_K = 2
_INIT_STD = 0.02

# Linears that stay unquantized, as in RedHatAI / llm-compressor W4A16 checkpoints: lm_head and
# the routers (Qwen/Mixtral/DeepSeek/GLM ``mlp.gate``, gpt-oss ``mlp.router``, Qwen2-MoE's
# ``shared_expert_gate``). Mixtral's router is saved as ``block_sparse_moe.gate``. Attention,
# dense-MLP and shared-expert Linears *are* quantized, like the real checkpoints.
_IGNORE = [
    "lm_head",
    "re:.*mlp.gate$",
    "re:.*block_sparse_moe.gate$",
    "re:.*router$",
    "re:.*shared_expert_gate$",
]


# --------------------------------------------------------------------------------------------
# Families: the tiny HF config of each
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    model_type: str  # transformers' model_type
    default_layers: int
    first_k_dense: int  # leading dense (non-MoE) decoder layers
    int_schemes: bool  # can compressed-tensors quantize its experts as Linear?
    config: Callable[[int, int, int, int], dict]  # (hidden, moe_inter, experts, layers) -> kwargs


def _attention(hidden: int) -> dict:
    """GQA attention of 4 query / 2 kv heads, head_dim * heads == hidden (o_proj's K == hidden)."""
    return dict(
        num_attention_heads=_NUM_HEADS,
        num_key_value_heads=_NUM_KV_HEADS,
        head_dim=hidden // _NUM_HEADS,
    )


def _mla(hidden: int, q_lora_rank: int | None) -> dict:
    """DeepSeek multi-head latent attention. The LoRA ranks are ``hidden`` so that every Linear's
    input size (hidden, q_lora_rank, kv_lora_rank, heads * v_head_dim) is a multiple of any group
    size that divides ``hidden``."""
    head_dim = hidden // _NUM_HEADS
    return dict(
        num_attention_heads=_NUM_HEADS,
        num_key_value_heads=_NUM_HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=hidden,
        qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
    )


def _qwen3_moe(h: int, i: int, e: int, n: int) -> dict:
    return dict(
        **_attention(h),
        moe_intermediate_size=i,
        intermediate_size=2 * h,  # dense MLP size, unused: every layer is MoE
        num_experts=e,
        num_experts_per_tok=_TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


def _qwen2_moe(h: int, i: int, e: int, n: int) -> dict:
    return dict(
        **_attention(h),
        moe_intermediate_size=i,
        intermediate_size=2 * h,
        shared_expert_intermediate_size=2 * i,  # one sigmoid-gated shared expert per layer
        num_experts=e,
        num_experts_per_tok=_TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=True,
    )


def _mixtral(h: int, i: int, e: int, n: int) -> dict:
    return dict(**_attention(h), intermediate_size=i, num_local_experts=e, num_experts_per_tok=_TOP_K)


def _deepseek_v2(h: int, i: int, e: int, n: int) -> dict:
    # Like DeepSeek-V2-Lite: no q LoRA, greedy top-k (one group), softmax scoring.
    return dict(
        **_mla(h, q_lora_rank=None),
        moe_intermediate_size=i,
        intermediate_size=2 * h,  # layer 0 (dense MLP)
        n_routed_experts=e,
        n_shared_experts=1,
        num_experts_per_tok=_TOP_K,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    )


def _grouped_topk(e: int) -> dict:
    """DeepSeek-V3 / GLM-4.5 group-limited routing: two groups when each still holds >= top-k
    experts, else one; one group kept per token."""
    n_group = 2 if e % 2 == 0 and e // 2 >= _TOP_K else 1
    return dict(n_group=n_group, topk_group=1)


def _deepseek_v3(h: int, i: int, e: int, n: int) -> dict:
    # sigmoid scoring with e_score_correction_bias (noaux_tc); no MTP layer (none is saved).
    return dict(
        **_mla(h, q_lora_rank=h),
        moe_intermediate_size=i,
        intermediate_size=2 * h,
        n_routed_experts=e,
        n_shared_experts=1,
        num_experts_per_tok=_TOP_K,
        first_k_dense_replace=1,
        **_grouped_topk(e),
        num_nextn_predict_layers=0,
    )


def _glm4_moe(h: int, i: int, e: int, n: int) -> dict:
    return dict(
        **_attention(h),
        moe_intermediate_size=i,
        intermediate_size=2 * h,
        n_routed_experts=e,
        n_shared_experts=1,
        num_experts_per_tok=_TOP_K,
        first_k_dense_replace=1,
        **_grouped_topk(e),
        attention_bias=True,  # GLM-4.5 has q/k/v biases
        num_nextn_predict_layers=0,
    )


def _gpt_oss(h: int, i: int, e: int, n: int) -> dict:
    return dict(
        **_attention(h),
        intermediate_size=i,
        num_local_experts=e,
        num_experts_per_tok=_TOP_K,
        # gpt-oss' YaRN (factor 32 over 4096) implies this context; a smaller one only warns.
        max_position_embeddings=131072,
    )


_FAMILIES: dict[str, _Family] = {
    "qwen3-moe": _Family("qwen3_moe", 2, 0, True, _qwen3_moe),
    "qwen2-moe": _Family("qwen2_moe", 2, 0, True, _qwen2_moe),
    "mixtral": _Family("mixtral", 2, 0, True, _mixtral),
    "deepseek-v2": _Family("deepseek_v2", 3, 1, True, _deepseek_v2),
    "deepseek-v3": _Family("deepseek_v3", 3, 1, True, _deepseek_v3),
    "glm4-moe": _Family("glm4_moe", 3, 1, True, _glm4_moe),
    "gpt-oss": _Family("gpt_oss", 2, 0, False, _gpt_oss),
}
assert tuple(_FAMILIES) == FAMILIES


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def make_example(
    out_dir: str | Path,
    family: str = "qwen3-moe",
    scheme: str = "w4a16",
    *,
    group_size: int = 128,
    symmetric: bool = True,
    num_layers: int | None = None,
    num_experts: int = 8,
    hidden_size: int = 256,
    intermediate_size: int = 128,
    seed: int = 0,
    max_shard_size: str | None = None,
    experts_without_zero_code: tuple[int, ...] = (),
) -> Path:
    """Write a tiny random MoE checkpoint of ``family`` in ``scheme`` to ``out_dir``; return it.

    ``intermediate_size`` is the routed experts' size (``moe_intermediate_size`` for the
    Qwen/DeepSeek/GLM families). Dense MLPs (DeepSeek/GLM layer 0) use ``2 * hidden_size``.
    ``group_size`` (-1 = channelwise) and ``symmetric`` apply to w4a16/w8a16 only.
    ``experts_without_zero_code`` (symmetric w4a16/w8a16): in every layer these routed experts' float
    weights get, per quantization group, the sign that makes the group's largest magnitude positive (and
    negative values are clipped to 0.9 of it), so that no code of theirs is 0: what a quantizer to the
    restricted range [-(2^(b-1) - 1), 2^(b-1) - 1] writes, and what decides humming's sign-magnitude choice.
    ``out_dir`` must be missing or empty.
    """
    spec, bits = _check_args(family, scheme, group_size, num_layers, num_experts, hidden_size,
                             intermediate_size, max_shard_size)
    if experts_without_zero_code and (bits is None or not symmetric):
        raise MoeConvertError("experts_without_zero_code shapes the codes of a symmetric w4a16/w8a16 checkpoint",
                              expected="a symmetric int scheme", found=f"{scheme}{'' if symmetric else ' asym'}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # Refuse rather than mix with a previous run's shards or index.
        raise MoeConvertError("output directory exists and is not empty", file=str(out))
    layers = num_layers if num_layers is not None else spec.default_layers
    shard = max_shard_size or _DEFAULT_SHARD_SIZE

    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise MoeConvertError(
            "moeconvert example needs transformers: pip install 'moeconvert[example]'"
        ) from e

    dtype = torch.float16 if scheme == "fp16" else torch.bfloat16
    model = _build_model(spec, hidden_size, intermediate_size, num_experts, layers, dtype, seed)

    out.mkdir(parents=True, exist_ok=True)
    if scheme in (*_FP4, "fp8-block"):
        embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
        with tempfile.TemporaryDirectory(prefix="moeconvert-example-") as tmp:
            _save_float(model, Path(tmp), _DEFAULT_SHARD_SIZE)
            if scheme == "fp8-block":
                _write_fp8_block(Path(tmp), out, embeddings, shard)
            else:
                _write_pack_quantized(Path(tmp), out, 4, -1, True, embeddings, shard, fp4=scheme)
    elif bits is None:
        _save_float(model, out, shard)
    else:
        embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
        with tempfile.TemporaryDirectory(prefix="moeconvert-example-") as tmp:
            _save_float(model, Path(tmp), _DEFAULT_SHARD_SIZE)
            _write_pack_quantized(Path(tmp), out, bits, group_size, symmetric, embeddings, shard,
                                  set(experts_without_zero_code))
    return out


def _check_args(family, scheme, group_size, num_layers, num_experts, hidden_size, intermediate_size,
                max_shard_size):
    """Refuse bad arguments before anything is built or written; return (family spec, bits)."""
    if family not in _FAMILIES:
        raise MoeConvertError(f"unknown family {family!r}", expected=", ".join(FAMILIES), found=family)
    if scheme not in SCHEMES:
        raise MoeConvertError(f"unknown scheme {scheme!r}", expected=", ".join(SCHEMES), found=scheme)
    spec = _FAMILIES[family]
    bits = {"w4a16": 4, "w8a16": 8}.get(scheme)
    if (bits is not None or scheme in (*_FP4, "fp8-block")) and not spec.int_schemes:
        raise MoeConvertError(
            f"{family} stores its experts fused (3-D gate_up_proj/down_proj with biases), which "
            f"compressed-tensors cannot quantize as Linear layers; {family} examples exist in "
            "bf16/fp16 only",
            expected="bf16 or fp16", found=scheme,
        )
    if num_experts < _TOP_K:
        raise MoeConvertError("num_experts must be at least the top-k", expected=f">= {_TOP_K}",
                              found=num_experts)
    min_layers = spec.first_k_dense + 1
    if num_layers is not None and num_layers < min_layers:
        raise MoeConvertError(f"{family} needs at least {min_layers} layer(s) to hold an MoE layer",
                              expected=f">= {min_layers}", found=num_layers)
    # Attention splits hidden into 4 heads; DeepSeek's MLA halves head_dim again into rope/nope
    # parts, and rope needs an even size: so hidden must be a multiple of 16.
    if hidden_size < 16 or hidden_size % 16:
        raise MoeConvertError("hidden_size must be a positive multiple of 16", found=hidden_size)
    if intermediate_size < 1:
        raise MoeConvertError("intermediate_size must be positive", found=intermediate_size)
    if bits is not None:
        if group_size != -1 and group_size < 1:
            raise MoeConvertError("group_size must be positive or -1 (channelwise)", found=group_size)
        # Every quantized Linear's input size is hidden, intermediate or a multiple of them.
        if group_size != -1 and (hidden_size % group_size or intermediate_size % group_size):
            raise MoeConvertError(
                "group_size must divide hidden_size and intermediate_size",
                expected=f"a divisor of {hidden_size} and {intermediate_size}", found=group_size,
            )
    if max_shard_size is not None and not re.fullmatch(r"\d+\s*([KMG]i?B)?", max_shard_size.strip(), re.I):
        raise MoeConvertError("max_shard_size must look like 200KB, 5MB or 1GB", found=max_shard_size)
    return spec, bits


# --------------------------------------------------------------------------------------------
# The float model
# --------------------------------------------------------------------------------------------


def _build_model(spec: _Family, hidden, inter, experts, layers, dtype, seed):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    cfg = AutoConfig.for_model(
        spec.model_type,
        vocab_size=_VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=layers,
        tie_word_embeddings=False,  # a separate lm_head, as in all of these families' big models
        **spec.config(hidden, inter, experts, layers),
    )
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # from_config's chatter is not ours to show
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    _reinit(model, seed)
    return model.eval()


def _reinit(model, seed: int) -> None:
    """Draw every parameter and persistent buffer again from one seeded generator.

    transformers' own init is fine for the weights (normal(0, 0.02)), but it leaves biases at
    zero, norms at one and DeepSeek/GLM's ``e_score_correction_bias`` at zero. Tests that must
    notice a dropped, swapped or mis-placed tensor need each tensor to be distinct, so: weights
    and biases ~ N(0, 0.02), norm weights ~ 1 + N(0, 0.02). Going by name order (not module
    order) with a private generator makes the result independent of how transformers builds or
    initialises the modules.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    saved = set(model.state_dict())  # persistent buffers only (not e.g. rotary inv_freq)
    tensors.update({n: b for n, b in model.named_buffers() if n in saved and b.is_floating_point()})
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * _INIT_STD
            if "norm" in name.rsplit(".", 2)[-2]:  # input_layernorm.weight, q_norm.weight, ...
                noise += 1.0
            t.copy_(noise.to(t.dtype))


def _save_float(model, out: Path, max_shard_size: str) -> None:
    # save_pretrained writes config.json, generation_config.json, the safetensors (split into
    # per-expert tensors, and into shards + model.safetensors.index.json when over the size).
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" is noise for a tiny model
    try:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------
# The compressed-tensors pack-quantized checkpoint
# --------------------------------------------------------------------------------------------


def quantization_config(bits: int, group_size: int, symmetric: bool):
    """The compressed-tensors ``QuantizationConfig`` of a WNA16 scheme (llm-compressor's
    ``W4A16``/``W4A16_ASYM``/``W8A16`` presets, with the group size and symmetry chosen)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )

    weights = QuantizationArgs(
        num_bits=bits,
        type=QuantizationType.INT,
        symmetric=symmetric,
        strategy=QuantizationStrategy.CHANNEL if group_size == -1 else QuantizationStrategy.GROUP,
        group_size=None if group_size == -1 else group_size,
    )
    return QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=list(_IGNORE),
    )


def fp4_quantization_config(scheme: str):
    """compressed-tensors' ``MXFP4`` / ``NVFP4`` preset on every Linear, the routers and lm_head ignored."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    return QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(_FP4[scheme][0], ["Linear"])},
                              ignore=list(_IGNORE))


def fp4_global_scales(tree) -> None:
    """NVFP4: every module's per-tensor global scales, set as llm-compressor sets them: the weight's from its
    min/max (``generate_gparam``), then one for each gate/up pair, the smaller of the two (its
    ``update_fused_layer_weight_global_scales``, which vLLM relies on: it keeps the gate's for both); the
    input's from an activation range of [-1, 1], for want of calibration data. No-op for other schemes."""
    import torch
    from compressed_tensors.quantization.utils import generate_gparam

    modules = dict(tree.named_modules())
    for module in modules.values():
        if hasattr(module, "weight_global_scale"):
            w = module.weight
            module.weight_global_scale.copy_(generate_gparam(w.min(), w.max()))
            if hasattr(module, "input_global_scale"):
                module.input_global_scale.copy_(generate_gparam(torch.tensor(-1.0), torch.tensor(1.0)))
    for name, module in modules.items():
        up = modules.get(name.removesuffix("gate_proj") + "up_proj") if name.endswith("gate_proj") else None
        if up is not None and hasattr(module, "weight_global_scale"):
            fused = torch.minimum(module.weight_global_scale, up.weight_global_scale)
            module.weight_global_scale.copy_(fused)
            up.weight_global_scale.copy_(fused)


def weight_qparams(weight, args, global_scale=None):
    """Scale and zero point of one weight [N, K] from its per-group (or per-row) min/max, the
    way llm-compressor's min/max observer calibrates weights: groups are contiguous runs of
    ``group_size`` along K, reduced in the weight's own dtype, then ``calculate_qparams``.
    Shapes [N, K // group_size] (group) or [N, 1] (channel), like compressed-tensors' params."""
    import torch
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        grouped = weight.unflatten(-1, (weight.shape[-1] // args.group_size, args.group_size))
        lo, hi = torch.aminmax(grouped, dim=-1)
    elif args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = torch.aminmax(weight, dim=-1, keepdim=True)
    else:  # pragma: no cover - quantization_config makes only these two
        raise ValueError(f"unsupported strategy {args.strategy}")
    return calculate_qparams(lo, hi, args, global_scale=global_scale)


def _read_safetensors_dir(path: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _module_tree(linears: dict):
    """An nn.Module whose submodule ``a.b.c`` is an ``nn.Linear`` holding tensors ``a.b.c.weight``
    (and ``.bias``), for every entry of ``linears`` {module name: (weight, bias or None)}."""
    import torch

    root = torch.nn.Module()
    for name, (weight, bias) in linears.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        # Built on meta, then given the saved tensors: no init work, no copies.
        lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        lin.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias, requires_grad=False)
        parent.add_module(leaf, lin)
    return root


def _without_zero_code(weight, group_size: int):
    """``weight [N, K]`` with each group's sign flipped so that its largest magnitude is positive, and any
    negative value clipped to 0.9 of that magnitude: symmetric min/max calibration then maps nothing to the
    bottom of the range (code 0)."""
    import torch

    g = weight.shape[-1] if group_size == -1 else group_size
    grouped = weight.unflatten(-1, (weight.shape[-1] // g, g))
    top = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True))
    grouped = grouped * torch.where(top < 0, -1.0, 1.0).to(grouped.dtype)
    peak = grouped.abs().amax(-1, keepdim=True)
    # below -0.9 peak, a value could still round to the bottom code once the scale is rounded to bf16
    grouped = torch.maximum(grouped, -0.9 * peak)
    return grouped.flatten(-2).contiguous()


def _write_pack_quantized(float_dir: Path, out: Path, bits: int, group_size: int, symmetric: bool,
                          embeddings: set, max_shard_size: str, without_zero: set[int] = frozenset(),
                          fp4: str | None = None) -> None:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import is_module_quantized
    from huggingface_hub import save_torch_state_dict

    saved = _read_safetensors_dir(float_dir)

    # Every saved 2-D ".weight" except the embedding is a Linear's weight (routers and lm_head
    # included: the config's ignore list, not this, keeps those unquantized).
    linears = {}
    for name, t in saved.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.ndim == 2 and module not in embeddings:
            expert = re.search(r"\.experts\.(\d+)\.", name)
            if expert and int(expert.group(1)) in without_zero:
                t = saved[name] = _without_zero_code(t, group_size)
            linears[module] = (t, saved.get(module + ".bias"))
    tree = _module_tree(linears)

    # 1. Attach schemes and (empty) weight_scale / weight_zero_point params to matching Linears.
    quiet = {"show_progress": False} if "show_progress" in inspect.signature(apply_quantization_config).parameters else {}
    config = quantization_config(bits, group_size, symmetric) if fp4 is None else fp4_quantization_config(fp4)
    with contextlib.redirect_stderr(io.StringIO()):  # newer releases draw a tqdm bar here
        apply_quantization_config(tree, config, **quiet)  # (0.17 has no bar)
    # 2. Calibrate: the weight-only equivalent of running llm-compressor's observers.
    with torch.no_grad():
        fp4_global_scales(tree)
        for module in tree.modules():
            if is_module_quantized(module):
                args = module.quantization_scheme.weights
                scale, zero_point = weight_qparams(module.weight, args, getattr(module, "weight_global_scale", None))
                module.weight_scale.copy_(scale)
                module.weight_zero_point.copy_(zero_point)
    # 3. Compress (quantize + pack, drop symmetric zero points) and describe it.
    fmt = "pack-quantized" if fp4 is None else _FP4[fp4][1]
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format=fmt)
    with contextlib.redirect_stderr(io.StringIO()):  # compress_model always draws a tqdm bar
        compressor.compress_model(tree)

    # Linears' tensors come from the compressed tree; the rest (embeddings, norms,
    # e_score_correction_bias, ...) unchanged from the float save.
    # (Only the Linears' own weight/bias: DeepSeek's mlp.gate.e_score_correction_bias shares the
    # router's prefix but is no Linear tensor.)
    held = {f"{m}.{p}" for m in linears for p in ("weight", "bias")}
    tensors = {n: t for n, t in saved.items() if n not in held}
    tensors.update({n: t.contiguous() for n, t in tree.state_dict().items()})
    save_torch_state_dict(tensors, out, max_shard_size=max_shard_size)

    for f in ("config.json", "generation_config.json"):
        if (float_dir / f).exists():
            shutil.copyfile(float_dir / f, out / f)
    # Writes config.json's quantization_config (format pack-quantized, status compressed, the
    # scheme, the explicit ignore list of unquantized Linears) exactly as llm-compressor does.
    compressor.update_config(str(out))


def _write_fp8_block(float_dir: Path, out: Path, embeddings: set, max_shard_size: str) -> None:
    """DeepSeek-V3's FP8 checkpoint format, quantized by transformers' ``Fp8Quantize`` (see the module doc)."""
    import json

    from huggingface_hub import save_torch_state_dict
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK))
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": config})())
    skip = re.compile("|".join(p.removeprefix("re:") for p in _IGNORE))
    saved = _read_safetensors_dir(float_dir)
    tensors = {}
    for name, t in saved.items():
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and t.ndim == 2 and module not in embeddings and not skip.search(module)
                and t.shape[0] % FP8_BLOCK == 0 and t.shape[1] % FP8_BLOCK == 0):
            tensors.update(quantize.convert({name: t}))
        else:
            tensors[name] = t
    save_torch_state_dict({n: t.contiguous() for n, t in tensors.items()}, out, max_shard_size=max_shard_size)
    for f in ("config.json", "generation_config.json"):
        if (float_dir / f).exists():
            shutil.copyfile(float_dir / f, out / f)
    # what DeepSeek-V3's own config.json says of its weights
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
