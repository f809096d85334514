"""The runtime kernel ``triton``: moeconvert's own Triton MoE kernels (kernels/, docs/kernels.md), on the
layouts that name it:

* ``triton-fast`` (moeconvert's own layout; WNA16 int4/int8, MXFP4) -> kernels/moe_fast.py
  ``fused_moe_fast``;
* ``triton`` for WNA16 (vLLM's Triton WNA16 layout) -> kernels/moe_wna16.py ``fused_moe_wna16``, our
  kernel of the shape of vLLM's ``fused_moe_kernel_gptq_awq``.

The ``triton`` layout for MXFP4 (triton_kernels' Hopper swizzle) is read by neither and does not name
this kernel. These adapters are the only code of the kernels that reads a layer's manifest entry
(scheme, sizes, activation, EP cut) and ``layer.kernel_state``; everything they call takes plain tensors
and numbers. Triton itself is imported on the first call, so that loading a folder does not pay for it
and ``TRITON_INTERPRET`` is read when the kernels are defined.
"""

from __future__ import annotations

import os

import torch

from moeconvert.layouts import PROJECTIONS, W2, W13, Layout
from moeconvert.layouts.triton_fast import TritonFastMXFP4Layout, TritonFastWNA16Layout
from moeconvert.layouts.triton_wna16 import TritonWNA16Layout
from moeconvert.runtime.dispatch import Kernel, register_kernel

NAME = "triton"


def weights_from_tensors(tensors: dict[str, torch.Tensor], which: str):
    """``w13`` / ``w2`` of a ``triton-fast`` layer's tensors, as ``moe_fast.FastWeights``."""
    from moeconvert.kernels.moe_fast import FastWeights

    n = PROJECTIONS[which]
    return FastWeights(tensors[n.weight], tensors[n.weight_scale], tensors.get(n.weight_zero_point),
                       tensors.get(n.bias))


def fast_forward(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """One ``MoELayer`` in a ``triton-fast`` layout: pads x to the layer's (padded) K and cuts the output
    back to H."""
    from moeconvert.kernels.moe_fast import fused_moe_fast, mx_small_scales

    e = layer.entry
    s = e.scheme
    fmt = "mxfp4" if s.kind == "mxfp4" else f"int{s.bits}"
    group = 32 if s.kind == "mxfp4" else s.group_size
    w13, w2 = weights_from_tensors(layer.tensors, "w13"), weights_from_tensors(layer.tensors, "w2")
    H, K = e.hidden_size, w13.k(fmt)
    xin = x if K == H else torch.nn.functional.pad(x, (0, K - H))
    params = e.activation_params
    kw = {k: float(params[k]) for k in ("alpha", "limit", "beta", "linear_beta") if k in params}
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


def fast_shape(layer):
    """(``kernels.tune.LayerShape``, w13, w2) of a ``triton-fast`` layer: what ``fast_forward`` runs."""
    from moeconvert.kernels.tune import LayerShape

    s = layer.entry.scheme
    fmt = "mxfp4" if s.kind == "mxfp4" else f"int{s.bits}"
    w13, w2 = weights_from_tensors(layer.tensors, "w13"), weights_from_tensors(layer.tensors, "w2")
    shape = LayerShape.of(w13, w2, fmt=fmt, group=32 if s.kind == "mxfp4" else s.group_size, top_k=layer.top_k,
                          activation=layer.entry.activation)
    return shape, w13, w2


def tune_first_use(layers, log=print) -> dict:
    """The opt-in tune on first use (``load(..., tune=True)``, ``$MOECONVERT_KERNEL_TUNE=1``): each distinct
    ``triton-fast`` layer shape this kernel runs on CUDA that no table holds is tuned on the layer's own
    tensors and written to the user's table for this GPU (kernels/tune.py). {key: result, or None if a
    table had it}."""
    from moeconvert.kernels.tune import ensure_tuned

    done: dict = {}
    for layer in layers:
        if layer.kernel != NAME or forward_for(layer.entry.layout) is not fast_forward or layer.device.type != "cuda":
            continue
        shape, w13, w2 = fast_shape(layer)
        if shape.key not in done:
            done[shape.key] = ensure_tuned(shape, w13, w2, layer.device, log=log)
    return done


def wna16_forward(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """One ``MoELayer`` in the WNA16 ``triton`` layout."""
    from moeconvert.kernels.moe_wna16 import WNA16Weights, fused_moe_wna16

    e = layer.entry
    s = e.scheme
    t = layer.tensors
    w13, w2 = (WNA16Weights(t[n.weight], t[n.weight_scale], t.get(n.weight_zero_point), t.get(n.bias))
               for n in (W13, W2))
    H = e.hidden_size
    K = w13.qweight.shape[2] * 8 // s.bits
    xin = x if K == H else torch.nn.functional.pad(x, (0, K - H))
    y = fused_moe_wna16(xin, w13, w2, topk_weights, topk_ids, layer.act, bits=s.bits, group_size=s.group_size,
                        expert_offset=e.expert_offset, w13_rows=e.metadata.get("w13_rows") or "gate_up")
    return y[:, :H]


#: which of our kernels reads each layout that names this one (a layout class, or a subclass of it that
#: keeps its bytes); tests/test_registry.py checks that every layout naming ``triton`` is here
FORWARDS = {TritonFastWNA16Layout: fast_forward, TritonFastMXFP4Layout: fast_forward,
            TritonWNA16Layout: wna16_forward}


def forward_for(layout: Layout):
    return next((FORWARDS[c] for c in type(layout).__mro__ if c in FORWARDS), None)


def _unavailable(layer, device: torch.device) -> str | None:
    e = layer.entry
    if forward_for(e.layout) is None:
        return f"moeconvert's Triton kernels do not read the '{e.layout.name}' layout of {e.scheme.kind} experts"
    clamped = e.activation == "silu" and float(e.activation_params.get("limit", 0)) > 0
    if clamped and forward_for(e.layout) is fast_forward:
        # fused_moe_fast's SiLU has no clamp (the WNA16 kernel applies the reference's activation, clamp included)
        return "moeconvert's triton-fast kernel has no clamped SiLU (DeepSeek-V4's swiglu_limit)"
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        return f"Triton kernels need a CUDA device (device is {device}; TRITON_INTERPRET=1 runs them on CPU)"
    return None


def _run(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    return forward_for(layer.entry.layout)(layer, x, topk_weights, topk_ids)


KERNEL = register_kernel(Kernel(NAME, _unavailable, _run))
