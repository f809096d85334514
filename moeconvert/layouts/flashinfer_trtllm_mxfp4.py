"""``flashinfer-trtllm`` for MXFP4: experts as FlashInfer's TRT-LLM MoE kernel reads them (docs/layouts/flashinfer-mxfp4.md).

The bytes equal what vLLM 0.33.0 holds after ``convert_weight_to_mxfp4_moe_kernel_format`` (and, for
gpt-oss, ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``, which ends in the same bytes) for
backend FLASHINFER_TRTLLM_MXFP4_BF16: ``flashinfer.trtllm_fp4_block_scale_moe``, Blackwell (SM100
family) only. vLLM's *online* MXFP4 path cannot reach this backend (it asserts
``_cache_permute_indices is not None``, spec §4.3); these are the bytes its checkpoint path
(``Mxfp4MoEMethod``, ``GptOssMxfp4MoEMethod``) holds, which is what the kernel reads. The WNA16 layout
of the same backend name is flashinfer_trtllm.py, whose row shuffle and 128x4 swizzle this one reuses.

The canonical block is already padded (H, I per TP rank rounded up to ``pad_multiples``, zeros with
scale byte 0) and its w13 rows are ``[gate (Ip); up (Ip)]`` for every activation. vLLM holds gpt-oss's
rows interleaved (2j = gate j, 2j+1 = up j) before conversion, but its conversion ends in the same
kernel order as for a ``[gate; up]`` checkpoint, so nothing here depends on the activation.

=================  ==================================================
tensor             contents
=================  ==================================================
w13_weight         u8 ``[E, 2Ip, Hp/2]``, row d = canonical row ``w13_rows(Ip)[d]`` (up/gate pairs, shuffled)
w13_weight_scale   float8_e4m3fn ``[E, 2Ip, Hp/32]`` holding e8m0 bytes, rows as the weights, 128x4 swizzled
w2_weight          u8 ``[E, Hp, Ip/2]``, rows shuffled
w2_weight_scale    float8_e4m3fn ``[E, Hp, Ip/32]``, 128x4 swizzled
w13_bias, w2_bias  fp32 ``[E, 2Ip]``, ``[E, Hp]``, rows as the weights
=================  ==================================================

Every transform is a row gather of a whole chunk of experts; row orders are planned once per size.
docs/layouts/flashinfer-mxfp4.md describes this layout and ``flashinfer-cutlass``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import Layout, TensorSpec
from moeconvert.layouts.flashinfer_common import MADE_FOR, MXFP4_BLOCK, check_block, common_problems, scale_bytes
from moeconvert.layouts.flashinfer_trtllm import shuffle_rows, swizzle_128x4, unswizzle_128x4
from moeconvert.schemes import MXFP4Scheme, Scheme

# ---------------------------------------------------------------------------------------------------
# TRT-LLM row orders (spec §6.6)


def trtllm_w13_rows(intermediate_size: int) -> torch.Tensor:
    """The canonical ``[gate; up]`` row each TRT-LLM GEMM1 row holds.

    vLLM interleaves the halves up first (``[w3_0, w1_0, w3_1, w1_1, ...]``; gpt-oss: it swaps each
    adjacent gate/up pair, with the same result), then ``get_w2_permute_indices_with_cache`` (no gated
    reorder: the rows are already paired) shuffles rows in blocks of 32 for ``epilogue_tile_m = 128``.
    """
    Ip = intermediate_size
    up, gate = Ip + torch.arange(Ip), torch.arange(Ip)
    return torch.stack([up, gate], dim=1).reshape(2 * Ip)[shuffle_rows(2 * Ip)]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


@dataclasses.dataclass(frozen=True)
class _RowPlan:
    w13: torch.Tensor  # TRT-LLM row d <- canonical row w13[d]
    w13_inverse: torch.Tensor
    w2: torch.Tensor
    w2_inverse: torch.Tensor


@functools.lru_cache(maxsize=None)
def _row_plan(hidden_size: int, intermediate_size: int) -> _RowPlan:
    w13, w2 = trtllm_w13_rows(intermediate_size), shuffle_rows(hidden_size)
    return _RowPlan(w13, _inverse(w13), w2, _inverse(w2))


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(1, index.to(x.device))



@register
class FlashInferTrtllmMXFP4Layout(Layout):
    name = "flashinfer-trtllm"
    version = 1
    schemes = ("mxfp4",)
    runtime_kernels = ()  # FlashInfer is not called by the runtime (yet)
    kernel = "flashinfer.fused_moe.trtllm_fp4_block_scale_moe (MXFP4 weights, bf16 activations)"
    made_for = MADE_FOR
    pad_multiples = (256, 128)  # mxfp4_round_up_hidden_size_and_intermediate_size, TRTLLM_BACKENDS

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, MXFP4Scheme)
        Hp, Ip = shape.hidden_size, shape.intermediate_size
        problems = common_problems("FlashInfer TRT-LLM", shape, self.pad_multiples)
        # FlashInfer's row shuffle asserts (get_shuffle_matrix_a/sf_a_row_indices) and vLLM's reshape of
        # the swizzled scales back to [rows, K/32], which needs no column padding in the 128x4 swizzle
        for gemm, n, k in (("w13", 2 * Ip, Hp), ("w2", Hp, Ip)):
            if n % 32:
                problems.append(f"{gemm}_weight: rows = {n} must be divisible by 32 (row shuffle for "
                                "epilogue_tile_m = 128)")
            if n % 128:
                problems.append(f"{gemm}_weight_scale: rows = {n} must be divisible by 128 (scale row shuffle "
                                "and 128x4 swizzle)")
            if k % MXFP4_BLOCK == 0 and (k // MXFP4_BLOCK) % 4:
                problems.append(f"{gemm}_weight_scale: K/32 = {k // MXFP4_BLOCK} must be divisible by 4 "
                                "(128x4 swizzle without column padding)")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, Hp, Ip = shape.num_experts, shape.hidden_size, shape.intermediate_size
        specs = [
            TensorSpec("w13_weight", (E, 2 * Ip, Hp // 2), torch.uint8),
            TensorSpec("w13_weight_scale", (E, 2 * Ip, Hp // MXFP4_BLOCK), torch.float8_e4m3fn),
            TensorSpec("w2_weight", (E, Hp, Ip // 2), torch.uint8),
            TensorSpec("w2_weight_scale", (E, Hp, Ip // MXFP4_BLOCK), torch.float8_e4m3fn),
        ]
        if shape.has_bias:
            specs += [TensorSpec("w13_bias", (E, 2 * Ip), torch.float32), TensorSpec("w2_bias", (E, Hp), torch.float32)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        check_block(block, shape)
        Hp, Ip = shape.hidden_size, shape.intermediate_size
        rows = _row_plan(Hp, Ip)

        def scales(s: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            # e8m0 bytes, re-typed (not converted) to float8_e4m3fn as vLLM does
            return swizzle_128x4(_rows(scale_bytes(s), index)).reshape(s.shape).view(torch.float8_e4m3fn)

        out = {
            "w13_weight": _rows(block.w13, rows.w13),
            "w13_weight_scale": scales(block.w13_scale, rows.w13),
            "w2_weight": _rows(block.w2, rows.w2),
            "w2_weight_scale": scales(block.w2_scale, rows.w2),
        }
        if block.w13_bias is not None:
            out["w13_bias"] = _rows(block.w13_bias.to(torch.float32), rows.w13)
            out["w2_bias"] = _rows(block.w2_bias.to(torch.float32), rows.w2)
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical (padded) block; scales as e8m0 bytes (uint8), biases float32."""
        Hp, Ip = shape.hidden_size, shape.intermediate_size
        rows = _row_plan(Hp, Ip)
        s13 = unswizzle_128x4(scale_bytes(tensors["w13_weight_scale"]), 2 * Ip, Hp // MXFP4_BLOCK)
        s2 = unswizzle_128x4(scale_bytes(tensors["w2_weight_scale"]), Hp, Ip // MXFP4_BLOCK)
        kw = {}
        if "w13_bias" in tensors:
            kw = {"w13_bias": _rows(tensors["w13_bias"], rows.w13_inverse),
                  "w2_bias": _rows(tensors["w2_bias"], rows.w2_inverse)}
        return ExpertBlock(
            scheme=scheme,
            w13=_rows(tensors["w13_weight"], rows.w13_inverse),
            w13_scale=_rows(s13, rows.w13_inverse),
            w2=_rows(tensors["w2_weight"], rows.w2_inverse),
            w2_scale=_rows(s2, rows.w2_inverse),
            **kw,
        )

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """The block with its biases in float32, as vLLM casts them (exact from bf16/fp16)."""
        if block.w13_bias is None:
            return block
        return dataclasses.replace(block, w13_bias=block.w13_bias.to(torch.float32),
                                   w2_bias=block.w2_bias.to(torch.float32))

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        return {"w13_rows": "up, gate pairs, shuffled", "epilogue_tile_m": 128, "scale_layout": "swizzled_128x4",
                "scale_bytes": "e8m0 (stored as float8_e4m3fn)", "compute_capability": "10.x"}

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        return [
            "flashinfer-trtllm MXFP4 runs on Blackwell (SM100 family) only. vLLM 0.33.0's online MXFP4 path "
            "cannot convert to it (it asserts _cache_permute_indices); this file holds what vLLM's MXFP4 "
            "checkpoint path holds for FLASHINFER_TRTLLM_MXFP4_BF16"
        ]
