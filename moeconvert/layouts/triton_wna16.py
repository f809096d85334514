"""``triton``: WNA16 experts as vLLM 0.33.0's Triton WNA16 MoE kernel reads them (docs/layouts/triton.md).

The bytes equal what vLLM holds after ``convert_to_wna16_moe_kernel_format`` (TRITON branch), the
tensors ``TritonWNA16Experts`` hands to ``fused_moe_kernel_gptq_awq``. Nothing moves: the weights stay
N-first and are the checkpoint's int32 words read as bytes; only the zero points are re-cut from words
packed along N into bytes laid along N.

=======================  ===============================  =========================================
tensor                   shape                            dtype
=======================  ===============================  =========================================
w13_weight               ``[E, 2I, H*bits/8]``            uint8, LE bytes of the CT words [gate; up]
w2_weight                ``[E, H, I*bits/8]``             uint8
w13_weight_scale         ``[E, 2I, H/g]``                 model dtype (fp16/bf16/fp32), unchanged
w2_weight_scale          ``[E, H, I/g]``                  model dtype
w13_weight_zero_point    ``[E, I, H/g]`` (int4 asym)      uint8: row r = z[2r] | z[2r+1] << 4
w2_weight_zero_point     ``[E, H/2, I/g]`` (int4 asym)    uint8
=======================  ===============================  =========================================

Weight bytes: int4 byte j of a row holds the unsigned codes of k = 2j (low nibble) and 2j + 1 (high
nibble), which is what a little-endian int32 word of compressed-tensors' LSB-first packing is; int8
byte k is the code of k. Codes and zero points are unsigned (``u = q + 2^(b-1)``, spec §1.3); the
kernel subtracts the stored zero point, or 8 / 128 when there is none. Scales are cast to the model
dtype as vLLM's loader ``copy_`` does (round to nearest even), nothing else. vLLM names the weights
``w13_weight_packed`` / ``w2_weight_packed`` and aliases them as ``w13_weight`` / ``w2_weight``.
"""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError
from moeconvert.layouts import register
from moeconvert.layouts.base import W2, W13, Layout, NotASlice, TensorSpec, TPCut
from moeconvert.schemes import Scheme, WNA16Scheme

PARAMS_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# experts/triton_moe.py:TritonExperts.is_supported_config: moe_align_block_size's limit
MAX_PADDED_EXPERTS = 1024


def expert_count_problems(num_experts: int) -> list[str]:
    """The expert-count limit of vLLM's Triton MoE path (its moe_align_block_size), shared by the layouts it runs."""
    if -(-num_experts // 32) * 32 >= MAX_PADDED_EXPERTS:
        return [f"{num_experts} experts: the Triton path's moe_align_block_size needs fewer than {MAX_PADDED_EXPERTS} "
                "experts after rounding up to a multiple of 32 (vLLM counts the global experts)"]
    return []


# ---------------------------------------------------------------------------------------------------
# bytes along one dimension (spec §5): int4 two codes a byte, even index low; int8 one code a byte


def pack_bytes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-wide codes -> uint8 along ``dim`` (int4: ``c[2j] | c[2j+1] << 4``)."""
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    if bits != 4:
        raise InternalError(f"Triton byte packing of {bits}-bit codes")
    x = codes.to(torch.uint8).movedim(dim, -1)
    return (x[..., 0::2] | (x[..., 1::2] << 4)).movedim(-1, dim).contiguous()


def unpack_bytes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_bytes`: uint8 bytes -> unsigned codes (uint8), twice as many for int4."""
    if bits == 8:
        return packed.contiguous()
    if bits != 4:
        raise InternalError(f"Triton byte unpacking of {bits}-bit codes")
    x = packed.movedim(dim, -1)
    codes = torch.stack([x & 0xF, x >> 4], dim=-1).reshape(*x.shape[:-1], 2 * x.shape[-1])
    return codes.movedim(-1, dim).contiguous()


# ---------------------------------------------------------------------------------------------------


@register
class TritonWNA16Layout(Layout):
    name = "triton"
    version = 1
    schemes = ("wna16",)
    runtime_kernels = ("triton",)  # our port of the kernel: kernels/moe_wna16.py
    kernel = "vllm fused_moe_kernel_gptq_awq (TritonWNA16Experts)"
    made_for = {"vllm": ["0.33.0", "0.34.0"]}  # the versions whose processing the oracle tests check
    vllm_method = "TritonWNA16Method"

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
        g, bits = scheme.group_size, scheme.bits
        problems = []
        if bits not in (4, 8):
            problems.append(f"bits = {bits}: the Triton WNA16 MoE kernel takes 4- and 8-bit weights only")
        if bits == 8 and not scheme.symmetric:
            problems.append(
                "8-bit weights with zero points (asymmetric) are not among TritonWNA16Experts' schemes "
                "(kInt8Static is symmetric only): int8 must be symmetric (uint8b128)"
            )
        if g <= 0:
            problems.append(
                "channelwise scales (group_size = -1): vLLM 0.33.0 refuses them for every non-Marlin WNA16 "
                "backend (CompressedTensorsWNA16MoEMethod asserts strategy == 'group'); the Triton kernel "
                "indexes scales by k // group_size"
            )
        else:
            if H % g:
                problems.append(f"hidden_size H = {H} must be divisible by group_size {g}")
            if I % g:
                problems.append(
                    f"intermediate_size I = {I} (per TP partition) must be divisible by group_size {g} "
                    "(scale groups may not cross the TP shard boundary)"
                )
        if bits in (4, 8):
            pf = scheme.pack_factor
            if H % pf:
                problems.append(
                    f"hidden_size H = {H} must be a multiple of the pack factor {pf}: whole int32 words per "
                    f"w13 row (the kernel reads H*{bits}/8 bytes a row)"
                    + ("" if scheme.symmetric else " and whole zero-point words for w2")
                )
            if I % pf:
                problems.append(
                    f"intermediate_size I = {I} (per TP partition) must be a multiple of the pack factor {pf}: "
                    "whole int32 words per w2 row and per TP cut"
                    + ("" if scheme.symmetric else ", and whole zero-point words for gate and up (2I)")
                )
        if shape.dtype not in PARAMS_DTYPES:
            problems.append(f"model dtype = {shape.dtype}: the Triton kernel runs float16, bfloat16 or float32 activations")
        if shape.activation == "situ":
            problems.append("activation = situ: vLLM's TritonWNA16Experts does not run SITU (its _supports_activation "
                            "has no SITU in vLLM 0.33.0 / 0.34.0); the marlin and humming layouts run it")
        if shape.has_bias:
            problems.append(
                "expert biases: TritonWNA16Experts never adds them (vLLM 0.33.0 keeps them in memory and "
                "ignores them, so the layer would run without its biases)"
            )
        problems += expert_count_problems(E)
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        assert isinstance(scheme, WNA16Scheme)
        E, H, I, b = shape.num_experts, shape.hidden_size, shape.intermediate_size, scheme.bits
        dt = PARAMS_DTYPES[shape.dtype]
        G13, G2 = scheme.groups(H), scheme.groups(I)
        specs = [
            TensorSpec(W13.weight, (E, 2 * I, H * b // 8), torch.uint8),
            TensorSpec(W2.weight, (E, H, I * b // 8), torch.uint8),
            TensorSpec(W13.weight_scale, (E, 2 * I, G13), dt),
            TensorSpec(W2.weight_scale, (E, H, G2), dt),
        ]
        if not scheme.symmetric:
            specs += [
                TensorSpec(W13.weight_zero_point, (E, 2 * I * b // 8, G13), torch.uint8),
                TensorSpec(W2.weight_zero_point, (E, H * b // 8, G2), torch.uint8),
            ]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        s = block.scheme
        self.require(shape, s)
        self.require_block_sizes(block, shape)
        dt = PARAMS_DTYPES[shape.dtype]
        out = {
            W13.weight: pack_bytes(block.w13, s.bits, dim=2),
            W2.weight: pack_bytes(block.w2, s.bits, dim=2),
            # the loader's copy_ into params_dtype; the TRITON branch passes scales through untouched
            W13.weight_scale: block.w13_scale.to(dt).contiguous(),
            W2.weight_scale: block.w2_scale.to(dt).contiguous(),
        }
        if not s.symmetric:
            # vLLM reads each zero-point word's 4 bytes down N: bytes along N, two channels a byte
            out[W13.weight_zero_point] = pack_bytes(block.w13_zero, s.bits, dim=1)
            out[W2.weight_zero_point] = pack_bytes(block.w2_zero, s.bits, dim=1)
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical block; scales stay in the file's (model) dtype."""
        assert isinstance(scheme, WNA16Scheme)
        b = scheme.bits
        kw = {
            "w13": unpack_bytes(tensors[W13.weight], b, dim=2),
            "w2": unpack_bytes(tensors[W2.weight], b, dim=2),
            "w13_scale": tensors[W13.weight_scale],
            "w2_scale": tensors[W2.weight_scale],
        }
        if not scheme.symmetric:
            kw["w13_zero"] = unpack_bytes(tensors[W13.weight_zero_point], b, dim=1)
            kw["w2_zero"] = unpack_bytes(tensors[W2.weight_zero_point], b, dim=1)
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """The source block with its scales cast to the model dtype, as vLLM's loader casts them."""
        dt = PARAMS_DTYPES[shape.dtype]
        return dataclasses.replace(block, w13_scale=block.w13_scale.to(dt), w2_scale=block.w2_scale.to(dt))

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        """Nothing is tiled or permuted: a TP rank's tensors are its rows of w13 (N, as [gate; up] halves;
        zero points two rows a byte) and its columns of w2 (K bytes; scale groups), whenever the rank's
        own layer is one this layout takes (whole groups and whole bytes per rank)."""
        assert isinstance(scheme, WNA16Scheme)
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        cuts = {W13.weight: TPCut(1, runs=2), W2.weight: TPCut(2), W13.weight_scale: TPCut(1, runs=2),
                W2.weight_scale: TPCut(2)}
        if not scheme.symmetric:
            cuts.update({W13.weight_zero_point: TPCut(1, runs=2), W2.weight_zero_point: TPCut(2)})
        return cuts

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        if scheme.scale_dtype != shape.dtype:
            return [f"checkpoint scales are {scheme.scale_dtype}; they are cast to the model dtype {shape.dtype} "
                    "(round to nearest even), as vLLM's loader does"]
        return []
