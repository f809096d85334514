"""The fused-MoE GEMM of the ``triton-fast`` layout: one kernel for both GEMMs of a layer call.

A program multiplies ``BLOCK_M`` aligned pairs of one expert by ``BLOCK_N`` weight columns over one K
split; the weights (int4, int8, MXFP4 fragment atoms) always multiply swapped (``acc^T = W @ A^T``, the
weights the MMA's first operand, straight from registers: dequant.py). How a program
works, split-K, where the scales are applied and why, and the rounding: docs/kernels.md, "A GEMM
program" to "Rounding". Which compile-time flags exist and why each stays: docs/kernels.md, "The
GEMM's compile-time flags".
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeconvert.kernels.dequant import (fragment_operand, fragment_operand8, half_operand, i4_magic, i8_magic,
                                        sub_mul, unpack_fragments, unpack_int8)
from moeconvert.kernels.pdl import kernel_start
from moeconvert.kernels.tiles import grouped_program_tile


@triton.jit
def _mx_group_dot(raw_half, a_rows, a_mask, k0, K, s, acc, FAST: tl.constexpr, compute_type: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """MXFP4, one 32-input scale group (half an atom, bytes [NA * 32, 8]): acc += (W_g @ A_g^T) * s,
    ``s`` the rows' fp32 scales."""
    w = half_operand(unpack_fragments(raw_half, 2, FAST, compute_type), BLOCK_N)
    k = k0 + tl.arange(0, 32)
    a = tl.load(a_rows + k[:, None], mask=(k < K)[:, None] & a_mask[None, :], other=0.0)
    return acc + tl.dot(w, a, input_precision=DOT_PRECISION) * s[:, None]


@triton.jit
def _mx_atom(raw_atom, a_rows, a_mask, k0, K, s_pair, acc, FAST: tl.constexpr, compute_type: tl.constexpr,
             DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """MXFP4, one 64-input atom column (bytes [NA * 32, 16], scales [BLOCK_N, 2]): one dot per group."""
    R1: tl.constexpr = raw_atom.shape[0]
    h0, h1 = tl.split(tl.permute(raw_atom.reshape(R1, 2, 8), (0, 2, 1)))  # words 0, 1 / 2, 3
    s0, s1 = tl.split(s_pair)
    acc = _mx_group_dot(h0, a_rows, a_mask, k0, K, s0, acc, FAST, compute_type, DOT_PRECISION, BLOCK_N)
    return _mx_group_dot(h1, a_rows, a_mask, k0 + 32, K, s1, acc, FAST, compute_type, DOT_PRECISION, BLOCK_N)


@triton.jit
def _step_rows(base, step, last, K, offs_n, n_mask, stride_g, other, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
               SG: tl.constexpr):
    """The [BLOCK_N, SG] scale / zero-point rows of K step ``step`` (``other`` past the last group and
    from step ``last`` on). The K loop loads them one step ahead of their use: a thread's share of
    them is 1 or 2 bytes, too small for the asynchronous copies that pipeline the weight tiles, so a
    plain load issued in the same step would stall the step for a whole memory latency."""
    g = (step * BLOCK_K) // GROUP + tl.arange(0, SG)
    # the step bound compared per element (g * 0 + step): Triton 3.9's interpreter refuses a scalar
    # condition broadcast into a load mask ("mask has unsupported dtype"), and this form compiles to
    # the same SASS as the scalar one (every config of the shipped H200 table, sm_90)
    ok = n_mask[:, None] & (g < K // GROUP)[None, :] & (g * 0 + step < last)[None, :]
    return tl.load(base + g[None, :] * stride_g + offs_n[:, None], mask=ok, other=other)


@triton.jit
def _zero_points(z_tile, FMT: tl.constexpr, FAST: tl.constexpr, WIDE: tl.constexpr, compute_type: tl.constexpr,
                 SG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The step's zero points [BLOCK_N, SG] as MAGIC + z along K [BLOCK_N, BLOCK_K], for codes unpacked RAW
    (MAGIC + u): (MAGIC + u) - (MAGIC + z) = u - z, exact; fp32 where ``WIDE``. Broadcast along K before
    the subtraction: subtracted as a [BLOCK_N, 1] column, the compiler sends the operand through shared
    memory (GEMM2 at 16 x 128 x 128, sm_90)."""
    MAGIC: tl.constexpr = i8_magic(FAST, compute_type) if FMT == 1 else i4_magic(FAST, compute_type)
    z = z_tile.to(tl.float32) + MAGIC
    if not WIDE:
        z = z.to(compute_type)
    return tl.broadcast_to(z[:, :, None], (BLOCK_N, SG, BLOCK_K // SG)).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _frag_tile(a_rows, a_mask, w_ptrs, ka_rows, na_ok, s_tile, z_tile, step, K, acc, FMT: tl.constexpr,
               GROUP: tl.constexpr, HAS_ZP: tl.constexpr, FAST: tl.constexpr, POST: tl.constexpr,
               GROUP_DOTS: tl.constexpr, MX_FOLD: tl.constexpr, compute_type: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc^T [BLOCK_N, BLOCK_M] += W[n, k] @ A^T[k, m] over K step ``step``; ``s_tile`` / ``z_tile`` are
    the step's raw scale / zero-point rows [BLOCK_N, SG] (``_step_rows``). ``POST``: the scale (SG = 1)
    multiplies the fp32 product of the exact codes (zero points: u - z); MXFP4 with ``GROUP_DOTS``: one
    dot per 32-input group, its scale on the fp32 product; else the scales multiply the operand, and
    MXFP4 with ``MX_FOLD`` (every e8m0 exponent <= 128) multiplies value * 2^-126 by 2^(S - 1). Atoms:
    64 inputs (int4, MXFP4), 32 (int8)."""
    ATOM_K: tl.constexpr = 32 if FMT == 1 else 64
    KA: tl.constexpr = BLOCK_K // ATOM_K
    SG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1
    ok = na_ok & (step * KA + ka_rows < K // ATOM_K)
    raw = tl.load(w_ptrs + step * (KA * 512), mask=ok[:, None], other=0)
    if FMT == 2 and GROUP_DOTS:  # MXFP4: one dot per scale group, the scale on the fp32 product
        tl.static_assert(BLOCK_K <= 128, "GROUP_DOTS reads one or two atom columns a step")
        S = s_tile.to(tl.int32)  # [BLOCK_N, 2 KA] -> 2^(S - 127)
        s = tl.where(S == 0, 0x400000, S << 23).to(tl.float32, bitcast=True)
        k0 = step * BLOCK_K
        if KA == 1:
            acc = _mx_atom(raw, a_rows, a_mask, k0, K, s, acc, FAST, compute_type, DOT_PRECISION, BLOCK_N)
        else:  # rows (k atom, n atom, lane): the two atom columns, scales (k atom, group) likewise
            R1: tl.constexpr = (BLOCK_N // 16) * 32
            x0, x1 = tl.split(tl.permute(raw.reshape(2, R1, 16), (1, 2, 0)))
            sa, sb = tl.split(tl.permute(s.reshape(BLOCK_N, 2, 2), (0, 2, 1)))
            acc = _mx_atom(x0, a_rows, a_mask, k0, K, sa, acc, FAST, compute_type, DOT_PRECISION, BLOCK_N)
            acc = _mx_atom(x1, a_rows, a_mask, k0 + 64, K, sb, acc, FAST, compute_type, DOT_PRECISION, BLOCK_N)
        return acc
    FOLD: tl.constexpr = FMT == 2 and MX_FOLD and FAST
    if FMT == 1:
        w = fragment_operand8(unpack_int8(raw, FAST, compute_type, HAS_ZP), BLOCK_N, BLOCK_K)
    else:
        RAW: tl.constexpr = FOLD or (FMT == 0 and HAS_ZP)
        w = fragment_operand(unpack_fragments(raw, FMT, FAST, compute_type, RAW), BLOCK_N, BLOCK_K)
    k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + k[:, None], mask=(k < K)[:, None] & a_mask[None, :], other=0.0)
    WIDE: tl.constexpr = FMT == 1 and compute_type == tl.bfloat16  # int8's MAGIC + u is fp32 in bf16
    if POST:  # one group a step: the scale multiplies the step's fp32 product
        if HAS_ZP:  # u - z in the operand: an integer of at most 8 bits and a sign, exact in bf16 / fp16
            z = _zero_points(z_tile, FMT, FAST, WIDE, compute_type, SG, BLOCK_N, BLOCK_K)
            w = (w - z).to(compute_type)
        s = tl.reshape(s_tile, (BLOCK_N,)).to(tl.float32)
        acc += tl.dot(w, a, input_precision=DOT_PRECISION) * s[:, None]
    else:
        if FOLD:  # e8m0 S -> 2^(S - 1) (bf16 bits; a normal number for S <= 128), times value * 2^-126
            s = ((s_tile.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)
        elif FMT == 2:  # e8m0 S -> 2^(S - 127) (S = 0: 2^-127, a subnormal; exact in bf16 and fp32)
            S = s_tile.to(tl.int32)
            s = tl.where(S == 0, 0x400000, S << 23).to(tl.float32, bitcast=True).to(compute_type)
        else:
            s = s_tile.to(compute_type)
        s = tl.broadcast_to(s[:, :, None], (BLOCK_N, SG, BLOCK_K // SG)).reshape(BLOCK_N, BLOCK_K)
        if HAS_ZP:
            z = _zero_points(z_tile, FMT, FAST, WIDE, compute_type, SG, BLOCK_N, BLOCK_K)
            if WIDE:  # w: MAGIC + u in fp32; one rounding of the product
                w = ((w - z) * s.to(tl.float32)).to(compute_type)
            elif SG > 1:  # several groups a step: in PTX on the operand's own pairs (dequant.sub_mul)
                w = sub_mul(w, z, s, FAST, compute_type)
            else:  # one group: the compiler keeps the pairs itself (sub_mul measured 28 % more SASS here)
                w = (w - z) * s
        else:
            w = w * s
        acc = tl.dot(w, a, acc=acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def moe_gemm(
    a_ptr, b_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, ntpp_ptr, ws_ptr, tile_count_ptr,
    N, K, EM, num_pairs, up_offset, alpha, limit, expert_offset, num_experts,
    stride_am, stride_be, stride_bk, stride_se, stride_sg, stride_ze, stride_zg, stride_biase, stride_cm,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, A_ROW_DIV: tl.constexpr,
    ATOMIC_ROW_DIV: tl.constexpr, SPLIT_K: tl.constexpr, FAST: tl.constexpr,
    GROUP_DOTS: tl.constexpr, MX_FOLD: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    compute_type: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    OPERAND_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    """One program: BLOCK_M sorted pairs of one expert x BLOCK_N output columns x one K split.

    ``GATED``: GEMM1, columns n of the gate half and n + ``up_offset`` of the up half, the activation in
    the epilogue; ``N`` is then I; with ``SPLIT_K`` > 1 each split stores its fp32 partial sums in
    ``ws [SPLIT_K, num_pairs, 2N]`` and counts itself in ``tile_count`` (zeros), and the split that
    counts last adds them up (in split order) and runs the epilogue. ``ATOMIC_ROW_DIV`` > 0: split-K
    GEMM2, fp32 atomic adds into row ``pair // ATOMIC_ROW_DIV`` (the token), which also sums over
    top-k. ``PAIR_BLOCKS``: no alignment, block ``b`` is pair ``b`` alone (``sorted_ids`` are then the
    global top-k ids, ``EM`` = pairs x BLOCK_M; one token's pairs go to distinct experts). The weights
    are fragment ordered (``stride_bk``: bytes per 16-row atom row, K * 8 for 4 bits, K * 16 for int8)
    and multiply swapped, the MMA's first operand straight from registers.
    ``OPERAND_SCALE``: scales with one group a step (zero points or not) multiply the operand, not the
    step's fp32 product (each dot then chains into the accumulator and the MMA runs asynchronously with
    the next step's unpacking; what large M gains: docs/kernels.md, "The GEMM's compile-time flags")."""
    kernel_start(PDL)
    pid_m, pid_n = grouped_program_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    if PAIR_BLOCKS:
        expert = tl.load(sorted_ids_ptr + pid_m) - expert_offset
        if (expert < 0) | (expert >= num_experts):  # another EP rank's expert: its row stays as it is
            return
        expert = expert.to(tl.int64)
        offs_pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs).to(tl.int64)
    else:
        if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
            return
        offs_pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair_ok = offs_pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_rows = a_ptr + (offs_pair // A_ROW_DIV)[None, :] * stride_am
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros_like(acc)
    b_base = b_ptr + expert * stride_be
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_ze
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = min(first + per_split, steps)

    # fragment rows of a step: (k atom, n atom, lane), 16 bytes each
    NA: tl.constexpr = BLOCK_N // 16
    KA: tl.constexpr = BLOCK_K // (32 if FMT == 1 else 64)
    rows = tl.arange(0, KA * NA * 32)
    ka_rows = rows // (NA * 32)
    na = pid_n * NA + (rows // 32) % NA
    na_ok = na < N // 16
    w_rows = b_base + na.to(tl.int64) * stride_bk + ka_rows * 512 + (rows % 32) * 16
    w_ptrs = w_rows[:, None] + tl.arange(0, 16)[None, :]
    up_ptrs = w_ptrs + (up_offset // 16) * stride_bk
    # WNA16 with one scale group a step: the scale multiplies the step's fp32 product (unless OPERAND_SCALE:
    # then the product chains into the accumulator and the MMA runs asynchronously)
    POST: tl.constexpr = FMT != 2 and GROUP % BLOCK_K == 0 and not OPERAND_SCALE
    SG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1
    S_OTHER: tl.constexpr = 127 if FMT == 2 else 0  # e8m0 127 = 1.0 past the last group
    Z_OTHER: tl.constexpr = 128 if FMT == 1 else 8
    s_up_base = s_base + up_offset
    z_up_base = z_base + up_offset
    # the scale (and zero-point) rows of the next step, gate and up
    s1 = _step_rows(s_base, first, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K, SG)
    su1, z1, zu1 = s1, s1, s1  # placeholders where unused
    if GATED:
        su1 = _step_rows(s_up_base, first, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K, SG)
    if HAS_ZP:
        z1 = _step_rows(z_base, first, last, K, offs_n, n_mask, stride_zg, Z_OTHER, GROUP, BLOCK_K, SG)
        if GATED:
            zu1 = _step_rows(z_up_base, first, last, K, offs_n, n_mask, stride_zg, Z_OTHER, GROUP, BLOCK_K, SG)
    for step in range(first, last):
        s_cur = s1
        s1 = _step_rows(s_base, step + 1, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K, SG)
        z_cur = z1
        if HAS_ZP:
            z1 = _step_rows(z_base, step + 1, last, K, offs_n, n_mask, stride_zg, Z_OTHER, GROUP, BLOCK_K, SG)
        acc = _frag_tile(a_rows, pair_ok, w_ptrs, ka_rows, na_ok, s_cur, z_cur, step, K, acc, FMT, GROUP,
                         HAS_ZP, FAST, POST, GROUP_DOTS, MX_FOLD, compute_type, DOT_PRECISION, BLOCK_N, BLOCK_K)
        if GATED:
            su_cur = su1
            su1 = _step_rows(s_up_base, step + 1, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K,
                             SG)
            zu_cur = zu1
            if HAS_ZP:
                zu1 = _step_rows(z_up_base, step + 1, last, K, offs_n, n_mask, stride_zg, Z_OTHER, GROUP, BLOCK_K, SG)
            acc_up = _frag_tile(a_rows, pair_ok, up_ptrs, ka_rows, na_ok, su_cur, zu_cur, step, K, acc_up, FMT,
                                GROUP, HAS_ZP, FAST, POST, GROUP_DOTS, MX_FOLD, compute_type, DOT_PRECISION,
                                BLOCK_N, BLOCK_K)
    # back to [BLOCK_M, BLOCK_N] for the epilogue (one layout change a program)
    acc = tl.trans(acc)
    if GATED:
        acc_up = tl.trans(acc_up)

    if GATED and SPLIT_K > 1:  # GEMM1 split over K: the last split to finish sums the partials
        ws_rows = ws_ptr + (pid_k * num_pairs + offs_pair)[:, None] * (2 * N) + offs_n[None, :]
        part_mask = pair_ok[:, None] & n_mask[None, :]
        tl.store(ws_rows, acc, mask=part_mask)
        tl.store(ws_rows + N, acc_up, mask=part_mask)
        tl.debug_barrier()  # every thread's partials before the count (which releases them)
        if tl.atomic_add(tile_count_ptr + tl.program_id(0), 1, sem="acq_rel") != SPLIT_K - 1:
            return
        acc = tl.zeros_like(acc)
        acc_up = tl.zeros_like(acc_up)
        for split in tl.static_range(SPLIT_K):  # in split order, whichever finished last: deterministic
            rows = ws_ptr + (split * num_pairs + offs_pair)[:, None] * (2 * N) + offs_n[None, :]
            acc += tl.load(rows, mask=part_mask, other=0.0, cache_modifier=".cg")
            acc_up += tl.load(rows + N, mask=part_mask, other=0.0, cache_modifier=".cg")

    if HAS_BIAS:
        bias_base = bias_ptr + expert * stride_biase
        # GEMM1 reaches here once a tile, GEMM2's splits each add theirs: only split 0 adds the bias (the
        # split compared per element, as in _step_rows)
        bias_mask = n_mask & ((offs_n * 0 + pid_k == 0) | GATED)
        acc += tl.load(bias_base + offs_n, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_base + up_offset + offs_n, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACT == 1:  # gpt-oss: clamp, then (up + 1) * gate * sigmoid(alpha * gate)
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        elif ACT == 2:  # Kimi-K3's SITU (vLLM's SituAndMul): alpha is beta, limit linear_beta (<= 0: unset)
            # beta * tanh(gate / beta) * sigmoid(gate) * up', up' = linear_beta * tanh(up / linear_beta) or up;
            # tanh(t) = 1 - 2 / (exp(2t) + 1), which saturates to +-1 where exp overflows or vanishes
            gate = alpha * (1.0 - 2.0 / (tl.exp(2.0 * acc / alpha) + 1.0)) / (1.0 + tl.exp(-acc))
            clipped = limit * (1.0 - 2.0 / (tl.exp(2.0 * acc_up / limit) + 1.0))
            acc = gate * tl.where(acc_up * 0.0 + limit > 0.0, clipped, acc_up)
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + offs_pair, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    out_mask = pair_ok[:, None] & n_mask[None, :]
    if ATOMIC_ROW_DIV > 0:
        c_ptrs = c_ptr + (offs_pair // ATOMIC_ROW_DIV)[:, None] * stride_cm + offs_n[None, :]
        tl.atomic_add(c_ptrs, acc, mask=out_mask, sem="relaxed")
    else:
        c_ptrs = c_ptr + offs_pair[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=out_mask)
