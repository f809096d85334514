"""``flashinfer-trtllm`` for WNA16: int4 experts as FlashInfer's TRT-LLM MxInt4 MoE kernel reads them
(docs/layouts/flashinfer-trtllm.md).

The bytes equal what vLLM 0.33.0 holds after ``_process_weights_flashinfer``
(``prepare_static_weights_for_trtllm_mxint4_moe``, backend FLASHINFER_TRTLLM), the operands of
``flashinfer.fused_moe.trtllm_mxint4_block_scale_moe``. vLLM runs that backend on SM100 with
``VLLM_USE_FLASHINFER_MOE_INT4=1`` (``--moe-backend flashinfer_trtllm`` forces it). The MXFP4
layout of the same backend name is a different class.

=================  ==========================  ======================================================
tensor             shape                       dtype, content
=================  ==========================  ======================================================
w13_weight_packed  ``[E, H/256, 2I, 128]``     uint8; byte ``[e, b, d, j]`` = codes k = 256b + 2j (low
                                               nibble) and k + 1 (high) of FlashInfer GEMM1 row d
w13_weight_scale   ``[E, 2I * H/32]``          bfloat16, rows as the weights, swizzled 128x4
w2_weight_packed   ``[E, I/256, H, 128]``      uint8, the same for GEMM2 row d
w2_weight_scale    ``[E, H * I/32]``           bfloat16, swizzled 128x4
=================  ==========================  ======================================================

Each nibble is the signed code ``(u - 8) & 0xF`` in two's complement. GEMM1 row d is canonical up row
``i`` when ``shuf(d)`` is even and gate row ``i`` when it is odd, ``i = shuf(d) // 2``, where
``shuf(d) = 32 (d//32) + 4 (d%8) + (d%32)//8``: vLLM swaps the halves to ``[up; gate]``, FlashInfer
interleaves them for the gated activation (up 0, gate 0, up 1, ...) and then shuffles rows in blocks
of 32 for its transposed MMA output (``epilogue_tile_m = 128``). GEMM2 row d is canonical w2 row
``shuf(d)``. A scale follows the row of its weights; then each expert's ``[R, C]`` scale matrix is
flattened so that entry ``(r, c)`` lands at ``512 (c//4) + 16 (r%32) + 4 ((r%128)//32) + c%4 +
128 C (r//128)`` (``block_scale_interleave``; no padding, since R % 128 == 0 and C % 4 == 0 here).
Scales are cast to bfloat16 exactly as vLLM's loader ``copy_`` does (round to nearest even).

The row orders are planned once per (H, I); everything else is a reshape/permute of a whole chunk
of experts.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import Layout, TensorSpec
from moeconvert.schemes import Scheme, WNA16Scheme

GROUP_SIZE = 32  # vLLM's weight key kInt4Static32: int4, symmetric, one scale per 32 along K
BLOCK_K_BYTES = 128  # convert_to_block_layout(x, 128): 128 bytes = 256 int4 codes of K per block
SHUFFLE_ROWS = 32  # get_shuffle_block_size(epilogue_tile_m=128)
SF_TILE_ROWS, SF_TILE_COLS = 128, 4  # block_scale_interleave's SWIZZLED_128x4
ACTIVATIONS = ("silu", "swigluoai")  # TrtLlmMxint4ExpertsMonolithic._supports_activation (gated)
SCALE_DTYPE = torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# row orders (spec §4 step 4)


def shuffle_rows(m: int) -> torch.Tensor:
    """Source row of each of ``m`` rows after the epilogue shuffle: ``shuf(d)``.

    In every 32-row block the rows are an 8x4 grid read out by columns, which is FlashInfer's
    ``srcToDstBlk32RowMap`` as ``get_shuffle_matrix_a_row_indices`` applies it.
    """
    return torch.arange(m).view(m // SHUFFLE_ROWS, 8, 4).transpose(1, 2).reshape(m)


def w13_rows(intermediate_size: int) -> torch.Tensor:
    """The canonical ``[gate; up]`` row that each FlashInfer GEMM1 row holds.

    vLLM's ``reorder_w1w3_to_w3w1`` makes it ``[up; gate]``; FlashInfer's gated-activation reorder
    alternates the halves (``[up 0, gate 0, up 1, gate 1, ...]``) and the shuffle runs over that.
    """
    I = intermediate_size
    up, gate = I + torch.arange(I), torch.arange(I)
    interleaved = torch.stack([up, gate], dim=1).reshape(2 * I)
    return interleaved[shuffle_rows(2 * I)]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


@dataclasses.dataclass(frozen=True)
class _RowPlan:
    w13: torch.Tensor  # FlashInfer row d <- canonical row w13[d]
    w13_inverse: torch.Tensor
    w2: torch.Tensor
    w2_inverse: torch.Tensor


@functools.lru_cache(maxsize=None)
def _row_plan(hidden_size: int, intermediate_size: int) -> _RowPlan:
    w13, w2 = w13_rows(intermediate_size), shuffle_rows(hidden_size)
    return _RowPlan(w13, _inverse(w13), w2, _inverse(w2))


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(1, index.to(x.device))


# ---------------------------------------------------------------------------------------------------
# weights (steps 1, 3, 6) and scales (step 5); each pair is exactly inverse


def pack_signed_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned int4 codes ``[..., K]`` (offset 8) -> bytes ``[..., K/2]`` of two's-complement nibbles.

    ``(u - 8) & 0xF`` is ``u ^ 8`` (vLLM's ``convert_packed_uint4b8_to_signed_int4_inplace``); the
    int32 words of the checkpoint read as little-endian bytes put code 2j in the low nibble of byte j.
    """
    s = codes.to(torch.uint8) ^ 8
    return s[..., 0::2] | (s[..., 1::2] << 4)


def unpack_signed_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2) ^ 8


def to_k_blocks(x: torch.Tensor) -> torch.Tensor:
    """``[E, M, Kb]`` bytes -> ``[E, Kb/128, M, 128]``: ``convert_to_block_layout(x, 128)`` per expert."""
    E, M, Kb = x.shape
    return x.reshape(E, M, Kb // BLOCK_K_BYTES, BLOCK_K_BYTES).permute(0, 2, 1, 3).contiguous()


def from_k_blocks(x: torch.Tensor) -> torch.Tensor:
    E, nb, M, _ = x.shape
    return x.permute(0, 2, 1, 3).reshape(E, M, nb * BLOCK_K_BYTES)


def swizzle_128x4(s: torch.Tensor) -> torch.Tensor:
    """``[E, R, C]`` -> ``[E, R*C]``, entry (r, c) at ``512 (c//4) + 16 (r%32) + 4 ((r%128)//32) + c%4
    + 128 C (r//128)``: tiles of 128 rows x 4 columns, row tile major; within a tile the 32 row
    lanes, then the 4 row sub-blocks, then the 4 columns. Needs R % 128 == 0 and C % 4 == 0."""
    E, R, C = s.shape
    tiles = s.reshape(E, R // SF_TILE_ROWS, 4, 32, C // SF_TILE_COLS, SF_TILE_COLS)
    # (e, row tile, row sub-block, lane, col tile, col) -> (e, row tile, col tile, lane, row sub-block, col)
    return tiles.permute(0, 1, 4, 3, 2, 5).reshape(E, R * C)


def unswizzle_128x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    E = flat.shape[0]
    tiles = flat.reshape(E, rows // SF_TILE_ROWS, cols // SF_TILE_COLS, 32, 4, SF_TILE_COLS)
    return tiles.permute(0, 1, 4, 3, 2, 5).reshape(E, rows, cols)


# ---------------------------------------------------------------------------------------------------


@register
class FlashInferTrtllmWNA16Layout(Layout):
    name = "flashinfer-trtllm"
    version = 1
    schemes = ("wna16",)
    runtime_kernels = ()  # FlashInfer is not called by the runtime (yet)
    kernel = "flashinfer.fused_moe.trtllm_mxint4_block_scale_moe"
    # vLLM 0.33.0 pins flashinfer-python 0.7.2.post1; its helpers were checked, and 0.7.4's give the same bytes
    made_for = {"vllm": ["0.33.0"], "flashinfer": "0.7.2.post1"}

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        H, I, g = shape.hidden_size, shape.intermediate_size, scheme.group_size
        problems = []
        if scheme.bits != 4:
            problems.append(
                f"bits = {scheme.bits}: FlashInfer's TRT-LLM MxInt4 MoE kernel takes 4-bit weights only "
                "(vLLM's weight key kInt4Static32)"
            )
        if not scheme.symmetric:
            problems.append(
                "zero points (asymmetric weights): the MxInt4 kernel is symmetric only (vLLM 0.33.0 refuses "
                "FLASHINFER_TRTLLM with 'zero points and bias are not supported')"
            )
        if g != GROUP_SIZE:
            what = "channelwise" if g == -1 else f"group_size = {g}"
            problems.append(f"{what}: the MxInt4 kernel takes groups of exactly {GROUP_SIZE} along K")
        if shape.dtype != "bfloat16":
            problems.append(
                f"model dtype = {shape.dtype}: the MxInt4 kernel takes bfloat16 activations and scales, and "
                "vLLM casts the scales to the model dtype (its FlashInfer path asserts bfloat16)"
            )
        if shape.has_bias:
            problems.append(
                "expert bias: the MxInt4 kernel takes none (vLLM 0.33.0 refuses FLASHINFER_TRTLLM with "
                "'zero points and bias are not supported')"
            )
        if shape.activation not in ACTIVATIONS:
            problems.append(
                f"activation = {shape.activation}: the MxInt4 kernel runs the gated activations "
                f"{' and '.join(ACTIVATIONS)} only"
            )
        if H % 256:
            problems.append(
                f"hidden_size H = {H} must be a multiple of 256 (w13 is cut along K into blocks of 128 bytes "
                "= 256 int4 values; vLLM 0.33.0 pads nothing for this backend)"
            )
        if I % 256:
            problems.append(
                f"intermediate_size I = {I} (per TP partition) must be a multiple of 256 (w2 is cut along K "
                "into blocks of 256 int4 values; vLLM 0.33.0 pads nothing for this backend)"
            )
        # H % 256 and I % 256 cover the rest: 2I and H rows in whole 128-row tiles (row shuffle and
        # scale swizzle), and whole groups of 32 and 4-column scale tiles along K.
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
        return [
            TensorSpec("w13_weight_packed", (E, H // 256, 2 * I, BLOCK_K_BYTES), torch.uint8),
            TensorSpec("w13_weight_scale", (E, 2 * I * H // GROUP_SIZE), SCALE_DTYPE),
            TensorSpec("w2_weight_packed", (E, I // 256, H, BLOCK_K_BYTES), torch.uint8),
            TensorSpec("w2_weight_scale", (E, H * I // GROUP_SIZE), SCALE_DTYPE),
        ]

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        self.require_block_sizes(block, shape)
        H, I = shape.hidden_size, shape.intermediate_size
        rows = _row_plan(H, I)
        # The loader's copy_ casts the scales to params_dtype first; row gathers commute with it.
        return {
            "w13_weight_packed": to_k_blocks(_rows(pack_signed_nibbles(block.w13), rows.w13)),
            "w13_weight_scale": swizzle_128x4(_rows(block.w13_scale.to(SCALE_DTYPE), rows.w13)),
            "w2_weight_packed": to_k_blocks(_rows(pack_signed_nibbles(block.w2), rows.w2)),
            "w2_weight_scale": swizzle_128x4(_rows(block.w2_scale.to(SCALE_DTYPE), rows.w2)),
        }

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical block; scales stay bfloat16 (the file's dtype)."""
        H, I = shape.hidden_size, shape.intermediate_size
        rows = _row_plan(H, I)
        w13 = unpack_signed_nibbles(from_k_blocks(tensors["w13_weight_packed"]))
        w2 = unpack_signed_nibbles(from_k_blocks(tensors["w2_weight_packed"]))
        s13 = unswizzle_128x4(tensors["w13_weight_scale"], 2 * I, H // GROUP_SIZE)
        s2 = unswizzle_128x4(tensors["w2_weight_scale"], H, I // GROUP_SIZE)
        return ExpertBlock(
            scheme=scheme,
            w13=_rows(w13, rows.w13_inverse),
            w2=_rows(w2, rows.w2_inverse),
            w13_scale=_rows(s13, rows.w13_inverse),
            w2_scale=_rows(s2, rows.w2_inverse),
        )

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """The source block with its scales cast to bfloat16, as vLLM's loader casts them."""
        return dataclasses.replace(
            block, w13_scale=block.w13_scale.to(SCALE_DTYPE), w2_scale=block.w2_scale.to(SCALE_DTYPE)
        )

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        out = []
        if scheme.scale_dtype != "bfloat16":
            out.append(
                f"checkpoint scales are {scheme.scale_dtype}; they are cast to bfloat16 (round to nearest "
                "even), as vLLM's loader does for a bfloat16 model"
            )
        if shape.activation == "swigluoai":
            out.append(
                "activation swigluoai: vLLM 0.33.0 calls trtllm_mxint4_block_scale_moe without "
                "gemm1_alpha/gemm1_beta/gemm1_clamp_limit, so the kernel does not apply gpt-oss's clamped "
                "SwiGLU parameters (the weight layout is the same either way)"
            )
        return out
