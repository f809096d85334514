"""Token-by-expert sort and alignment for the fused-MoE GEMMs (vLLM's ``moe_align_block_size``, in torch).

The fused kernel walks blocks of ``BLOCK_M`` (token, slot) pairs that all go to one expert. This step
sorts the flattened ``topk_ids`` (``M * top_k`` pairs, pair ``p = m * top_k + j``) by local expert,
pads every expert's run to a multiple of ``BLOCK_M`` with the sentinel ``M * top_k``, and says which
expert each block belongs to. Vectorised, and free of host synchronisation (the sizes are the static
upper bound, the used length is the device tensor ``num_tokens_post_padded``), so it can run on a
stream ahead of the GEMMs.

Differences from vLLM's CUDA op, on purpose: ids outside ``[0, E)`` after subtracting
``expert_offset`` (experts of other EP ranks) are left out of the sorted list altogether, so no block
belongs to them and their pairs' output rows stay zero (the runtime's reference adds nothing for them
either); the buffer is sized ``P + min(E, P) * (BLOCK_M - 1)`` rather than ``P + E * (BLOCK_M - 1)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
