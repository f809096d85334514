"""``flashinfer-cutlass``: MXFP4 experts as FlashInfer's CUTLASS MoE kernel reads them (docs/layouts/flashinfer-mxfp4.md).

The bytes equal what vLLM 0.33.0 holds after ``convert_weight_to_mxfp4_moe_kernel_format`` (and, for
gpt-oss, ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``, which ends in the same bytes) for
backend FLASHINFER_CUTLASS_MXFP4_BF16: the SM90 mixed-input (W4A16) GEMM of
``flashinfer.fused_moe.cutlass_fused_moe`` with ``use_w4_group_scaling=True``, bf16 activations.
vLLM runs it on SM 9.0 only (``FlashInferExperts``; ``--moe-backend flashinfer_cutlass``).

The canonical block is already padded (H, I per TP rank rounded up to ``pad_multiples``, zeros with
scale byte 0) and its w13 rows are ``[gate (Ip); up (Ip)]`` for every activation. vLLM holds gpt-oss's
rows interleaved (2j = gate j, 2j+1 = up j) before conversion, but its conversion ends in the same
kernel order as for a ``[gate; up]`` checkpoint, so nothing here depends on the activation.

=================  ==================================================
tensor             contents
=================  ==================================================
w13_weight         u8 ``[E, 2Ip, Hp/2]``, rows ``[up; gate]``, SM90 fp4 interleave
w13_weight_scale   u8 ``[E, 2Ip/64, Hp/128, 16, 16]``
w2_weight          u8 ``[E, Hp, Ip/2]``, interleaved
w2_weight_scale    u8 ``[E, Hp/64, Ip/128, 16, 16]``
w13_bias, w2_bias  bf16 ``[E, 2Ip]`` (``[up; gate]``), ``[E, Hp]``
=================  ==================================================

Every transform is a reshape/permute of a whole chunk of experts. The TRT-LLM MXFP4 layout is
flashinfer_trtllm_mxfp4.py; docs/layouts/flashinfer-mxfp4.md describes both.
"""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import Layout, TensorSpec
from moeconvert.layouts.flashinfer_common import MADE_FOR, MXFP4_BLOCK, check_block, common_problems, scale_bytes
from moeconvert.schemes import MXFP4Scheme, Scheme

# ---------------------------------------------------------------------------------------------------
# the SM90 fp4 byte interleave (spec §6.3 step 2; FlashInfer's
# interleave_fp4_weights_for_sm90_mixed_gemm_kernel in moe_gemm_mixed_utils.cu)
#
# Per expert, an [n, k/2] byte matrix. For row r0 = 16 band + i (i < 8), 32-byte partition p, m, t < 4,
# the four bytes b0 = W[r0, c], b1 = W[r0 + 8, c], b2 = W[r0, c + 4], b3 = W[r0 + 8, c + 4] with
# c = 32p + 8m + t become one little-endian 32-bit word at row r0 + 8 (m % 2), byte column
# 32p + 16 (m // 2) + 4t. Nibble q of slot s goes to bits 16q + SM90_FP4_BITS[s] (m, e0, e1, sign):
# low nibbles fill the low half-word, high nibbles the high one.

SM90_FP4_BITS = (
    (6, 7, 8, 15),  # b0
    (3, 4, 5, 12),  # b1
    (0, 1, 2, 9),  # b2
    (13, 10, 11, 14),  # b3
)

# dims of one expert's bytes viewed as (band, hi, i, p, mh, ml, h, t): row = 16 band + 8 hi + i,
# column = 32p + 16 mh + 8 ml + 4h + t (m = 2 mh + ml); slot s = hi + 2h.
# Output order (band, ml, i, p, mh, t, h, hi): row = 16 band + 8 ml + i, column = 32p + 16 mh + 4t + s.
_SM90_ORDER = (0, 1, 6, 3, 4, 5, 8, 7, 2)  # with experts in front
_SM90_INVERSE = tuple(sorted(range(9), key=_SM90_ORDER.__getitem__))


def _bit_moves(forward: bool) -> tuple[tuple[int, int], ...]:
    """The word's bit permutation as (source mask, left shift) groups, one per distinct shift."""
    moves: dict[int, int] = {}
    for s, bits in enumerate(SM90_FP4_BITS):
        for q in range(2):
            for b, dst in enumerate(bits):
                src, dst = 8 * s + 4 * q + b, 16 * q + dst
                if not forward:
                    src, dst = dst, src
                moves[dst - src] = moves.get(dst - src, 0) | (1 << src)
    return tuple((mask, shift) for shift, mask in sorted(moves.items()))


_FORWARD_MOVES, _INVERSE_MOVES = _bit_moves(True), _bit_moves(False)


def _permute_word_bits(slots: torch.Tensor, moves) -> torch.Tensor:
    """Bytes ``[..., 4]`` (little-endian words) -> the words' bytes after the bit permutation."""
    s = slots.to(torch.int64)
    word = s[..., 0] | (s[..., 1] << 8) | (s[..., 2] << 16) | (s[..., 3] << 24)
    out = torch.zeros_like(word)
    for mask, shift in moves:
        part = word & mask
        out |= part << shift if shift >= 0 else part >> -shift
    return torch.stack([(out >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8)


def _sm90_view(n: int, k: int) -> tuple[int, ...]:
    return (n // 16, 2, 8, k // 64, 2, 2, 2, 4)


def interleave_sm90_fp4(w: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 ``[E, n, k/2]`` (n % 16 == 0, k % 64 == 0) -> the SM90 mixed-GEMM layout, same shape."""
    E, n, kb = w.shape
    view = _sm90_view(n, 2 * kb)
    src = w.reshape(E, *view).permute(_SM90_ORDER)  # (..., h, hi): the word's four bytes in slot order
    words = _permute_word_bits(src.reshape(*src.shape[:-2], 4), _FORWARD_MOVES)
    return words.reshape(E, n, kb)


def deinterleave_sm90_fp4(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_sm90_fp4`."""
    E, n, kb = x.shape
    view = _sm90_view(n, 2 * kb)
    full = (E, *view)
    permuted = tuple(full[d] for d in _SM90_ORDER)
    slots = _permute_word_bits(x.reshape(*permuted[:-2], 4), _INVERSE_MOVES)
    return slots.reshape(permuted).permute(_SM90_INVERSE).reshape(E, n, kb).contiguous()


# ---------------------------------------------------------------------------------------------------
# the SM90 scale fold (spec §6.3 step 3; FlashInfer's interleave_moe_scales_for_sm90_mixed_gemm)


def fold_scales_sm90(s: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes ``[E, R, C]`` (R % 64 == 0, C % 4 == 0) -> ``[E, R/64, C/4, 16, 16]`` with
    ``out[e, a, b, f, 4m + j] = in[e, 64a + 16m + f, 4b + j]``: each 64-row x 128-element block of
    scales as 16 rows of 16 bytes."""
    E, R, C = s.shape
    return s.reshape(E, R // 64, 4, 16, C // 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(E, R // 64, C // 4, 16, 16)


def unfold_scales_sm90(x: torch.Tensor) -> torch.Tensor:
    E, A, B = x.shape[:3]
    return x.reshape(E, A, B, 16, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(E, 64 * A, 4 * B)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[E, 2n, ...]``: the two halves of dim 1 swapped (``[gate; up]`` <-> ``[up; gate]``); an involution."""
    E, n2 = x.shape[:2]
    return x.reshape(E, 2, n2 // 2, *x.shape[2:]).flip(1).reshape(x.shape)



# ---------------------------------------------------------------------------------------------------


@register
class FlashInferCutlassMXFP4Layout(Layout):
    name = "flashinfer-cutlass"
    version = 1
    schemes = ("mxfp4",)
    runtime_kernels = ()  # FlashInfer is not called by the runtime (yet)
    kernel = "flashinfer.fused_moe.cutlass_fused_moe (SM90 mixed-input W4A16, use_w4_group_scaling=True)"
    made_for = MADE_FOR
    pad_multiples = (128, 128)  # mxfp4_round_up_hidden_size_and_intermediate_size, FLASHINFER_CUTLASS_*

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, MXFP4Scheme)
        Hp, Ip = shape.hidden_size, shape.intermediate_size
        problems = common_problems("FlashInfer CUTLASS", shape, self.pad_multiples)
        # FlashInfer's own checks (interleave_moe_weights/scales_for_sm90_mixed_gemm), for both GEMMs
        for gemm, n, k in (("w13", 2 * Ip, Hp), ("w2", Hp, Ip)):
            if n % 16:
                problems.append(f"{gemm}_weight: n = {n} rows must be divisible by 16 (SM90 mixed-GEMM interleave)")
            if k % 64:
                problems.append(f"{gemm}_weight: K = {k} must be divisible by 64 (SM90 mixed-GEMM interleave)")
            if n % 64:
                problems.append(f"{gemm}_weight_scale: rows = {n} must be divisible by 64 (SM90 scale fold)")
            if k % MXFP4_BLOCK == 0 and (k // MXFP4_BLOCK) % 4:
                problems.append(f"{gemm}_weight_scale: K/32 = {k // MXFP4_BLOCK} must be divisible by 4 "
                                "(one 128-element K block per fold)")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, Hp, Ip = shape.num_experts, shape.hidden_size, shape.intermediate_size
        specs = [
            TensorSpec("w13_weight", (E, 2 * Ip, Hp // 2), torch.uint8),
            TensorSpec("w13_weight_scale", (E, 2 * Ip // 64, Hp // 128, 16, 16), torch.uint8),
            TensorSpec("w2_weight", (E, Hp, Ip // 2), torch.uint8),
            TensorSpec("w2_weight_scale", (E, Hp // 64, Ip // 128, 16, 16), torch.uint8),
        ]
        if shape.has_bias:
            specs += [TensorSpec("w13_bias", (E, 2 * Ip), torch.bfloat16), TensorSpec("w2_bias", (E, Hp), torch.bfloat16)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        check_block(block, shape)
        # swap_w13_to_w31 on weights and scales, then FlashInfer's two SM90 interleaves (spec §6.3)
        out = {
            "w13_weight": interleave_sm90_fp4(swap_halves(block.w13)),
            "w13_weight_scale": fold_scales_sm90(swap_halves(scale_bytes(block.w13_scale))),
            "w2_weight": interleave_sm90_fp4(block.w2),
            "w2_weight_scale": fold_scales_sm90(scale_bytes(block.w2_scale)),
        }
        if block.w13_bias is not None:
            out["w13_bias"] = swap_halves(block.w13_bias.to(torch.bfloat16))
            out["w2_bias"] = block.w2_bias.to(torch.bfloat16).contiguous()
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical (padded) block; biases stay bfloat16 (the file's dtype)."""
        kw = {}
        if "w13_bias" in tensors:
            kw = {"w13_bias": swap_halves(tensors["w13_bias"]), "w2_bias": tensors["w2_bias"]}
        return ExpertBlock(
            scheme=scheme,
            w13=swap_halves(deinterleave_sm90_fp4(tensors["w13_weight"])),
            w13_scale=swap_halves(unfold_scales_sm90(tensors["w13_weight_scale"])),
            w2=deinterleave_sm90_fp4(tensors["w2_weight"]),
            w2_scale=unfold_scales_sm90(tensors["w2_weight_scale"]),
            **kw,
        )

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """The block with its biases in bfloat16, as vLLM casts them."""
        if block.w13_bias is None:
            return block
        return dataclasses.replace(block, w13_bias=block.w13_bias.to(torch.bfloat16),
                                   w2_bias=block.w2_bias.to(torch.bfloat16))

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        return {"w13_rows": "up, gate", "weight_interleave": "sm90_mixed_gemm_fp4",
                "scale_layout": "sm90_mixed_gemm_fold_64x128", "compute_capability": "9.0"}

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        out = []
        if shape.activation == "swigluoai":
            out.append(
                "activation swigluoai: with --moe-backend auto vLLM 0.33.0 picks TRITON for it on SM90; "
                "serve this file with --moe-backend flashinfer_cutlass (the model's swiglu alpha/beta/limit "
                "are passed to the kernel at run time, the weight layout is the same)"
            )
        return out
