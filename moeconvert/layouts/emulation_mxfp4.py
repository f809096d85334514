"""``emulation`` for MXFP4 experts: what vLLM 0.33.0's MXFP4 EMULATION backend holds (docs/layouts/emulation.md).

``convert_weight_to_mxfp4_moe_kernel_format`` returns the plain packed tensors unchanged for
EMULATION (and XPU); ``OCP_MXQuantizationEmulationTritonExperts`` dequantizes them at run time. So the
bytes are ``plain``'s MXFP4 form, padded to multiples of 32 (§5.3), with one difference: vLLM holds
the rows of w13 in the order its activation reads them, and for gpt-oss (``swigluoai``) that is the
checkpoint's interleave, row ``2j`` = gate ``j`` and ``2j + 1`` = up ``j`` (weights, scales and
bias; §5.2, §7). Other models keep ``[gate; up]``.

=================  ===========================  ================================
tensor             shape                        dtype
=================  ===========================  ================================
w13_weight         ``[E, 2Ip, Hp/2]``           uint8, e2m1 pairs (low nibble = even k)
w13_weight_scale   ``[E, 2Ip, Hp/32]``          uint8, e8m0
w2_weight          ``[E, Hp, Ip/2]``            uint8
w2_weight_scale    ``[E, Hp, Ip/32]``           uint8
w13_bias, w2_bias  ``[E, 2Ip]``, ``[E, Hp]``    model dtype (if the model has expert biases)
=================  ===========================  ================================
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import W13
from moeconvert.layouts.plain import PlainLayout
from moeconvert.schemes import Scheme

INTERLEAVED_ACTIVATIONS = ("swigluoai",)
_W13_ROWS = (W13.weight, W13.weight_scale, W13.bias)


def interleave_halves(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` as ``[gate; up]`` -> rows ``gate 0, up 0, gate 1, up 1, ...``."""
    E, n = t.shape[:2]
    return t.view(E, 2, n // 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def deinterleave_halves(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_halves`."""
    E, n = t.shape[:2]
    return t.view(E, n // 2, 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


@register
class EmulationMXFP4Layout(PlainLayout):
    name = "emulation"
    version = 1
    schemes = ("mxfp4",)
    runtime_kernels = ()  # vLLM's emulation is not called by the runtime (yet)
    kernel = "vllm OCP_MXQuantizationEmulationTritonExperts (dequantize, then bf16 Triton MoE)"
    made_for = {"vllm": ["0.33.0"]}  # no oracle runs vLLM's own code for it yet
    pad_multiples = (32, 32)

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        out = super().encode(block, shape)
        if shape.activation in INTERLEAVED_ACTIVATIONS:
            out.update({k: interleave_halves(out[k]) for k in _W13_ROWS if k in out})
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        if shape.activation in INTERLEAVED_ACTIVATIONS:
            tensors = {k: deinterleave_halves(v) if k in _W13_ROWS else v for k, v in tensors.items()}
        return super().decode(tensors, shape, scheme)
