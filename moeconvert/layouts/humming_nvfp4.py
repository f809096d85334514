"""``humming`` for NVFP4 experts: what vLLM holds on Hopper for a compressed-tensors ``nvfp4-pack-quantized``
MoE layer served by humming (docs/layouts/humming.md, "NVFP4").

On SM90 vLLM's NVFP4 MoE oracle (``select_nvfp4_moe_backend``) puts HUMMING ahead of MARLIN
(``prioritize_humming``), and FlashInfer / CUTLASS NVFP4 need SM100: ``CompressedTensorsW4A4Nvfp4MoEMethod``
then runs ``convert_to_nvfp4_moe_kernel_format``'s HUMMING branch, ``convert_to_humming_moe_kernel_format``
with the compressed-tensors NVFP4 config: humming-kernels 0.1.19's ``CompressedTensorsWeightSchema.convert_humming``
(the packed e2m1 bytes viewed as int32 words, the e4m3 scales as they are, ``1 / weight_global_scale`` as
the secondary scale) and ``prepare_and_transform_humming_tensors`` on each sublayer (w13, w2), with 16-bit
activations (the checkpoint's W4A4 activation scheme is not applied: humming's input schema comes from
``VLLM_HUMMING_INPUT_QUANT_CONFIG``, unset by default).

======================  ===============================  ==============================================
tensor                  shape                            dtype
======================  ===============================  ==============================================
w13_weight              ``[E, K13p/16, 2 N13p]``         int32, 64x64 tiles (``weight_repack_nk``, 4 bits)
w2_weight               ``[E, K2p/16, 2 N2p]``           int32
w13_weight_scale        ``[E, K13p/16, N13p]``           float8_e4m3fn, K-first, 8x8-transposed columns
w2_weight_scale         ``[E, K2p/16, N2p]``             float8_e4m3fn
w13_weight_scale_2      ``[E]``                          float32: the dequantization multiplier
w2_weight_scale_2       ``[E]``                          float32
======================  ===============================  ==============================================

w13: N = 2I (gate rows, then up rows), K = H; w2: N = H, K = I. Each N is padded to a multiple of 256 and
each K to 128 by humming, with zero codes and zero scale bytes; vLLM does not pad I for this path.

humming keeps one secondary scale per expert only when, over every expert of the rank, the gate's and the
up's global scales are equal (``_may_process_global_scale``); otherwise it makes them per output channel,
in the model dtype. The layout holds the first case, which is what llm-compressor writes (it fuses gate and
up global scales); a layer whose gate and up global scales differ is refused naming the expert.
"""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.layouts import register
from moeconvert.layouts.base import PARAMS_DTYPES, W2, W13, Layout, NotASlice, TensorSpec, TPCut, round_up
from moeconvert.layouts.humming import PAD_K, PAD_N, HummingSublayer, _pad, humming_configs, repack_weights, \
    unrepack_weights
from moeconvert.layouts.humming_mxfp4 import pack_e2m1, unpack_e2m1
from moeconvert.layouts.marlin import grouped_perm
from moeconvert.layouts.marlin_nvfp4 import _refuse_nan
from moeconvert.schemes import NVFP4Scheme, Scheme

GROUP_SIZE = 16
SUBLAYERS = ("w13", "w2")
NAMES = {"w13": W13, "w2": W2}  # vLLM's _replace_layer_parameters: f"{sublayer}_{weight|weight_scale}"
#: humming's secondary scale, named by vLLM's _replace_layer_parameters f"{sublayer}_weight_scale_2"
GLOBAL = {"w13": "w13_weight_scale_2", "w2": "w2_weight_scale_2"}


@dataclasses.dataclass(frozen=True)
class Sublayer:
    N: int
    K: int
    Np: int
    Kp: int


def sublayers(shape: LayerShape) -> dict[str, Sublayer]:
    """w13 (N = 2I, K = H) and w2 (N = H, K = I) with humming's padding."""
    H, I = shape.hidden_size, shape.intermediate_size
    return {sub: Sublayer(N, K, round_up(N, PAD_N), round_up(K, PAD_K))
            for sub, (N, K) in (("w13", (2 * I, H)), ("w2", (H, I)))}


def _e4m3_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@register
class HummingNVFP4Layout(Layout):
    name = "humming"
    version = 1
    schemes = ("nvfp4",)
    runtime_kernels = ("humming",)  # runtime/humming.py; the reference when it cannot run (and says why)
    kernel = ("humming-kernels HummingGroupedExperts, e2m1 weights, e4m3 group-16 scales, fp32 global scale "
              "(vLLM, SM90, 16-bit activations)")
    made_for = {"vllm": ["0.33.0", "0.34.0"], "humming-kernels": "0.1.19", "sm": "90",
                "activation": "16-bit (model dtype)"}
    vllm_method = "HummingNVFP4Method"

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, NVFP4Scheme)
        H, I = shape.hidden_size, shape.intermediate_size
        problems = []
        if scheme.group_size != GROUP_SIZE:
            problems.append(f"NVFP4 group size = {scheme.group_size}: humming's nvfp4 schema reads one e4m3 scale "
                            "per 16 elements along K")
        if H % GROUP_SIZE:
            problems.append(f"hidden_size H = {H} must be a multiple of 16 (whole NVFP4 scale groups along w13's K)")
        if I % GROUP_SIZE:
            problems.append(f"intermediate_size I = {I} (per TP partition) must be a multiple of 16 (whole scale "
                            "groups along w2's K)")
        if shape.dtype not in PARAMS_DTYPES:
            problems.append(f"model dtype = {shape.dtype}: humming's 16-bit path runs float16 or bfloat16 "
                            "activations")
        if shape.activation != "silu":
            problems.append(f"activation = {shape.activation}: vLLM's NVFP4 experts are loaded [gate; up] for "
                            "SiLU-and-mul; this layout knows no other row order")
        if shape.has_bias:
            problems.append("expert biases: compressed-tensors NVFP4 experts carry none, and vLLM's NVFP4 method "
                            "creates no bias parameters")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E = shape.num_experts
        subs = sublayers(shape)
        specs = []
        for sub in SUBLAYERS:
            s = subs[sub]
            specs += [TensorSpec(NAMES[sub].weight, (E, s.Kp // 16, 2 * s.Np), torch.int32),
                      TensorSpec(NAMES[sub].weight_scale, (E, s.Kp // GROUP_SIZE, s.Np), torch.float8_e4m3fn)]
        specs += [TensorSpec(GLOBAL[sub], (E,), torch.float32) for sub in SUBLAYERS]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        self.require_block_sizes(block, shape)
        _require_block(block, shape)
        _refuse_split_global(block)
        E = block.num_experts
        out: dict[str, torch.Tensor] = {}
        for sub, d in sublayers(shape).items():
            out[NAMES[sub].weight] = repack_weights(_pad(unpack_e2m1(getattr(block, sub)), (E, d.Np, d.Kp)), 4)
            scale = _e4m3_bytes(getattr(block, f"{sub}_scale"))
            _refuse_nan(scale, sub)
            # check_and_pad_tensors pads e4m3 scales with 0, then transform_humming_weight_scale (group scales
            # applied before the MMA): K-first, 8x8-transposed in runs of 64
            scale = _pad(scale, (E, d.Np, d.Kp // GROUP_SIZE))
            out[NAMES[sub].weight_scale] = grouped_perm(scale.transpose(1, 2).contiguous()).view(torch.float8_e4m3fn)
        # _may_process_global_scale: equal gate and up multipliers collapse to one fp32 per expert
        out[GLOBAL["w13"]] = block.w13_global[:, 0].contiguous()
        out[GLOBAL["w2"]] = block.w2_global.contiguous()
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        kw: dict[str, torch.Tensor] = {}
        for sub, d in sublayers(shape).items():
            kw[sub] = pack_e2m1(unrepack_weights(tensors[NAMES[sub].weight], 4, d.Np, d.Kp)[:, :d.N, :d.K])
            scale = grouped_perm(_e4m3_bytes(tensors[NAMES[sub].weight_scale])).transpose(1, 2)
            kw[f"{sub}_scale"] = scale[:, :d.N, :d.K // GROUP_SIZE].contiguous().view(torch.float8_e4m3fn)
        g13 = tensors[GLOBAL["w13"]].float()
        return ExpertBlock(scheme=scheme, w13_global=g13.unsqueeze(1).expand(-1, 2).contiguous(),
                           w2_global=tensors[GLOBAL["w2"]].float().contiguous(), **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """humming runs 16-bit activations here: a W4A4 checkpoint's input scales are not kept."""
        return dataclasses.replace(block, w13_input_global=None, w2_input_global=None)

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        return NotASlice("humming pads and tiles each rank's sublayers on their own (N to 256, K to 128, 64x64 "
                         "tiles), so a rank's tensors are not a slice of the full ones")

    # -- what a loader needs to rebuild humming's LayerConfig --------------------------------------------

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        """humming's LayerConfig fields per sublayer (docs/layouts/humming.md, "NVFP4")."""
        f16 = "bfloat16" if shape.dtype == "bfloat16" else "float16"
        meta = {}
        for sub, d in sublayers(shape).items():
            meta[sub] = {
                "shape_n": d.Np, "shape_k": d.Kp, "pad_shape_n": d.Np - d.N, "pad_shape_k": d.Kp - d.K,
                "num_experts": shape.num_experts,
                "b_dtype": "float4e2m1", "a_dtype": f16, "c_dtype": f16, "bs_dtype": "float8e4m3",
                "weight_scale_group_size": GROUP_SIZE, "weight_scale_type": "group",
                "has_zero_point": False, "has_bias": False, "sm_version": 90,
            }
        return meta

    def humming_sublayers(self, metadata: dict, scheme: Scheme, *, hidden_size: int, intermediate_size: int,
                          num_experts: int, has_bias: bool, dtype: torch.dtype, input_schemas: dict | None = None,
                          device=None) -> dict[str, HummingSublayer]:
        """Each sublayer's humming weight schema and ``LayerConfig`` (``humming_configs``), the weight schema
        being the one humming's compressed-tensors NVFP4 conversion leaves (:func:`nvfp4_weight_schema`)."""
        return humming_configs(metadata, weight_schemas={sub: nvfp4_weight_schema(dtype) for sub in SUBLAYERS},
                               hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts,
                               has_bias=has_bias, dtype=dtype, input_schemas=input_schemas, device=device)

    def vllm_state_problem(self, scheme: Scheme) -> str | None:
        return None


#: vLLM's HUMMING branch of ``convert_to_nvfp4_moe_kernel_format`` for compressed-tensors layers
VLLM_QUANT_CONFIG = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "type": "float",
                     "num_bits": 4, "strategy": "group", "group_size": 16}


def nvfp4_weight_schema(dtype: torch.dtype):
    """humming's ``HummingWeightSchema`` for NVFP4 experts with one secondary scale per expert: the schema of
    vLLM's compressed-tensors NVFP4 config (:data:`VLLM_QUANT_CONFIG`) made humming's (``to_humming_schema``),
    which is what its ``convert_humming`` leaves for such a layer (e2m1, e4m3 group-16 scales, fp32 tensor
    secondary scale)."""
    from humming.schema import BaseWeightSchema

    return BaseWeightSchema.from_config(dict(VLLM_QUANT_CONFIG)).to_humming_schema(dtype)


def _refuse_split_global(block: ExpertBlock) -> None:
    differ = block.w13_global[:, 0] != block.w13_global[:, 1]
    if bool(differ.any()):
        e = int(torch.nonzero(differ)[0])
        raise MoeConvertError(
            "gate and up NVFP4 global scales differ: vLLM's humming path then holds per-channel secondary "
            "scales, which the humming layout does not write (use --backend marlin, which uses the gate's)",
            tensor=f"w13 global scales of local expert {e}", expected="the gate's equal to the up's",
            found=f"{float(block.w13_global[e, 0])!r} and {float(block.w13_global[e, 1])!r}")


def _require_block(block: ExpertBlock, shape: LayerShape) -> None:
    E, H, I = block.num_experts, shape.hidden_size, shape.intermediate_size
    want = {"w13": ((E, 2 * I, H // 2), torch.uint8), "w2": ((E, H, I // 2), torch.uint8),
            "w13_scale": ((E, 2 * I, H // GROUP_SIZE), torch.float8_e4m3fn),
            "w2_scale": ((E, H, I // GROUP_SIZE), torch.float8_e4m3fn),
            "w13_global": ((E, 2), torch.float32), "w2_global": ((E,), torch.float32)}
    for name, (dims, dtype) in want.items():
        t = getattr(block, name)
        if t is None or tuple(t.shape) != dims or t.dtype != dtype:
            found = None if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise InternalError(f"NVFP4 block {name} is {found}, the layer H={H} I={I} needs {dims} {dtype}")
