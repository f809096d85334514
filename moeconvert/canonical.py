"""The canonical expert block: the logical, backend-neutral values of a chunk of one layer's experts.

Every source decodes to this form and every layout decodes back to it, so "is this file right" is
always one exact comparison of canonical blocks.

=========  ======================================  ==========================================
scheme     w13 / w2                                scales, zero points
=========  ======================================  ==========================================
float      weights ``[E, 2I, H]`` / ``[E, H, I]``  none
           in the checkpoint dtype
wna16      unsigned codes ``u = q + 2^(b-1)``,     scales ``[E, N, G]`` (checkpoint dtype);
           uint8 ``[E, N, K]``                     asym: unsigned zero points uint8 ``[E, N, G]``
mxfp4      packed e2m1 uint8 ``[E, N, K/2]``       e8m0 scales uint8 ``[E, N, K/32]``
           (low nibble = even k)
nvfp4      packed e2m1 uint8 ``[E, N, K/2]``       e4m3 scales float8_e4m3fn ``[E, N, K/16]``;
           (low nibble = even k)                   per-expert fp32 multipliers ``w13_global
                                                   [E, 2]`` (gate, up), ``w2_global [E]``
=========  ======================================  ==========================================

NVFP4's value is ``e2m1 * scale * global``: ``global`` is the dequantization multiplier, which
compressed-tensors stores as its reciprocal (``weight_global_scale``, a divisor); the reader takes
``1 / weight_global_scale`` in fp32, the division vLLM's ``CompressedTensorsW4A4Nvfp4MoEMethod`` makes
(docs/sources.md). A W4A4 checkpoint also stores one ``input_global_scale`` per projection, the activations'
divisor: the block keeps its reciprocal the same way (``w13_input_global [E, 2]``, ``w2_input_global [E]``),
which only layouts whose kernels quantize activations read (FlashInfer TRT-LLM); others drop it.

w13 holds the gate rows first, then the up rows (vLLM's order), also for models whose checkpoint
interleaves them (gpt-oss): the layer's ``activation`` says how the engine wants them, and layouts
re-interleave where their kernel expects it. Optional expert biases: ``w13_bias [E, 2I]``,
``w2_bias [E, H]``, in the checkpoint dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeconvert.schemes import Scheme

BLOCK_TENSORS = ("w13", "w2", "w13_scale", "w2_scale", "w13_zero", "w2_zero", "w13_bias", "w2_bias",
                 "w13_global", "w2_global", "w13_input_global", "w2_input_global")


@dataclass
class ExpertBlock:
    scheme: Scheme
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_zero: torch.Tensor | None = None
    w2_zero: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w13_global: torch.Tensor | None = None  # NVFP4: fp32 [E, 2]
    w2_global: torch.Tensor | None = None  # NVFP4: fp32 [E]
    w13_input_global: torch.Tensor | None = None  # NVFP4 W4A4: fp32 [E, 2] (gate, up)
    w2_input_global: torch.Tensor | None = None  # NVFP4 W4A4: fp32 [E]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in BLOCK_TENSORS if getattr(self, name) is not None}

    def differences(self, other: "ExpertBlock") -> list[str]:
        """Every way ``other`` differs from ``self``, exactly (bits, not tolerances). Empty = identical."""
        out = []
        if self.scheme != other.scheme:
            out.append(f"scheme {other.scheme.describe()} != {self.scheme.describe()}")
        for name in BLOCK_TENSORS:
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                continue
            if (a is None) != (b is None):
                out.append(f"{name}: {'missing' if b is None else 'unexpected'}")
                continue
            if a.shape != b.shape or a.dtype != b.dtype:
                out.append(f"{name}: {tuple(b.shape)} {b.dtype} != {tuple(a.shape)} {a.dtype}")
                continue
            same = _bits(a) == _bits(b)
            if not bool(same.all()):
                out.append(f"{name}: {int((~same).sum())} of {same.numel()} elements differ")
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` as integers of the same width, so NaN/-0.0 compare by their bits."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


@dataclass(frozen=True)
class Partition:
    """Which slice of a layer one output holds: vLLM's TP/EP cuts (docs/format.md)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """vLLM's "linear" expert placement: rank r owns [r*base + min(r, rem), ... + local)."""
        base, rem = divmod(num_experts, self.ep_size)
        start = self.ep_rank * base + min(self.ep_rank, rem)
        local = base + (1 if self.ep_rank < rem else 0)
        return start, start + local

    def to_json(self) -> dict:
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank, "ep_size": self.ep_size, "ep_rank": self.ep_rank}


@dataclass
class LayerShape:
    """The sizes a layout needs to plan one layer's output before any byte is read."""

    num_experts: int  # local experts in this output (after EP)
    hidden_size: int  # H
    intermediate_size: int  # I per TP partition, unpadded
    has_bias: bool = False
    activation: str = "silu"  # "silu" (SiLU-and-mul), "swigluoai" (gpt-oss), "situ" (Kimi-K3), "swiglustep" (Step-3.5)
    dtype: str = "bfloat16"  # the model's params dtype (vLLM casts scales and biases to it)
    bias_dtype: str | None = None  # dtype of the checkpoint's expert biases
    extra: dict = field(default_factory=dict)
