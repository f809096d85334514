"""Fused MoE on the ``triton-fast`` layout (docs/layouts/triton-fast.md): one layer call, host side.

:func:`fused_moe_fast` is four launches (align, GEMM1 with the activation, GEMM2, the sum over top-k:
docs/kernels.md, "fused_moe_fast: one layer call"); this module plans them: the tile configs
(configs.py, which checks every table before the kernel sees it), the alignment (align.py, or none for one token), the
buffers that must start as zeros and split-K GEMM1's workspace, and each GEMM's launch
(:func:`launch_gemm`, which ``bench kernel --tune`` also times alone). The kernels live in align.py,
gemm.py (with dequant.py) and pdl.py; the runtime's adapter for ``triton-fast`` layers in
runtime/moeconvert_triton.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeconvert.kernels.align import PairBlocks, align, use_pair_blocks
from moeconvert.kernels.gemm import moe_gemm
from moeconvert.kernels.pdl import launch_options

INT4, INT8, MXFP4 = 0, 1, 2  # the GEMM's FMT
FORMATS = {"int4": INT4, "int8": INT8, "mxfp4": MXFP4}
_FORMAT_NAMES = {v: k for k, v in FORMATS.items()}
SILU, SWIGLUOAI, SITU = 0, 1, 2  # the GEMM's ACT
ACTIVATIONS = {"silu": SILU, "swigluoai": SWIGLUOAI, "situ": SITU}
ENV_PORTABLE = "MOECONVERT_PORTABLE_DEQUANT"  # set: the portable dequantization on GPUs too (to compare)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_ROW_BYTES = {"int4": 8, "mxfp4": 8, "int8": 16}  # bytes of a 16-row atom row per input


@dataclass(frozen=True)
class FastWeights:
    """One projection in the ``triton-fast`` layout: ``weight`` uint8, fragment-ordered ``[E, N/16, 8K]``
    (int4, MXFP4: 16 x 64 atoms) or ``[E, N/16, 16K]`` (int8: 16 x 32 atoms);
    ``scale [E, K/g, N]`` (model dtype; uint8 e8m0 for MXFP4); ``zero_point [E, K/g, N]`` uint8 or None;
    ``bias [E, N]`` or None. For w13, N = 2I: the gate rows, then the up rows."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def k(self, fmt: str) -> int:
        return self.weight.shape[2] // _ROW_BYTES[fmt]

    def n(self, fmt: str) -> int:
        return self.weight.shape[1] * 16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.zero_point, self.bias)
                   if t is not None)


def _fast(fmt: int, a: torch.Tensor) -> bool:
    """The register-level dequantization (inline PTX) runs on CUDA devices for int4 and int8 in bf16 /
    fp16 and MXFP4 in bf16; the interpreter and other cases take the portable path."""
    if a.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(ENV_PORTABLE):
        return False
    return (fmt in (INT4, INT8) and a.dtype in (torch.float16, torch.bfloat16)) or (fmt == MXFP4 and a.dtype == torch.bfloat16)


def _aligned_rows(aligned, block_m: int) -> int:
    """Rows of the sorted pair buffer the GEMM grid walks (``EM``): one block a pair for PairBlocks."""
    return aligned.ids.numel() * block_m if isinstance(aligned, PairBlocks) else aligned[0].numel()


def gemm1_tiles(cfg: dict, aligned, I: int) -> int:
    """GEMM1's (row block, column block) tiles: the counters a split-K GEMM1 needs."""
    return triton.cdiv(_aligned_rows(aligned, cfg["BLOCK_M"]), cfg["BLOCK_M"]) * triton.cdiv(I, cfg["BLOCK_N"])


def gemm1_workspace(cfg: dict, aligned, I: int, num_pairs: int, device, counters=None) -> tuple | None:
    """(fp32 partials [SPLIT_K, P, 2I], int32 tile counters) for a split-K GEMM1, else None;
    ``counters``: zeroed int32 of ``gemm1_tiles`` elements (else allocated here, zeroed)."""
    split = cfg.get("SPLIT_K", 1)
    if split == 1:
        return None
    if counters is None:
        counters = torch.zeros(gemm1_tiles(cfg, aligned, I), dtype=torch.int32, device=device)
    return torch.empty(split * num_pairs * 2 * I, dtype=torch.float32, device=device), counters


def launch_gemm(a, w: FastWeights, out, aligned, topk_weights, *, fmt: int, group: int, gated: bool, act: int,
                alpha: float, limit: float, a_row_div: int, atomic_row_div: int, num_pairs: int, cfg: dict,
                workspace: tuple | None = None, mx_fold: bool = False):
    """One GEMM launch over the aligned pairs (``fused_moe_fast`` makes two; ``bench kernel --tune`` times
    them one by one). ``aligned``: align's triple or ``PairBlocks``. ``a_row_div``: row of ``a`` = pair //
    a_row_div (GEMM1 reads token rows). ``workspace``: ``gemm1_workspace``'s, for a split-K GEMM1.
    ``mx_fold``: every MXFP4 scale exponent is <= 128 (``mx_small_scales``)."""
    pair_blocks = isinstance(aligned, PairBlocks)
    if pair_blocks:
        sorted_ids = expert_ids = ntpp = aligned.ids
        offset, E = aligned.expert_offset, aligned.num_experts
    else:
        sorted_ids, expert_ids, ntpp = aligned
        offset, E = 0, 0
    EM = _aligned_rows(aligned, cfg["BLOCK_M"])
    split = cfg.get("SPLIT_K", 1)
    if gated and split > 1 and workspace is None:
        raise ValueError("a split-K GEMM1 needs its workspace (gemm1_workspace)")
    ws, counts = workspace if gated and split > 1 else (w.scale, w.scale)
    for t in (w.scale, w.zero_point, w.bias, a, out):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"the kernel needs the last dimension contiguous, found strides {t.stride()}")
    name = _FORMAT_NAMES[fmt]
    if w.weight.stride(2) != 1 or w.weight.shape[2] % 512:
        raise ValueError(f"fragment-ordered weights need [E, N/16, {_ROW_BYTES[name]}K] rows of whole 512-byte atoms, "
                         f"found shape {tuple(w.weight.shape)} strides {w.weight.stride()}")
    stride_bk = w.weight.stride(1)
    K, Nw = w.k(name), w.n(name)
    N = Nw // 2 if gated else Nw
    z = w.zero_point if w.zero_point is not None else w.weight
    bias = w.bias if w.bias is not None else w.scale
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (triton.cdiv(EM, bm) * triton.cdiv(N, bn), split)
    moe_gemm[grid](
        a, w.weight, w.scale, z, bias, out, topk_weights if topk_weights is not None else w.scale,
        sorted_ids, expert_ids, ntpp, ws, counts,
        N, K, EM, num_pairs, Nw // 2, alpha, limit, offset, E,
        a.stride(0), w.weight.stride(0), stride_bk, w.scale.stride(0), w.scale.stride(1),
        z.stride(0) if w.zero_point is not None else 0, z.stride(1) if w.zero_point is not None else 0,
        bias.stride(0) if w.bias is not None else 0, out.stride(0),
        FMT=fmt, GROUP=group, HAS_ZP=w.zero_point is not None, HAS_BIAS=w.bias is not None,
        GATED=gated, ACT=act, MUL_ROUTED_WEIGHT=topk_weights is not None, A_ROW_DIV=a_row_div,
        ATOMIC_ROW_DIV=atomic_row_div, SPLIT_K=split, FAST=_fast(fmt, a),
        GROUP_DOTS=fmt == MXFP4 and bool(cfg.get("GROUP_DOTS", 0)), MX_FOLD=fmt == MXFP4 and mx_fold,
        PAIR_BLOCKS=pair_blocks, OPERAND_SCALE=bool(cfg.get("OPERAND_SCALE", 0)),
        compute_type=_TL_DTYPES[a.dtype], DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg.get("GROUP_M", 1),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
        **launch_options(a.device, not pair_blocks),
    )


def fused_moe_fast(x: torch.Tensor, w13: FastWeights, w2: FastWeights, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, fmt: str, group_size: int, activation: str = "silu",
                   alpha: float = 1.702, limit: float = 7.0, beta: float = 1.0, linear_beta: float | None = None,
                   expert_offset: int = 0,
                   all_ids_local: bool = True, configs: tuple[dict, dict] | None = None,
                   mx_small_scales: bool = False) -> torch.Tensor:
    """``sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x)`` for ``x [M, K]``, K = w13's (padded) K.

    ``all_ids_local``: every id is one of these E experts (no EP cut); False zero-fills the per-pair
    outputs first, so that pairs of other ranks' experts add nothing. ``group_size`` <= 0: channelwise
    scales (one group over K). ``configs``: (GEMM1, GEMM2) tile configs (same BLOCK_M), else the
    table / defaults of configs.py. ``mx_small_scales``: MXFP4 whose scales are all at most 2
    (:func:`mx_small_scales` says; the same values, one multiply a weight less). Returns
    ``[M, w2's N]`` in ``x.dtype``.
    """
    from moeconvert.kernels.configs import get_configs

    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"activations must be float16, bfloat16 or float32, not {x.dtype}")
    f = FORMATS[fmt]
    M, top_k = topk_ids.shape
    E = w13.weight.shape[0]
    K1, I, H = w13.k(fmt), w13.n(fmt) // 2, w2.n(fmt)
    if x.shape[1] != K1 or w2.k(fmt) != I:
        raise ValueError(f"x has {x.shape[1]} columns and w2 K = {w2.k(fmt)}; w13 needs K = {K1}, w2 K = I = {I}")
    g13 = K1 if group_size <= 0 else group_size
    g2 = I if group_size <= 0 else group_size
    c1, c2 = configs or get_configs(fmt, E, top_k, H=K1, I=I, M=M, group=group_size, device=x.device)
    if c1["BLOCK_M"] != c2["BLOCK_M"]:
        raise ValueError(f"the two GEMMs share one alignment: BLOCK_M {c1['BLOCK_M']} != {c2['BLOCK_M']}")
    act, P = ACTIVATIONS[activation], M * top_k
    if act == SITU:  # the GEMM's two activation scalars carry SITU's beta and linear_beta (-1: none)
        alpha, limit = float(beta), -1.0 if linear_beta is None else float(linear_beta)
    x = x.contiguous()
    if use_pair_blocks(M):
        aligned = PairBlocks(topk_ids.reshape(-1).to(torch.int32).contiguous(), E, expert_offset)
    else:
        aligned = align(topk_ids, c1["BLOCK_M"], E, expert_offset)
    # what must start as zeros, in one buffer: split-K GEMM2's fp32 output, split-K GEMM1's tile counters
    split1, split2 = c1.get("SPLIT_K", 1) > 1, c2.get("SPLIT_K", 1) > 1
    n_out = M * H if split2 else 0
    zeros = None
    if split1 or split2:
        zeros = torch.zeros(n_out + (gemm1_tiles(c1, aligned, I) if split1 else 0), dtype=torch.float32,
                            device=x.device)
    # GEMM2 reads only the rows of aligned pairs, so a's other rows may stay unwritten
    a = torch.empty(P, I, dtype=x.dtype, device=x.device)
    ws = gemm1_workspace(c1, aligned, I, P, x.device, zeros[n_out:].view(torch.int32) if split1 else None)
    launch_gemm(x, w13, a, aligned, None, fmt=f, group=g13, gated=True, act=act, alpha=alpha, limit=limit,
                a_row_div=top_k, atomic_row_div=0, num_pairs=P, cfg=c1, workspace=ws, mx_fold=mx_small_scales)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if split2:
        out = zeros[:n_out].view(M, H)
        launch_gemm(a, w2, out, aligned, weights, fmt=f, group=g2, gated=False, act=act, alpha=alpha,
                    limit=limit, a_row_div=1, atomic_row_div=top_k, num_pairs=P, cfg=c2, mx_fold=mx_small_scales)
        return out.to(x.dtype)
    # pairs of other EP ranks' experts are in no block: their rows must be zeros for the sum
    y = (torch.empty if all_ids_local else torch.zeros)(P, H, dtype=x.dtype, device=x.device)
    launch_gemm(a, w2, y, aligned, weights, fmt=f, group=g2, gated=False, act=act, alpha=alpha, limit=limit,
                a_row_div=1, atomic_row_div=0, num_pairs=P, cfg=c2, mx_fold=mx_small_scales)
    return y.view(M, top_k, H).sum(dim=1)


def mx_small_scales(*weights: FastWeights) -> bool:
    """Every e8m0 scale of these MXFP4 weights is at most 2 (exponent <= 128): ``fused_moe_fast`` may then
    fold the unpacking's 2^126 into the scale (2^(S - 1) is a normal bf16 number). Reads the scales
    back to the host: call it once per layer, outside CUDA graph capture."""
    return all(int(w.scale.max()) <= 128 for w in weights if w.scale.numel())
