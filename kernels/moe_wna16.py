"""Fused MoE for WNA16 experts in the ``triton`` layout (docs/layouts/triton.md), dequantized in registers.

One call is::

    align     = moe_align_block_size(topk_ids, BLOCK_M, E, expert_offset)      # torch (align.py)
    gate_up   = GEMM1(x, w13)         [M*k, 2I]  x.dtype, + w13_bias            # one Triton launch
    a         = act(gate, up)         [M*k, I]   fp32 in torch, cast to x.dtype
    y         = GEMM2(a, w2) * w      [M*k, H]   fp32, + w2_bias, x topk weight # one Triton launch
    out       = y.view(M, k, H).sum(1).to(x.dtype)                              # torch

Both GEMMs are :func:`_wna16_moe_gemm`, the shape of vLLM 0.33.0's ``fused_moe_kernel_gptq_awq``: a
program owns ``BLOCK_M`` sorted (token, slot) pairs of one expert and ``BLOCK_N`` output channels,
loads the weight bytes ``[BLOCK_K, BLOCK_N]`` of that expert (byte ``k // (8 / bits)`` of row n, code
at bit ``(k % (8 / bits)) * bits``), subtracts the zero point (row ``n // (8 / bits)`` of the
zero-point tensor, same shift along n) or ``2^(bits-1)``, multiplies by the group scale, casts to the
activation dtype and accumulates ``tl.dot`` in fp32. Pairs whose expert belongs to another EP rank are
not in the sorted list (align.py), so their rows of ``y`` stay zero.

Rounding (what the test tolerance covers): the dequantized weight is rounded to the activation dtype
before the dot, GEMM1's output and the activation are stored in the activation dtype (as vLLM does);
GEMM2's output and the sum over top-k stay fp32 and are cast once. fp32 activations use IEEE fp32
dots (no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeconvert.kernels.align import moe_align_block_size
from moeconvert.kernels.configs import get_config
from moeconvert.kernels.tiles import grouped_program_tile


@triton.jit
def _wna16_moe_gemm(
    a_ptr, b_ptr, c_ptr, scale_ptr, zp_ptr, bias_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, EM, num_valid_tokens,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    stride_se, stride_sn, stride_sk,
    stride_ze, stride_zn, stride_zk,
    stride_biase, stride_biasn,
    group_size: tl.constexpr, BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, top_k: tl.constexpr, compute_type: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_program_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)

    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_token_id = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    PER_BYTE: tl.constexpr = 8 // BITS
    CODE_MASK: tl.constexpr = (1 << BITS) - 1

    a_rows = a_ptr + (offs_token // top_k)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    s_cols = scale_ptr + expert * stride_se + offs_n[None, :] * stride_sn
    if HAS_ZP:
        z_cols = zp_ptr + expert * stride_ze + (offs_n // PER_BYTE)[None, :] * stride_zn
        z_shift = ((offs_n % PER_BYTE) * BITS)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kk = kb * BLOCK_K + offs_k
        k_mask = kk < K
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        bk_mask = k_mask[:, None] & n_mask[None, :]
        byte = tl.load(b_cols + (kk // PER_BYTE)[:, None] * stride_bk, mask=bk_mask, other=0).to(tl.int32)
        code = (byte >> ((kk % PER_BYTE) * BITS)[:, None]) & CODE_MASK
        if group_size % BLOCK_K == 0:
            # one scale (and zero point) row per k block: [1, BLOCK_N]
            g = (kb * BLOCK_K) // group_size
            scale = tl.load(s_cols + g * stride_sk, mask=n_mask[None, :], other=0.0).to(tl.float32)
            if HAS_ZP:
                zp = (tl.load(z_cols + g * stride_zk, mask=n_mask[None, :], other=0).to(tl.int32) >> z_shift) & CODE_MASK
        else:
            g = (kk // group_size)[:, None]
            scale = tl.load(s_cols + g * stride_sk, mask=bk_mask, other=0.0).to(tl.float32)
            if HAS_ZP:
                zp = (tl.load(z_cols + g * stride_zk, mask=bk_mask, other=0).to(tl.int32) >> z_shift) & CODE_MASK
        if HAS_ZP:
            w = (code - zp).to(tl.float32) * scale
        else:
            w = (code - (1 << (BITS - 1))).to(tl.float32) * scale
        acc = tl.dot(a, w.to(compute_type), acc=acc, input_precision=DOT_PRECISION)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_biase + offs_n * stride_biasn, mask=n_mask, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        wt = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & n_mask[None, :])


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True)
class WNA16Weights:
    """One expert projection in the ``triton`` layout: ``qweight [E, N, K*bits/8]`` uint8 (K-packed bytes,
    the checkpoint's little-endian int32 words), ``scale [E, N, G]``, ``zero_point [E, N*bits/8, G]``
    uint8 or None (symmetric), ``bias [E, N]`` or None."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def _gemm(a: torch.Tensor, w: WNA16Weights, out: torch.Tensor, align, topk_weights: torch.Tensor | None,
          *, bits: int, group_size: int, top_k: int, num_pairs: int, cfg: dict) -> None:
    E, N, kbytes = w.qweight.shape
    K = kbytes * 8 // bits
    if a.shape[1] != K:
        raise ValueError(f"activation has {a.shape[1]} columns, the weights {K}")
    g = K if group_size <= 0 else group_size  # channelwise: one group spanning K
    zp = w.zero_point if w.zero_point is not None else w.scale  # unused pointer when HAS_ZP is False
    bias = w.bias if w.bias is not None else w.scale
    zs = zp.stride() if w.zero_point is not None else (0, 0, 0)
    bs = bias.stride() if w.bias is not None else (0, 0)
    sorted_ids, expert_ids, ntpp = align
    EM = sorted_ids.numel()
    BM, BN = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
    grid = (triton.cdiv(EM, BM) * triton.cdiv(N, BN),)
    _wna16_moe_gemm[grid](
        a, w.qweight, out, w.scale, zp, bias, topk_weights if topk_weights is not None else w.scale,
        sorted_ids, expert_ids, ntpp,
        N, K, EM, num_pairs,
        a.stride(0), a.stride(1),
        *w.qweight.stride(),
        out.stride(0), out.stride(1),
        *w.scale.stride(),
        *zs,
        *bs,
        group_size=g, BITS=bits, HAS_ZP=w.zero_point is not None, HAS_BIAS=w.bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None, top_k=top_k, compute_type=_TL_DTYPES[a.dtype],
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=cfg["BLOCK_SIZE_K"], GROUP_M=cfg["GROUP_SIZE_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def fused_moe_wna16(x: torch.Tensor, w13: WNA16Weights, w2: WNA16Weights, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, act, *, bits: int, group_size: int, expert_offset: int = 0,
                    w13_rows: str = "gate_up", config: dict | None = None) -> torch.Tensor:
    """``sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x)`` for ``x [M, K]`` fp16/bf16/fp32.

    ``topk_ids`` are global ids; ``expert_offset`` is the first local expert's global id (EP).
    ``act(gate, up)`` takes fp32 halves; ``w13_rows`` ``"interleaved"`` means gate/up rows alternate.
    ``config`` overrides the default tile config (configs.py). Returns ``[M, w2 N]`` in ``x.dtype``.
    """
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"activations must be float16, bfloat16 or float32, not {x.dtype}")
    M, k = topk_ids.shape
    E, N1 = w13.qweight.shape[:2]
    H = w2.qweight.shape[1]
    cfg = config or get_config(M, E, k)
    x = x.contiguous()
    align = moe_align_block_size(topk_ids, cfg["BLOCK_SIZE_M"], E, expert_offset)
    P = M * k
    # rows of pairs that no block covers (other ranks' experts) are never read: empty is enough here
    gate_up = torch.empty(P, N1, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, align, None, bits=bits, group_size=group_size, top_k=k, num_pairs=P, cfg=cfg)
    h = gate_up.float()
    gate, up = (h[:, 0::2], h[:, 1::2]) if w13_rows == "interleaved" else h.chunk(2, dim=1)
    a = act(gate, up).to(x.dtype).contiguous()
    y = torch.zeros(P, H, dtype=torch.float32, device=x.device)  # other ranks' pairs stay zero
    _gemm(a, w2, y, align, topk_weights.reshape(-1).float().contiguous(), bits=bits, group_size=group_size,
          top_k=1, num_pairs=P, cfg=cfg)
    return y.view(M, k, H).sum(dim=1).to(x.dtype)
