"""Fused MoE on the ``triton-fast`` layout (docs/layouts/triton-fast.md): int4 / int8 / MXFP4 weights,
bf16 / fp16 / fp32 activations, dequantized in registers.

One call is four launches::

    align   sorted pairs by expert, BLOCK_M-aligned          one Triton program (_align_kernel)
    GEMM1   a = act(x @ w13_gate, x @ w13_up)   [M*k, I]     gate and up tiles of the same columns in one
                                                             program, bias, SiLU-and-mul or gpt-oss'
                                                             clamped swiglu in the epilogue
    GEMM2   y = (a @ w2 + b2) * topk_weight     [M*k, H]     stored in the activation dtype, or (split-K)
                                                             atomically added in fp32 into out[M, H]
    sum     out = y.view(M, k, H).sum(1)                     torch (split-K: the fp32 out cast once)

4-bit weights (int4, MXFP4) are stored in MMA fragment order (``[E, N/16, 8K]``, see
moeconvert/layouts/triton_fast.py): each thread loads, with one 16-byte load per 16 x 64 atom, the 32
codes of its share of the MMA's first operand, and the GEMM runs swapped (``acc^T = W @ A^T``: the
weights are the MMA's M side, straight from registers, the tokens its N side, as narrow as 16), so
unpacking is a few ALU instructions per 32-bit word and no shuffle or shared-memory round trip.
int8 weights stay ``[E, K, N]`` rows, dequantized in fp32 (both operand orders).

Rounding: symmetric int4 with one scale group per K step and MXFP4 with GROUP_DOTS multiply the
exact codes (q - 8, the e2m1 value) and apply the scale to the fp32 product; otherwise the weight
(q - z) * s is rounded once to the activation dtype before the dot. Dots accumulate in fp32 (IEEE
for fp32 activations); GEMM1's bias and activation run in fp32 on the fp32 accumulators, and the
activation is stored in the activation dtype (as vLLM stores its GEMM1 output); GEMM2's bias and
top-k weight are applied in fp32, each pair's output rounded to the activation dtype before the sum
over top-k (vLLM's ``moe_sum`` path too), or kept in fp32 with split-K.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeconvert.kernels.align import max_padded_tokens
from moeconvert.kernels.tiles import grouped_program_tile

try:  # programmatic dependent launch (Hopper on): the next kernel is scheduled while this one runs
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: kernels are launched one after the other
    gdc_launch_dependents = gdc_wait = None

INT4, INT8, MXFP4 = 0, 1, 2
FORMATS = {"int4": INT4, "int8": INT8, "mxfp4": MXFP4}
_FORMAT_NAMES = {v: k for k, v in FORMATS.items()}
SILU, SWIGLUOAI = 0, 1
ACTIVATIONS = {"silu": SILU, "swigluoai": SWIGLUOAI}
ENV_PORTABLE = "MOECONVERT_PORTABLE_DEQUANT"  # set: the portable dequantization on GPUs too (to compare)
ENV_NO_PDL = "MOECONVERT_NO_PDL"  # set: no programmatic dependent launch (to compare)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _kernel_start(PDL: tl.constexpr):
    """With programmatic dependent launch (``PDL``), every kernel of a layer call first lets the next
    one be scheduled, then waits until the one before has finished and its writes are visible. So the
    next kernel's programs start while this one's last wave runs, and no kernel touches memory before
    its predecessor is done (each one waits, so the order of all writes and reads stays the stream's)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _pdl(device: torch.device, wanted: bool = True) -> dict:
    """The launch option: programmatic dependent launch on CUDA devices of compute capability 9 on
    (not under the interpreter, not with ``MOECONVERT_NO_PDL`` set). Measured side by side on the H200
    (shipped table): 1-3 % faster layers at M = 16-256 (Qwen3-30B-A3B, gpt-oss), but 7 and 12 %
    slower at M = 1, where the GEMMs' few programs are latency-bound; so one token's GEMMs (pair
    blocks) launch without it."""
    on = (wanted and device.type == "cuda" and gdc_wait is not None and os.environ.get("TRITON_INTERPRET") != "1"
          and not os.environ.get(ENV_NO_PDL) and _capability(device.index or 0) >= 9)
    return {"PDL": on, "launch_pdl": on}


# ---------------------------------------------------------------------------------------------------
# alignment: Triton, no host synchronisation (one program for small batches, three kernels above)


@triton.jit
def _local_ids(ids_ptr, offs, P, E, offset):
    """(local expert ids, mask of the pairs whose expert is one of this rank's E) at pair indices offs."""
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1) - offset
    return ids, (offs < P) & (ids >= 0) & (ids < E)


@triton.jit
def _padded_runs(counts, BLOCK_M: tl.constexpr):
    """(each expert's run padded to BLOCK_M, the end of each run in the sorted buffer)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return padded, tl.cumsum(padded, 0)


@triton.jit
def _store_block_experts(expert_ids_ptr, end, e_ok, E, max_padded, BLOCK_M: tl.constexpr, BCHUNK: tl.constexpr):
    """The expert of every BLOCK_M block of the sorted buffer (-1 past the used blocks)."""
    num_blocks = max_padded // BLOCK_M
    for c in range(0, tl.cdiv(num_blocks, BCHUNK)):
        b = c * BCHUNK + tl.arange(0, BCHUNK)
        # searchsorted(end, b * BLOCK_M, right=True): experts whose padded run ends at or before the block
        before = (end[None, :] <= (b * BLOCK_M)[:, None]) & e_ok[None, :]
        e = tl.sum(before.to(tl.int32), 1)
        tl.store(expert_ids_ptr + b, tl.where(e < E, e, -1), mask=b < num_blocks)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr, cursor_ptr, P, E, offset, max_padded,
                  BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr, BCHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    """``moe_align_block_size`` (align.py has the contract) in one program: count pairs per local expert
    with atomics, pad the counts to BLOCK_M, prefix-sum them, fill the sentinels, write the expert of
    every block, and scatter each pair to its expert's next free slot (the order of the pairs inside
    one expert's run is not fixed; every output row depends on its own pair only)."""
    _kernel_start(PDL)
    e_offs = tl.arange(0, E_P2)
    e_ok = e_offs < E
    tl.store(cursor_ptr + e_offs, tl.zeros((E_P2,), tl.int32), mask=e_ok)
    tl.debug_barrier()
    for c in range(0, tl.cdiv(P, CHUNK)):
        ids, ok = _local_ids(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), P, E, offset)
        tl.atomic_add(cursor_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")
    tl.debug_barrier()
    counts = tl.load(cursor_ptr + e_offs, mask=e_ok, other=0, cache_modifier=".cg")  # atomics live in L2
    padded, end = _padded_runs(counts, BLOCK_M)
    tl.store(ntpp_ptr, tl.sum(padded, 0))
    tl.debug_barrier()
    tl.store(cursor_ptr + e_offs, end - padded, mask=e_ok)
    for c in range(0, tl.cdiv(max_padded, CHUNK)):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.full((CHUNK,), 0, tl.int32) + P, mask=offs < max_padded)
    _store_block_experts(expert_ids_ptr, end, e_ok, E, max_padded, BLOCK_M, BCHUNK)
    tl.debug_barrier()
    for c in range(0, tl.cdiv(P, CHUNK)):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ids, ok = _local_ids(ids_ptr, offs, P, E, offset)
        slot = tl.atomic_add(cursor_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")
        tl.store(sorted_ptr + slot, offs, mask=ok)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, P, E, offset, CHUNK: tl.constexpr, PDL: tl.constexpr):
    _kernel_start(PDL)
    ids, ok = _local_ids(ids_ptr, tl.program_id(0) * CHUNK + tl.arange(0, CHUNK), P, E, offset)
    tl.atomic_add(counts_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")


@triton.jit
def _align_offsets_kernel(counts_ptr, cursor_ptr, expert_ids_ptr, ntpp_ptr, E, max_padded,
                          BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BCHUNK: tl.constexpr, PDL: tl.constexpr):
    _kernel_start(PDL)
    e_offs = tl.arange(0, E_P2)
    e_ok = e_offs < E
    padded, end = _padded_runs(tl.load(counts_ptr + e_offs, mask=e_ok, other=0), BLOCK_M)
    tl.store(ntpp_ptr, tl.sum(padded, 0))
    tl.store(cursor_ptr + e_offs, end - padded, mask=e_ok)
    _store_block_experts(expert_ids_ptr, end, e_ok, E, max_padded, BLOCK_M, BCHUNK)


@triton.jit
def _align_scatter_kernel(ids_ptr, sorted_ptr, cursor_ptr, P, E, offset, CHUNK: tl.constexpr, PDL: tl.constexpr):
    _kernel_start(PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids, ok = _local_ids(ids_ptr, offs, P, E, offset)
    slot = tl.atomic_add(cursor_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")
    tl.store(sorted_ptr + slot, offs, mask=ok)


#: up to this many pairs one program aligns them (one launch); above, count / offsets / scatter
#: kernels over the pairs (H200, per call: 3.4 / 7.7 / 13.9 µs one program and 6.3 / 11.4 / 12.6 µs
#: the three kernels for 8 / 512 / 2048 pairs over 128 experts)
ALIGN_ONE_PROGRAM_MAX = 1024


def align(topk_ids: torch.Tensor, block_m: int, num_experts: int, expert_offset: int = 0):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as align.moe_align_block_size gives them,
    from Triton launches (pairs inside one expert's run in no fixed order)."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    P, E = ids.numel(), num_experts
    max_padded = max_padded_tokens(P, E, block_m)
    dev = ids.device
    pdl = _pdl(dev)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    e_p2 = max(16, triton.next_power_of_2(E))
    bchunk = max(1, 8192 // e_p2)
    if P <= ALIGN_ONE_PROGRAM_MAX:
        sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
        cursor = torch.empty(e_p2, dtype=torch.int32, device=dev)
        _align_kernel[(1,)](ids, sorted_ids, expert_ids, ntpp, cursor, P, E, expert_offset, max_padded,
                            BLOCK_M=block_m, E_P2=e_p2, CHUNK=256, BCHUNK=bchunk, num_warps=4, **pdl)
        return sorted_ids, expert_ids, ntpp
    sorted_ids = torch.full((max_padded,), P, dtype=torch.int32, device=dev)
    counts = torch.zeros(e_p2, dtype=torch.int32, device=dev)
    cursor = torch.empty(e_p2, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(P, 1024),)
    _align_count_kernel[grid](ids, counts, P, E, expert_offset, CHUNK=1024, num_warps=4, **pdl)
    _align_offsets_kernel[(1,)](counts, cursor, expert_ids, ntpp, E, max_padded, BLOCK_M=block_m, E_P2=e_p2,
                                BCHUNK=bchunk, num_warps=4, **pdl)
    _align_scatter_kernel[grid](ids, sorted_ids, cursor, P, E, expert_offset, CHUNK=1024, num_warps=4, **pdl)
    return sorted_ids, expert_ids, ntpp


# ---------------------------------------------------------------------------------------------------
# the GEMM


@triton.jit
def _int8_tile(a_rows, a_mask, b_base, s_base, z_base, kr, kr_mask, offs_n, n_mask, g_row, stride_bk, stride_bn,
               stride_sg, stride_zg, acc, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr,
               SWAP: tl.constexpr, compute_type: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """int8 (``[E, K, N]`` bytes): acc += A[:, k] @ W[k, n] over one K step (``SWAP``: acc^T += W^T @ A^T,
    the weights the MMA's first operand and the tokens its second). ``kr`` are the step's K rows,
    ``g_row`` its first scale group."""
    bmask = kr_mask[:, None] & n_mask[None, :]
    raw = tl.load(b_base + kr[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=bmask, other=0)
    if GROUP % BLOCK_K == 0:  # the step lies in one group: one [1, BLOCK_N] row
        s = tl.load(s_base + g_row * stride_sg + offs_n[None, :], mask=n_mask[None, :], other=0.0)
        if HAS_ZP:
            z = tl.load(z_base + g_row * stride_zg + offs_n[None, :], mask=n_mask[None, :], other=0)
    else:  # several groups in the step: a scale per element (repeats come from L1)
        g = (kr // GROUP)[:, None]
        s = tl.load(s_base + g * stride_sg + offs_n[None, :], mask=bmask, other=0.0)
        if HAS_ZP:
            z = tl.load(z_base + g * stride_zg + offs_n[None, :], mask=bmask, other=0)
    if HAS_ZP:
        q = raw.to(tl.int32) - z.to(tl.int32)
    else:
        q = raw.to(tl.int32) - 128
    w = (q.to(tl.float32) * s.to(tl.float32)).to(compute_type)
    if SWAP:  # a_rows is [1, BLOCK_M]: the activations' tile read transposed, [BLOCK_K, BLOCK_M]
        a = tl.load(a_rows + kr[:, None], mask=kr_mask[:, None] & a_mask[None, :], other=0.0)
        acc = tl.dot(tl.trans(w), a, acc=acc, input_precision=DOT_PRECISION)
    else:
        a = tl.load(a_rows + kr[None, :], mask=a_mask[:, None] & kr_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
    return acc


# 4-bit formats: fragment-ordered weights (docs/layouts/triton-fast.md). A K step loads, per weight
# tile [BLOCK_N, BLOCK_K], BLOCK_K/64 x BLOCK_N/16 atoms of 32 lanes x 16 bytes as rows of a
# [R, 16] byte tensor: each thread's 16 contiguous bytes are the 32 codes its MMA fragment of one
# atom needs (rows n, n + 8 of its lane group, inputs 2t, 2t+1, 2t+8, 2t+9 of four 16-input steps),
# so the unpacked [R, 16, 2] values become the [BLOCK_N, BLOCK_K] first operand of the swapped MMA
# (acc^T = W @ A^T) by a reshape and a permute that the compiler resolves to a renaming of registers.
#
# GPU dequantization (FAST): one 32-bit word = 8 codes = 4 ready bf16x2 / f16x2 operand registers;
# register c holds nibbles c (low half) and c + 4 (high half). int4: nibble OR-ed into the mantissa of
# 128.0 (bf16 0x4300) / 1024.0 (fp16 0x6400), one FMA subtracts magic + 8 (exact): q - 8. MXFP4: sign
# and e1 e0 m bits placed at the bf16 positions (value * 2^-126, exact, subnormals included), one FMA
# times 2^126 (exact). Fused in fp32 after the MMA (symmetric int4, one scale group a K step) or in the
# operand before it: the scales and zero points.


def _shifted(dst: str, src: str, by: int) -> tuple[list[str], str]:
    """PTX lines putting src shifted left by ``by`` (right if negative) in dst, and the register that
    holds it (src itself, no line, when ``by`` is 0)."""
    if by == 0:
        return [], src
    return [f"shl.b32 {dst}, {src}, {by};" if by > 0 else f"shr.b32 {dst}, {src}, {-by};"], dst


def _i4_register(c: int) -> list[str]:
    lines, t = _shifted("t", "$4", -4 * c)
    return lines + [f"lop3.b32 ${c}, {t}, 0x000F000F, MAGIC, 0xEA;"]


def _mx_register(c: int) -> list[str]:
    """e2m1 bits s e1 e0 m at 4c+3, 4c+2..4c -> bf16 bits 15, 8..6 (and 31, 24..22 for the high half)."""
    mag, m = _shifted("m", "$4", 6 - 4 * c)
    sign, sg = _shifted("s", "$4", 12 - 4 * c)
    return mag + [f"and.b32 m, {m}, 0x01C001C0;"] + sign + [f"lop3.b32 ${c}, {sg}, 0x80008000, m, 0xEA;"]


# register c of a word holds nibbles c (bits 4c..) and c + 4 (bits 16 + 4c..), one per 16-bit half
_I4_ASM = "\n".join(["{", ".reg .b32 t, one, nb;", "mov.b32 one, ONE;", "mov.b32 nb, NEGBIAS;"]
                     + [x for c in range(4) for x in _i4_register(c)]
                     + [f"fma.rn.T ${c}, ${c}, one, nb;" for c in range(4)] + ["}"])
_MX_BITS = [x for c in range(4) for x in _mx_register(c)]
_MX_ASM = "\n".join(["{", ".reg .b32 m, s, c, nz;", "mov.b32 c, 0x7E807E80;", "mov.b32 nz, 0x80008000;"] + _MX_BITS
                     + [f"fma.rn.bf16x2 ${c}, ${c}, c, nz;" for c in range(4)] + ["}"])
# the bits alone: value * 2^-126 (MX_FOLD: the 2^126 is folded into the scale)
_MX_RAW_ASM = "\n".join(["{", ".reg .b32 m, s;"] + _MX_BITS + ["}"])
# operands: $0..$3 out (the two results' 4 x 16 bits each), $4 the 4 code bytes
_ASM_I4_BF16 = tl.constexpr(_I4_ASM.replace("ONE", "0x3F803F80").replace("NEGBIAS", "0xC308C308")
                            .replace("MAGIC", "0x43004300").replace(".T", ".bf16x2"))
_ASM_I4_F16 = tl.constexpr(_I4_ASM.replace("ONE", "0x3C003C00").replace("NEGBIAS", "0xE408E408")
                           .replace("MAGIC", "0x64006400").replace(".T", ".f16x2"))
_ASM_MX = tl.constexpr(_MX_ASM)
_ASM_MX_RAW = tl.constexpr(_MX_RAW_ASM)
_C_ASM: tl.constexpr = tl.constexpr("=r,=r,=r,=r,r")


@triton.jit
def _unpack_fragments(raw, FMT: tl.constexpr, FAST: tl.constexpr, compute_type: tl.constexpr,
                      MX_RAW: tl.constexpr = False):
    """Fragment bytes [R, B] -> values [R, B, 2] in compute_type: element (r, kt * 4 + h * 2 + e, kh)
    is nibble 2 kh + h + 4 e of the row's 32-bit word kt (int4: q - 8; MXFP4: the e2m1 value, or with
    ``MX_RAW`` on the GPU path the value * 2^-126)."""
    if FAST:
        if FMT == 2 and MX_RAW:
            lo, hi = tl.inline_asm_elementwise(_ASM_MX_RAW, _C_ASM, [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        elif FMT == 2:
            lo, hi = tl.inline_asm_elementwise(_ASM_MX, _C_ASM, [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        elif compute_type == tl.float16:
            lo, hi = tl.inline_asm_elementwise(_ASM_I4_F16, _C_ASM, [raw], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_ASM_I4_BF16, _C_ASM, [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        v = tl.join(lo, hi)
    else:
        R: tl.constexpr = raw.shape[0]
        B: tl.constexpr = raw.shape[1]
        b = raw.to(tl.int32).reshape(R, B // 4, 2, 2)  # word kt, byte 2 e + kh
        c = tl.join(b & 15, b >> 4)  # [R, kt, e, kh, h]
        if FMT == 2:  # e2m1 -> fp16 bits s 000 0ee m 000000000 = value * 2^-14, exact
            h16 = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
            val = h16.to(tl.float32) * 16384.0
        else:
            val = (c - 8).to(tl.float32)
        v = tl.permute(val, (0, 1, 4, 2, 3)).reshape(R, B, 2).to(compute_type)
    return v


@triton.jit
def _fragment_operand(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[R, 16, 2] values of the rows (k atom, n atom, lane g * 4 + t) -> the [BLOCK_N, BLOCK_K] tile:
    n = n_atom * 16 + h * 8 + g, k = k_atom * 64 + kt * 16 + kh * 8 + t * 2 + e."""
    v = v.reshape(BLOCK_K // 64, BLOCK_N // 16, 8, 4, 4, 2, 2, 2)  # ka, na, g, t, kt, h, e, kh
    v = tl.permute(v, (1, 5, 2, 0, 4, 7, 3, 6))  # na, h, g, ka, kt, kh, t, e
    return v.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _half_operand(v, BLOCK_N: tl.constexpr):
    """[NA * 32, 8, 2] values of one 32-input half of an atom (its words kt = 2 half + j) -> the
    [BLOCK_N, 32] tile: n = n_atom * 16 + h * 8 + g, k = j * 16 + kh * 8 + t * 2 + e."""
    v = v.reshape(BLOCK_N // 16, 8, 4, 2, 2, 2, 2)  # na, g, t, j, h, e, kh
    v = tl.permute(v, (0, 4, 1, 3, 6, 2, 5))  # na, h, g, j, kh, t, e
    return v.reshape(BLOCK_N, 32)


@triton.jit
def _mx_group_dot(raw_half, a_rows, a_mask, k0, K, s, acc, FAST: tl.constexpr, compute_type: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """MXFP4, one 32-input scale group (half an atom, bytes [NA * 32, 8]): acc += (W_g @ A_g^T) * s,
    ``s`` the rows' fp32 scales."""
    w = _half_operand(_unpack_fragments(raw_half, 2, FAST, compute_type), BLOCK_N)
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
    # the step bound folds into the group bound: a scalar condition broadcast into a mask is refused by
    # Triton 3.9's interpreter ("mask has unsupported dtype")
    ok = n_mask[:, None] & (g < tl.where(step < last, K // GROUP, 0))[None, :]
    return tl.load(base + g[None, :] * stride_g + offs_n[:, None], mask=ok, other=other)


@triton.jit
def _frag_tile(a_rows, a_mask, w_ptrs, ka_rows, na_ok, s_tile, z_tile, step, K, acc, FMT: tl.constexpr,
               GROUP: tl.constexpr, HAS_ZP: tl.constexpr, FAST: tl.constexpr, POST: tl.constexpr,
               GROUP_DOTS: tl.constexpr, MX_FOLD: tl.constexpr, compute_type: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int4 / MXFP4: acc^T [BLOCK_N, BLOCK_M] += W[n, k] @ A^T[k, m] over K step ``step``; ``s_tile`` /
    ``z_tile`` are the step's raw scale / zero-point rows [BLOCK_N, SG] (``_step_rows``). ``POST``: the
    scale (SG = 1) multiplies the fp32 product; MXFP4 with ``GROUP_DOTS``: one dot per 32-input group,
    its scale on the fp32 product; else the scales multiply the operand, and MXFP4 with ``MX_FOLD``
    (every e8m0 exponent <= 128) multiplies value * 2^-126 by 2^(S - 1)."""
    KA: tl.constexpr = BLOCK_K // 64
    SG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1
    ok = na_ok & (step * KA + ka_rows < K // 64)
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
    w = _fragment_operand(_unpack_fragments(raw, FMT, FAST, compute_type, FOLD), BLOCK_N, BLOCK_K)
    k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + k[:, None], mask=(k < K)[:, None] & a_mask[None, :], other=0.0)
    if POST:  # symmetric int4, one group a step: the scale multiplies the step's fp32 product
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
        if HAS_ZP:  # (q - 8) - (z - 8), exact in 16 bits
            z = z_tile.to(tl.float32) - 8.0
            z = tl.broadcast_to(z.to(compute_type)[:, :, None], (BLOCK_N, SG, BLOCK_K // SG)).reshape(BLOCK_N, BLOCK_K)
            w = w - z
        acc = tl.dot(w * s, a, acc=acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _moe_gemm(
    a_ptr, b_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, ntpp_ptr, ws_ptr, tile_count_ptr,
    N, K, EM, num_pairs, up_offset, alpha, limit, expert_offset, num_experts,
    stride_am, stride_be, stride_bk, stride_bn, stride_se, stride_sg, stride_ze, stride_zg, stride_biase, stride_cm,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, A_ROW_DIV: tl.constexpr,
    ATOMIC_ROW_DIV: tl.constexpr, SPLIT_K: tl.constexpr, FAST: tl.constexpr, SWAP: tl.constexpr,
    GROUP_DOTS: tl.constexpr, MX_FOLD: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    compute_type: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_M sorted pairs of one expert x BLOCK_N output columns x one K split.

    ``GATED``: GEMM1, columns n of the gate half and n + ``up_offset`` of the up half, the activation in
    the epilogue; ``N`` is then I; with ``SPLIT_K`` > 1 each split stores its fp32 partial sums in
    ``ws [SPLIT_K, num_pairs, 2N]`` and counts itself in ``tile_count`` (zeros), and the split that
    counts last adds them up (in split order) and runs the epilogue. ``ATOMIC_ROW_DIV`` > 0: split-K
    GEMM2, fp32 atomic adds into row ``pair // ATOMIC_ROW_DIV`` (the token), which also sums over
    top-k. ``PAIR_BLOCKS``: no alignment, block ``b`` is pair ``b`` alone (``sorted_ids`` are then the
    global top-k ids, ``EM`` = pairs x BLOCK_M; one token's pairs go to distinct experts). 4-bit weights
    are fragment ordered (``stride_bk``: bytes per 16-row atom row, K * 8) and always multiply swapped;
    int8 weights are ``[K, N]`` rows read through (``stride_bk``, ``stride_bn``), swapped if ``SWAP``."""
    _kernel_start(PDL)
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
    SWAPPED: tl.constexpr = SWAP or FMT != 1

    if SWAPPED:
        a_rows = a_ptr + (offs_pair // A_ROW_DIV)[None, :] * stride_am
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a_rows = a_ptr + (offs_pair // A_ROW_DIV)[:, None] * stride_am
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros_like(acc)
    b_base = b_ptr + expert * stride_be
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_ze
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = min(first + per_split, steps)

    if FMT == 1:
        offs_k = tl.arange(0, BLOCK_K)
        for step in range(first, last):
            kr = step * BLOCK_K + offs_k
            kr_mask = kr < K
            g_row = (step * BLOCK_K) // GROUP
            acc = _int8_tile(a_rows, pair_ok, b_base, s_base, z_base, kr, kr_mask, offs_n, n_mask, g_row,
                             stride_bk, stride_bn, stride_sg, stride_zg, acc, GROUP, BLOCK_K, HAS_ZP, SWAP,
                             compute_type, DOT_PRECISION)
            if GATED:
                acc_up = _int8_tile(a_rows, pair_ok, b_base + up_offset * stride_bn, s_base + up_offset,
                                    z_base + up_offset, kr, kr_mask, offs_n, n_mask, g_row, stride_bk, stride_bn,
                                    stride_sg, stride_zg, acc_up, GROUP, BLOCK_K, HAS_ZP, SWAP, compute_type,
                                    DOT_PRECISION)
    else:
        # fragment rows of a step: (k atom, n atom, lane), 16 bytes each
        NA: tl.constexpr = BLOCK_N // 16
        rows = tl.arange(0, (BLOCK_K // 64) * NA * 32)
        ka_rows = rows // (NA * 32)
        na = pid_n * NA + (rows // 32) % NA
        na_ok = na < N // 16
        w_rows = b_base + na.to(tl.int64) * stride_bk + ka_rows * 512 + (rows % 32) * 16
        w_ptrs = w_rows[:, None] + tl.arange(0, 16)[None, :]
        up_ptrs = w_ptrs + (up_offset // 16) * stride_bk
        # symmetric int4 with one scale group a step: the scale multiplies the step's fp32 product
        POST: tl.constexpr = FMT == 0 and not HAS_ZP and GROUP % BLOCK_K == 0
        SG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1
        S_OTHER: tl.constexpr = 127 if FMT == 2 else 0  # e8m0 127 = 1.0 past the last group
        s_up_base = s_base + up_offset
        z_up_base = z_base + up_offset
        # the scale (and zero-point) rows of the next step, gate and up
        s1 = _step_rows(s_base, first, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K, SG)
        su1, z1, zu1 = s1, s1, s1  # placeholders where unused
        if GATED:
            su1 = _step_rows(s_up_base, first, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K, SG)
        if HAS_ZP:
            z1 = _step_rows(z_base, first, last, K, offs_n, n_mask, stride_zg, 8, GROUP, BLOCK_K, SG)
            if GATED:
                zu1 = _step_rows(z_up_base, first, last, K, offs_n, n_mask, stride_zg, 8, GROUP, BLOCK_K, SG)
        for step in range(first, last):
            s_cur = s1
            s1 = _step_rows(s_base, step + 1, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K, SG)
            z_cur = z1
            if HAS_ZP:
                z1 = _step_rows(z_base, step + 1, last, K, offs_n, n_mask, stride_zg, 8, GROUP, BLOCK_K, SG)
            acc = _frag_tile(a_rows, pair_ok, w_ptrs, ka_rows, na_ok, s_cur, z_cur, step, K, acc, FMT, GROUP,
                             HAS_ZP, FAST, POST, GROUP_DOTS, MX_FOLD, compute_type, DOT_PRECISION, BLOCK_N, BLOCK_K)
            if GATED:
                su_cur = su1
                su1 = _step_rows(s_up_base, step + 1, last, K, offs_n, n_mask, stride_sg, S_OTHER, GROUP, BLOCK_K,
                                 SG)
                zu_cur = zu1
                if HAS_ZP:
                    zu1 = _step_rows(z_up_base, step + 1, last, K, offs_n, n_mask, stride_zg, 8, GROUP, BLOCK_K, SG)
                acc_up = _frag_tile(a_rows, pair_ok, up_ptrs, ka_rows, na_ok, su_cur, zu_cur, step, K, acc_up, FMT,
                                    GROUP, HAS_ZP, FAST, POST, GROUP_DOTS, MX_FOLD, compute_type, DOT_PRECISION,
                                    BLOCK_N, BLOCK_K)
    if SWAPPED:  # back to [BLOCK_M, BLOCK_N] for the epilogue (one layout change a program)
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
        # condition folds into the column bound, as in _step_rows)
        bias_mask = offs_n < tl.where((pid_k == 0) | GATED, N, 0)
        acc += tl.load(bias_base + offs_n, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_base + up_offset + offs_n, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACT == 1:  # gpt-oss: clamp, then (up + 1) * gate * sigmoid(alpha * gate)
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
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


# ---------------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class FastWeights:
    """One projection in the ``triton-fast`` layout: ``weight`` uint8, ``[E, N/16, 8K]`` fragment-ordered
    (int4, MXFP4) or ``[E, K, N]`` (int8; N contiguous, or K contiguous as a transposed view);
    ``scale [E, K/g, N]`` (model dtype; uint8 e8m0 for MXFP4); ``zero_point [E, K/g, N]`` uint8 or None;
    ``bias [E, N]`` or None. For w13, N = 2I: the gate rows, then the up rows."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def k(self, fmt: str) -> int:
        return self.weight.shape[1] if fmt == "int8" else self.weight.shape[2] // 8

    def n(self, fmt: str) -> int:
        return self.weight.shape[2] if fmt == "int8" else self.weight.shape[1] * 16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.zero_point, self.bias)
                   if t is not None)


def _fast(fmt: int, a: torch.Tensor) -> bool:
    """The register-level dequantization (inline PTX) runs on CUDA devices for int4 in bf16 / fp16 and
    MXFP4 in bf16; the interpreter and other cases take the portable path."""
    if a.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(ENV_PORTABLE):
        return False
    return (fmt == INT4 and a.dtype in (torch.float16, torch.bfloat16)) or (fmt == MXFP4 and a.dtype == torch.bfloat16)


class PairBlocks(NamedTuple):
    """The alignment of one token (``use_pair_blocks``): no launch, block b is pair b, its expert read
    from the ids by the GEMM itself."""

    ids: torch.Tensor  # [P] int32, the global top-k ids
    num_experts: int
    expert_offset: int


def use_pair_blocks(M: int) -> bool:
    """One token: its top-k pairs go to distinct experts, so one block a pair reads each expert once
    and the align launch is saved (repeated ids would be read again, still correct)."""
    return M == 1


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
    if fmt == INT8:
        if 1 not in w.weight.stride()[1:]:
            raise ValueError(f"the int8 weight bytes need N or K contiguous, found strides {w.weight.stride()}")
        stride_bk, stride_bn = w.weight.stride(1), w.weight.stride(2)
    else:
        if w.weight.stride(2) != 1 or w.weight.shape[2] % 512:
            raise ValueError(f"fragment-ordered weights need [E, N/16, 8K] rows of whole 512-byte atoms, found shape "
                             f"{tuple(w.weight.shape)} strides {w.weight.stride()}")
        stride_bk, stride_bn = w.weight.stride(1), 0
    K, Nw = w.k(name), w.n(name)
    N = Nw // 2 if gated else Nw
    z = w.zero_point if w.zero_point is not None else w.weight
    bias = w.bias if w.bias is not None else w.scale
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (triton.cdiv(EM, bm) * triton.cdiv(N, bn), split)
    _moe_gemm[grid](
        a, w.weight, w.scale, z, bias, out, topk_weights if topk_weights is not None else w.scale,
        sorted_ids, expert_ids, ntpp, ws, counts,
        N, K, EM, num_pairs, Nw // 2, alpha, limit, offset, E,
        a.stride(0), w.weight.stride(0), stride_bk, stride_bn, w.scale.stride(0), w.scale.stride(1),
        z.stride(0) if w.zero_point is not None else 0, z.stride(1) if w.zero_point is not None else 0,
        bias.stride(0) if w.bias is not None else 0, out.stride(0),
        FMT=fmt, GROUP=group, HAS_ZP=w.zero_point is not None, HAS_BIAS=w.bias is not None,
        GATED=gated, ACT=act, MUL_ROUTED_WEIGHT=topk_weights is not None, A_ROW_DIV=a_row_div,
        ATOMIC_ROW_DIV=atomic_row_div, SPLIT_K=split, FAST=_fast(fmt, a), SWAP=bool(cfg.get("SWAP_AB", 0)),
        GROUP_DOTS=fmt == MXFP4 and bool(cfg.get("GROUP_DOTS", 0)), MX_FOLD=fmt == MXFP4 and mx_fold,
        PAIR_BLOCKS=pair_blocks,
        compute_type=_TL_DTYPES[a.dtype], DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg.get("GROUP_M", 1),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **_pdl(a.device, not pair_blocks),
    )


def check_config(cfg: dict, fmt: str) -> None:
    """The tile constraints the kernel relies on (a config from a table or a user is checked once)."""
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{key} = {v} must be a power of two >= 16")
    if fmt != "int8" and cfg["BLOCK_K"] < 64:
        raise ValueError(f"BLOCK_K = {cfg['BLOCK_K']}: 4-bit weights are read in 64-input fragment atoms; use >= 64")
    if cfg.get("SWAP_AB", 0) not in (0, 1):
        raise ValueError(f"SWAP_AB = {cfg['SWAP_AB']} must be 0 or 1")
    if cfg.get("GROUP_DOTS", 0) not in (0, 1) or (cfg.get("GROUP_DOTS", 0) and cfg["BLOCK_K"] > 128):
        raise ValueError(f"GROUP_DOTS = {cfg['GROUP_DOTS']} must be 0 or 1, and 1 needs BLOCK_K <= 128")
    if cfg.get("SPLIT_K", 1) < 1:
        raise ValueError(f"SPLIT_K = {cfg['SPLIT_K']} must be >= 1")


def fused_moe_fast(x: torch.Tensor, w13: FastWeights, w2: FastWeights, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, fmt: str, group_size: int, activation: str = "silu",
                   alpha: float = 1.702, limit: float = 7.0, expert_offset: int = 0,
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


def weights_from_tensors(tensors: dict[str, torch.Tensor], which: str) -> FastWeights:
    """``w13`` / ``w2`` of a ``triton-fast`` layer's tensors (file names of the layout)."""
    get = tensors.get
    return FastWeights(tensors[f"{which}_weight"], tensors[f"{which}_weight_scale"],
                       get(f"{which}_weight_zero_point"), get(f"{which}_bias"))


def layer_forward(x: torch.Tensor, tensors: dict[str, torch.Tensor], layer, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The runtime's hook for one ``MoELayer`` in a ``triton-fast`` layout: pads x to the layer's
    (padded) K and cuts the output back to H."""
    e = layer.entry
    s = e.scheme
    fmt = "mxfp4" if s.kind == "mxfp4" else f"int{s.bits}"
    group = 32 if s.kind == "mxfp4" else s.group_size
    w13, w2 = weights_from_tensors(tensors, "w13"), weights_from_tensors(tensors, "w2")
    H, K = e.hidden_size, w13.k(fmt)
    xin = x if K == H else torch.nn.functional.pad(x, (0, K - H))
    params = e.activation_params
    kw = {k: float(params[k]) for k in ("alpha", "limit") if k in params}
    small = False
    if fmt == "mxfp4":  # read once per layer (a host read), never while a CUDA graph is being captured
        state = layer.kernel_state
        small = state.get("mx_small_scales")
        if small is None:
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            small = False if capturing else state.setdefault("mx_small_scales", mx_small_scales(w13, w2))
    y = fused_moe_fast(xin, w13, w2, topk_weights, topk_ids, fmt=fmt, group_size=group, activation=e.activation,
                       expert_offset=e.expert_offset, all_ids_local=e.num_experts == e.num_experts_global,
                       mx_small_scales=small, **kw)
    return y[:, :H]
