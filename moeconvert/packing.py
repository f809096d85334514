"""Bit packing of integer codes into int32 words, LSB-first (compressed-tensors' rule, docs/format.md).

Along the packed dimension, element ``j`` goes to word ``j // pf`` at bits ``[b*(j % pf), b*(j % pf) + b)``
with ``pf = 32 // b``. All functions are whole-tensor shifts and masks.

On a little-endian host (every platform torch ships for) LSB-first int32 words are their bytes in
order, so 8-bit fields are a plain byte view and 4-bit fields pair up into bytes (even element in the
low nibble) before the view; other widths, or a big-endian host, take the general shift-and-sum path.
"""

from __future__ import annotations

import sys

import torch

LITTLE_ENDIAN = sys.byteorder == "little"


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int64, device=device)


def pack_int32(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack unsigned ``bits``-wide fields (any integer dtype) along ``dim`` into int32 words.

    The packed extent must be a multiple of ``32 // bits``.
    """
    pf = 32 // bits
    dim = dim % codes.dim()
    n = codes.shape[dim]
    if n % pf:
        raise ValueError(f"cannot pack {n} fields of {bits} bits into whole int32 words")
    if LITTLE_ENDIAN and bits in (4, 8):
        fields = _rows(codes.movedim(dim, -1).to(torch.uint8))
        if bits == 4:
            fields = pair_nibbles(fields)
        words = fields.view(torch.int32)
        return words.reshape(*codes.movedim(dim, -1).shape[:-1], -1).movedim(-1, dim).contiguous()
    x = codes.movedim(dim, -1).to(torch.int64)
    x = x.reshape(*x.shape[:-1], n // pf, pf) << _shifts(bits, x.device)
    words = x.sum(-1)  # fields do not overlap, so the sum is the bitwise or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: the first ``n`` unsigned fields along ``dim``, as uint8 (bits <= 8)."""
    pf = 32 // bits
    dim = dim % words.dim()
    if LITTLE_ENDIAN and bits in (4, 8):
        lead = words.movedim(dim, -1).shape[:-1]
        fields = _rows(words.movedim(dim, -1)).view(torch.uint8)
        if bits == 4:
            fields = split_nibbles(fields)
        return fields.reshape(*lead, -1)[..., :n].movedim(-1, dim).contiguous()
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    fields = (w.unsqueeze(-1) >> _shifts(bits, w.device)) & ((1 << bits) - 1)
    fields = fields.reshape(*w.shape[:-1], w.shape[-1] * pf)[..., :n]
    return fields.to(torch.uint8).movedim(-1, dim).contiguous()


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a dense 2-D ``[rows, last]`` tensor whose strides allow a dtype view."""
    return x.contiguous().reshape(-1, x.shape[-1]) if x.numel() else x.reshape(0, x.shape[-1])


def pair_nibbles(fields: torch.Tensor) -> torch.Tensor:
    """uint8 fields ``[..., 2m]`` (values < 16) -> bytes ``[..., m]``, element ``2i`` in the low nibble."""
    v = _rows(fields).view(torch.int16).reshape(*fields.shape[:-1], -1)  # little-endian: even byte low
    return ((v & 0x0F) | ((v >> 4) & 0xF0)).to(torch.uint8)


def split_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pair_nibbles`: bytes ``[..., m]`` -> uint8 fields ``[..., 2m]``."""
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def pair_nibbles_at(fields: torch.Tensor, offset: int) -> torch.Tensor:
    """uint8 fields ``[..., 2*offset*m]`` (values < 16, ``offset`` a multiple of 8) -> bytes
    ``[..., offset*m]``: field ``2*offset*i + r`` (r < offset) in the low nibble of byte ``offset*i + r``,
    field ``2*offset*i + offset + r`` in its high nibble. Eight bytes at a time, as int64 lanes."""
    *lead, n = fields.shape
    v = _rows(fields).view(torch.int64).reshape(*lead, n // (2 * offset), 2, offset // 8)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*lead, -1).view(torch.uint8)


def split_nibbles_at(b: torch.Tensor, offset: int) -> torch.Tensor:
    """Inverse of :func:`pair_nibbles_at`."""
    *lead, n = b.shape
    v = _rows(b).view(torch.int64).reshape(*lead, n // offset, 1, offset // 8)
    return torch.cat((v & _LOW_NIBBLES, (v >> 4) & _LOW_NIBBLES), dim=-2).reshape(*lead, -1).view(torch.uint8)
