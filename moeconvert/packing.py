"""Bit packing of integer codes into int32 words, LSB-first (compressed-tensors' rule, wna16-layouts.md §1.3).

Along the packed dimension, element ``j`` goes to word ``j // pf`` at bits ``[b*(j % pf), b*(j % pf) + b)``
with ``pf = 32 // b``. All functions are whole-tensor shifts and masks.
"""

from __future__ import annotations

import torch


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int64, device=device)


def pack_int32(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack unsigned ``bits``-wide fields (any integer dtype) along ``dim`` into int32 words.

    The packed extent must be a multiple of ``32 // bits``.
    """
    pf = 32 // bits
    dim = dim % codes.dim()
    x = codes.movedim(dim, -1).to(torch.int64)
    n = x.shape[-1]
    if n % pf:
        raise ValueError(f"cannot pack {n} fields of {bits} bits into whole int32 words")
    x = x.reshape(*x.shape[:-1], n // pf, pf) << _shifts(bits, x.device)
    words = x.sum(-1)  # fields do not overlap, so the sum is the bitwise or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: the first ``n`` unsigned fields along ``dim``, as uint8 (bits <= 8)."""
    pf = 32 // bits
    dim = dim % words.dim()
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    fields = (w.unsqueeze(-1) >> _shifts(bits, w.device)) & ((1 << bits) - 1)
    fields = fields.reshape(*w.shape[:-1], w.shape[-1] * pf)[..., :n]
    return fields.to(torch.uint8).movedim(-1, dim).contiguous()
