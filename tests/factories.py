"""Random canonical expert blocks for the layout tests, built one way for every layout.

``wna16_block``: unsigned codes ``[E, N, K]``, distinct positive scales, zero points where asymmetric;
``mxfp4_block``: packed e2m1 bytes ``[E, N, K/2]`` and e8m0 scale bytes ``[E, N, K/32]``. Both draw in one
order (w13, w2, their scales, zero points, biases) from a generator seeded by ``seed``, so a block is the
same on every run.
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock
from moeconvert.schemes import MXFP4Scheme, WNA16Scheme


def wna16_block(E: int, H: int, I: int, bits: int = 4, group_size: int = 32, symmetric: bool = True,
                bias: bool = False, *, scale_dtype: str = "bfloat16", bias_dtype: str | None = None,
                seed: int = 0, no_zero: tuple[str, ...] = ()) -> ExpertBlock:
    """A random WNA16 block; the projections named in ``no_zero`` never hold code 0 (a layout that stores
    the code-0 fact per expert sees it absent); biases in ``bias_dtype`` (default: the scales' dtype)."""
    gen = torch.Generator().manual_seed(seed)
    scheme = WNA16Scheme(bits=bits, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    G13, G2 = scheme.groups(H), scheme.groups(I)

    def codes(*size, low=0):
        return torch.randint(low, 1 << bits, size, generator=gen).to(torch.uint8)

    def scales(*size):
        return (torch.rand(size, generator=gen) * 0.02 + 0.004).to(getattr(torch, scale_dtype))

    kw = dict(w13=codes(E, 2 * I, H, low=int("w13" in no_zero)), w2=codes(E, H, I, low=int("w2" in no_zero)),
              w13_scale=scales(E, 2 * I, G13), w2_scale=scales(E, H, G2))
    if not symmetric:
        kw.update(w13_zero=codes(E, 2 * I, G13), w2_zero=codes(E, H, G2))
    if bias:
        kw.update(_biases(gen, E, H, I, getattr(torch, bias_dtype or scale_dtype)))
    return ExpertBlock(scheme=scheme, **kw)


def mxfp4_block(E: int, H: int, I: int, bias: bool = False, *, bias_dtype: torch.dtype = torch.bfloat16,
                seed: int = 0, codes: tuple[int, int] = (0, 256), scales: tuple[int, int] = (0, 256)) -> ExpertBlock:
    """A random MXFP4 block (``H``, ``I`` the padded sizes a layout stores): code bytes drawn from
    ``[codes)``, e8m0 scale bytes from ``[scales)`` (255 is NaN; ``(1, 256)`` keeps every byte nonzero, to
    see where bytes land)."""
    gen = torch.Generator().manual_seed(seed)

    def u8(span, *size):
        return torch.randint(*span, size, generator=gen).to(torch.uint8)

    kw = dict(w13=u8(codes, E, 2 * I, H // 2), w2=u8(codes, E, H, I // 2),
              w13_scale=u8(scales, E, 2 * I, H // 32), w2_scale=u8(scales, E, H, I // 32))
    if bias:
        kw.update(_biases(gen, E, H, I, bias_dtype))
    return ExpertBlock(scheme=MXFP4Scheme(), **kw)


def block_of(scheme: WNA16Scheme | MXFP4Scheme, E: int, H: int, I: int, **kw) -> ExpertBlock:
    """A random block of ``scheme`` (the keywords as for :func:`wna16_block` or :func:`mxfp4_block`)."""
    if isinstance(scheme, MXFP4Scheme):
        return mxfp4_block(E, H, I, **kw)
    return wna16_block(E, H, I, scheme.bits, scheme.group_size, scheme.symmetric, scale_dtype=scheme.scale_dtype,
                       **kw)


def _biases(gen: torch.Generator, E: int, H: int, I: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return dict(w13_bias=(torch.randn(E, 2 * I, generator=gen) * 0.1).to(dtype),
                w2_bias=(torch.randn(E, H, generator=gen) * 0.1).to(dtype))
