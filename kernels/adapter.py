"""The runtime's adapter for ``triton-fast`` layers: an ``MoELayer``'s tensors and manifest entry in,
:func:`~moeconvert.kernels.moe_fast.fused_moe_fast`'s arguments out.

The only code of the ``triton-fast`` kernel that reads ``layer.entry`` (the manifest: scheme, sizes,
activation, EP cut) and ``layer.kernel_state``; everything it calls takes plain tensors and numbers. It
belongs with the runtime's kernel adapters (runtime/dispatch.py) and is to move there (moe_wna16.py's
``fused_moe`` is the same kind of adapter for the ``triton`` layout).
"""

from __future__ import annotations

import torch

from moeconvert.kernels.moe_fast import FastWeights, fused_moe_fast, mx_small_scales


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
