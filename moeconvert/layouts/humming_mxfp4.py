"""``humming`` for MXFP4 experts: vLLM 0.33.0's HUMMING memory for MXFP4 MoE experts (docs/layouts/humming.md,
"MXFP4").

The bytes equal what vLLM 0.33.0 keeps for an MXFP4 MoE layer served by ``Mxfp4MoEMethod`` (checkpoints whose
``quant_method`` is ``mxfp4``, outside gpt-oss) on SM90 with 16-bit activations, once
``convert_weight_to_mxfp4_moe_kernel_format`` has run ``convert_to_humming_moe_kernel_format`` with
``{"quant_method": "mxfp4"}``: humming-kernels 0.1.19's ``Mxfp4WeightSchema.convert_humming`` (the packed e2m1
bytes viewed as int32 words, the scale bytes as e8m0) and ``prepare_and_transform_humming_tensors`` on each
sublayer (w13, w2).

======================  ===============================  ==============================================
tensor                  shape                            dtype
======================  ===============================  ==============================================
w13_weight              ``[E, K13p/16, 2 N13p]``         int32, 64x64 tiles (``weight_repack_nk``, 4 bits)
w2_weight               ``[E, K2p/16, 2 N2p]``           int32
w13_weight_scale        ``[E, K13p/32, N13p]``           float8_e8m0fnu, K-first, 8x8-transposed columns
w2_weight_scale         ``[E, K2p/32, N2p]``             float8_e8m0fnu
w13_bias, w2_bias       ``[E, N13p]``, ``[E, N2p]``      bfloat16, 32-cycle permuted
======================  ===============================  ==============================================

w13: N = 2 Ip (``[gate | 0 | up | 0]``, Ip = I per TP rank rounded up to 64 as vLLM rounds it for HUMMING),
K = H; w2: N = H, K = Ip. Each N is padded to a multiple of 256 and each K to 128 by humming, with zero codes,
scale byte 127 (e8m0 1.0: humming pads e8m0 scales with 1) and zero biases. Nothing depends on the data.
"""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import W2, W13, Layout, NotASlice, TensorSpec, TPCut, round_up
from moeconvert.layouts.humming import PAD_K, PAD_N, HummingSublayer, _pad, humming_configs, repack_weights, \
    unrepack_weights
from moeconvert.layouts.marlin import grouped_perm, single_perm
from moeconvert.mxfp4 import MXFP4_BLOCK_SIZE, e8m0_bytes, require_padded_block
from moeconvert.schemes import MXFP4Scheme, Scheme

#: vLLM's round-up of (H, I per TP rank) for its HUMMING MXFP4 backend
#: (``mxfp4_round_up_hidden_size_and_intermediate_size``, generic branch: I to 64, H unchanged)
PAD_MULTIPLES = (1, 64)
MODEL_DTYPE = torch.bfloat16
#: humming's pad value for e8m0 scales (``check_and_pad_tensors``: ``value = 1`` for float8_e8m0fnu)
E8M0_ONE = 127
SUBLAYERS = ("w13", "w2")
NAMES = {"w13": W13, "w2": W2}  # vLLM's _replace_layer_parameters: f"{sublayer}_{weight|weight_scale|bias}"


@dataclasses.dataclass(frozen=True)
class Sublayer:
    N: int
    K: int
    Np: int
    Kp: int


def sublayers(shape: LayerShape) -> dict[str, Sublayer]:
    """w13 (N = 2 Ip, K = H) and w2 (N = H, K = Ip) with humming's padding; ``shape`` holds the padded Ip."""
    H, I = shape.hidden_size, shape.intermediate_size
    return {sub: Sublayer(N, K, round_up(N, PAD_N), round_up(K, PAD_K))
            for sub, (N, K) in (("w13", (2 * I, H)), ("w2", (H, I)))}


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 ``[E, N, K/2]`` (low nibble = even k) -> codes ``[E, N, K]``. The bytes of a row viewed as
    little-endian int32 are humming's packed 4-bit weight (element ``8w + q`` at bits ``4q`` of word w), which
    is what ``Mxfp4WeightSchema._convert_humming`` hands the transform."""
    E, N, Kb = packed.shape
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(E, N, 2 * Kb)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


@register
class HummingMXFP4Layout(Layout):
    name = "humming"
    version = 1
    schemes = ("mxfp4",)
    runtime_kernels = ("humming",)  # runtime/humming.py; the reference when it cannot run (and says why)
    kernel = "humming-kernels HummingGroupedExperts, e2m1 weights, e8m0 scales (vLLM 0.33.0, SM90, 16-bit activations)"
    made_for = {"vllm": ["0.33.0"], "humming-kernels": "0.1.19", "sm": "90", "activation": "16-bit (model dtype)"}
    vllm_method = "HummingMXFP4Method"
    pad_multiples = PAD_MULTIPLES

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, MXFP4Scheme)
        H, Ip = shape.hidden_size, shape.intermediate_size
        problems = []
        if scheme.block_size != MXFP4_BLOCK_SIZE:
            problems.append(f"MXFP4 block size = {scheme.block_size}: humming's mxfp4 schema reads one e8m0 scale "
                            "per 32 elements along K")
        if H % MXFP4_BLOCK_SIZE:
            problems.append(f"hidden_size H = {H} must be a multiple of the MXFP4 block 32: vLLM does not pad H for "
                            "its HUMMING MXFP4 backend")
        if Ip % PAD_MULTIPLES[1]:
            problems.append(f"intermediate_size Ip = {Ip} (per TP partition) must be a multiple of "
                            f"{PAD_MULTIPLES[1]} (vLLM 0.33.0 rounds I up to it for HUMMING MXFP4; the block must "
                            "come padded)")
        if shape.dtype != "bfloat16":
            problems.append(f"model dtype = {shape.dtype}: vLLM 0.33.0's mxfp4 quantization runs bfloat16 models "
                            "only (Mxfp4Config.get_supported_act_dtypes); use --dtype bfloat16")
        if shape.activation == "swigluoai":
            problems.append("activation swigluoai (gpt-oss): vLLM serves gpt-oss MXFP4 experts with its gpt-oss "
                            "method, which on SM90 picks Triton (use --backend triton), not this humming path")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E = shape.num_experts
        subs = sublayers(shape)
        specs = []
        for sub in SUBLAYERS:
            s = subs[sub]
            specs += [TensorSpec(NAMES[sub].weight, (E, s.Kp // 16, 2 * s.Np), torch.int32),
                      TensorSpec(NAMES[sub].weight_scale, (E, s.Kp // MXFP4_BLOCK_SIZE, s.Np), torch.float8_e8m0fnu)]
        if shape.has_bias:
            specs += [TensorSpec(NAMES[sub].bias, (E, subs[sub].Np), MODEL_DTYPE) for sub in SUBLAYERS]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        require_padded_block(block, shape)
        E = block.num_experts
        out: dict[str, torch.Tensor] = {}
        for sub, d in sublayers(shape).items():
            fields = _pad(unpack_e2m1(getattr(block, sub)), (E, d.Np, d.Kp))
            out[NAMES[sub].weight] = repack_weights(fields, 4)
            scale = torch.nn.functional.pad(getattr(block, f"{sub}_scale"),
                                            (0, (d.Kp - d.K) // MXFP4_BLOCK_SIZE, 0, d.Np - d.N), value=E8M0_ONE)
            # transform_humming_weight_scale, group scales applied before the MMA: K-first, 8x8 in runs of 64
            out[NAMES[sub].weight_scale] = grouped_perm(scale.transpose(1, 2).contiguous()).view(torch.float8_e8m0fnu)
        if block.w13_bias is not None:
            for sub, d in sublayers(shape).items():
                out[NAMES[sub].bias] = single_perm(_pad(getattr(block, f"{sub}_bias").to(MODEL_DTYPE), (E, d.Np)))
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical (padded to Ip) block; biases in bfloat16."""
        kw: dict[str, torch.Tensor] = {}
        for sub, d in sublayers(shape).items():
            kw[sub] = pack_e2m1(unrepack_weights(tensors[NAMES[sub].weight], 4, d.Np, d.Kp)[:, :d.N, :d.K])
            scale = grouped_perm(e8m0_bytes(tensors[NAMES[sub].weight_scale], "humming")).transpose(1, 2)
            kw[f"{sub}_scale"] = scale[:, :d.N, :d.K // MXFP4_BLOCK_SIZE].contiguous()
            if NAMES[sub].bias in tensors:
                kw[f"{sub}_bias"] = single_perm(tensors[NAMES[sub].bias])[:, :d.N].contiguous()
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """Biases come back in bfloat16: vLLM's Mxfp4MoEMethod holds them in a bfloat16 parameter."""
        if block.w13_bias is None:
            return block
        return dataclasses.replace(block, w13_bias=block.w13_bias.to(MODEL_DTYPE),
                                   w2_bias=block.w2_bias.to(MODEL_DTYPE))

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        return NotASlice("humming pads and tiles each rank's sublayers on their own (N to 256, K to 128, 64x64 "
                         "tiles), so a rank's tensors are not a slice of the full ones")

    # -- what a loader needs to rebuild humming's LayerConfig --------------------------------------------

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        """humming's LayerConfig fields per sublayer (docs/layouts/humming.md, "MXFP4")."""
        meta = {}
        for sub, d in sublayers(shape).items():
            meta[sub] = {
                "shape_n": d.Np, "shape_k": d.Kp, "pad_shape_n": d.Np - d.N, "pad_shape_k": d.Kp - d.K,
                "num_experts": shape.num_experts,
                "b_dtype": "float4e2m1", "a_dtype": "bfloat16", "c_dtype": "bfloat16", "bs_dtype": "float8e8m0",
                "weight_scale_group_size": MXFP4_BLOCK_SIZE, "weight_scale_type": "group",
                "has_zero_point": False, "has_bias": shape.has_bias, "sm_version": 90,
            }
        return meta

    def humming_sublayers(self, metadata: dict, scheme: Scheme, *, hidden_size: int, intermediate_size: int,
                          num_experts: int, has_bias: bool, dtype: torch.dtype, input_schemas: dict | None = None,
                          device=None) -> dict[str, HummingSublayer]:
        """Each sublayer's humming weight schema and ``LayerConfig`` (``humming_configs``), the weight schema
        being humming's own ``Mxfp4WeightSchema().to_humming_schema``, as ``convert_humming`` makes it."""
        return humming_configs(metadata, weight_schemas={sub: mxfp4_weight_schema(dtype) for sub in SUBLAYERS},
                               hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts,
                               has_bias=has_bias, dtype=dtype, input_schemas=input_schemas, device=device)

    def vllm_state_problem(self, scheme: Scheme) -> str | None:
        return None


def mxfp4_weight_schema(dtype: torch.dtype):
    """humming's ``HummingWeightSchema`` for MXFP4 experts: ``Mxfp4WeightSchema`` converted as vLLM converts it."""
    from humming.schema.mxfp4 import Mxfp4WeightSchema

    return Mxfp4WeightSchema().to_humming_schema(dtype)
