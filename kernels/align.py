"""Token-by-expert sort and alignment for the fused-MoE GEMMs: vLLM's ``moe_align_block_size`` contract,
and the three ways this package meets it.

The fused kernel walks blocks of ``BLOCK_M`` (token, slot) pairs that all go to one expert. This step
sorts the flattened ``topk_ids`` (``M * top_k`` pairs, pair ``p = m * top_k + j``) by local expert,
pads every expert's run to a multiple of ``BLOCK_M`` with the sentinel ``M * top_k``, and says which
expert each block belongs to. Free of host synchronisation (the sizes are the static upper bound, the
used length is the device tensor ``num_tokens_post_padded``), so it can run on a stream ahead of the
GEMMs.

Differences from vLLM's CUDA op, on purpose: ids outside ``[0, E)`` after subtracting
``expert_offset`` (experts of other EP ranks) are left out of the sorted list altogether, so no block
belongs to them and their pairs' output rows stay zero (the runtime's reference adds nothing for them
either); the buffer is sized ``P + min(E, P) * (BLOCK_M - 1)`` rather than ``P + E * (BLOCK_M - 1)``.

One contract, three implementations (they differ in cost and in the order of the pairs inside a run,
which no output depends on):

* :func:`moe_align_block_size`: torch, vectorised, pairs in ascending order inside a run; the
  ``triton`` layout's kernel (moe_wna16.py) and the contenders of ``bench kernel``.
* :func:`align`: Triton launches, pairs in no fixed order (atomics); ``fused_moe_fast``. One program
  up to ``ALIGN_ONE_PROGRAM_MAX`` pairs, three kernels above (the crossover measured on the H200:
  docs/kernels.md, "Align").
* :class:`PairBlocks`: one token (:func:`use_pair_blocks`), no launch at all: block ``b`` is pair
  ``b`` and the GEMM reads its expert from the ids itself (docs/kernels.md, "One token").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeconvert.kernels.pdl import kernel_start, launch_options


class Alignment(NamedTuple):
    #: ``[max_padded]`` int32: pair indices grouped by expert, each run padded with the sentinel ``P``
    sorted_token_ids: torch.Tensor
    #: ``[max_padded // BLOCK_M]`` int32: the local expert of each block (-1 past the used blocks)
    expert_ids: torch.Tensor
    #: ``[1]`` int32: the used length of ``sorted_token_ids`` (sum of the padded runs)
    num_tokens_post_padded: torch.Tensor


def max_padded_tokens(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length: every non-empty expert adds at most ``BLOCK_M - 1`` sentinels."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                         expert_offset: int = 0) -> Alignment:
    """Sort ``topk_ids [M, k]`` (global ids) into ``BLOCK_M``-aligned runs per local expert."""
    dev = topk_ids.device
    local = topk_ids.reshape(-1).long() - expert_offset
    P, E = local.numel(), num_experts
    mine = (local >= 0) & (local < E)
    key = torch.where(mine, local, E)  # other ranks' experts sort last, into bucket E
    order = torch.argsort(key, stable=True)  # pairs by expert, ascending pair index within one
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    max_padded = max_padded_tokens(P, E, block_m)

    # rank i of the sort goes to padded_start[e] + (i - count_start[e]); bucket E goes to a dump slot
    sorted_key = key[order]
    e = sorted_key.clamp(max=E - 1)
    dest = (padded_end - padded)[e] + torch.arange(P, device=dev) - count_start[e]
    dest = torch.where(sorted_key < E, dest, max_padded)
    sorted_ids = torch.full((max_padded + 1,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))

    block_start = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < E, expert_ids, -1).to(torch.int32)
    total = padded_end[-1:] if E > 0 else torch.zeros(1, dtype=torch.long, device=dev)
    return Alignment(sorted_ids[:max_padded], expert_ids, total.to(torch.int32))


# ---------------------------------------------------------------------------------------------------
# Triton: no host synchronisation (one program for small batches, three kernels above)


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
    """``moe_align_block_size`` (the contract above) in one program: count pairs per local expert
    with atomics, pad the counts to BLOCK_M, prefix-sum them, fill the sentinels, write the expert of
    every block, and scatter each pair to its expert's next free slot (the order of the pairs inside
    one expert's run is not fixed; every output row depends on its own pair only)."""
    kernel_start(PDL)
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
    kernel_start(PDL)
    ids, ok = _local_ids(ids_ptr, tl.program_id(0) * CHUNK + tl.arange(0, CHUNK), P, E, offset)
    tl.atomic_add(counts_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")


@triton.jit
def _align_offsets_kernel(counts_ptr, cursor_ptr, expert_ids_ptr, ntpp_ptr, E, max_padded,
                          BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BCHUNK: tl.constexpr, PDL: tl.constexpr):
    kernel_start(PDL)
    e_offs = tl.arange(0, E_P2)
    e_ok = e_offs < E
    padded, end = _padded_runs(tl.load(counts_ptr + e_offs, mask=e_ok, other=0), BLOCK_M)
    tl.store(ntpp_ptr, tl.sum(padded, 0))
    tl.store(cursor_ptr + e_offs, end - padded, mask=e_ok)
    _store_block_experts(expert_ids_ptr, end, e_ok, E, max_padded, BLOCK_M, BCHUNK)


@triton.jit
def _align_scatter_kernel(ids_ptr, sorted_ptr, cursor_ptr, P, E, offset, CHUNK: tl.constexpr, PDL: tl.constexpr):
    kernel_start(PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids, ok = _local_ids(ids_ptr, offs, P, E, offset)
    slot = tl.atomic_add(cursor_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=ok, sem="relaxed")
    tl.store(sorted_ptr + slot, offs, mask=ok)


#: up to this many pairs one program aligns them (one launch); above, count / offsets / scatter
#: kernels over the pairs (H200, per call: 3.4 / 7.7 / 13.9 µs one program and 6.3 / 11.4 / 12.6 µs
#: the three kernels for 8 / 512 / 2048 pairs over 128 experts)
ALIGN_ONE_PROGRAM_MAX = 1024


def align(topk_ids: torch.Tensor, block_m: int, num_experts: int, expert_offset: int = 0):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as :func:`moe_align_block_size` gives them,
    from Triton launches (pairs inside one expert's run in no fixed order)."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    P, E = ids.numel(), num_experts
    max_padded = max_padded_tokens(P, E, block_m)
    dev = ids.device
    pdl = launch_options(dev)
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
# one token: no alignment at all


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
