"""moeconvert's own Triton kernels (docs/kernels.md), the runtime's ``triton`` kernel (runtime/dispatch.py).

``supports(layout, kind)`` and ``fused_moe(x, tensors, layer, topk_weights, topk_ids)`` are the hook
the runtime calls. Triton itself is imported on the first ``fused_moe`` call, so that loading a folder
does not pay for it and ``TRITON_INTERPRET`` is read when the kernels are defined.
"""

from __future__ import annotations

#: (layout name, scheme kind) pairs the fused MoE kernel reads
SUPPORTED = frozenset({("triton", "wna16")})


def supports(layout: str, kind: str) -> bool:
    return (layout, kind) in SUPPORTED


def fused_moe(x, tensors, layer, topk_weights, topk_ids):
    """Routed experts' output ``[M, H]`` in ``x.dtype`` for ``x [M, H]`` and global ``topk_ids [M, k]``."""
    # a submodule named fused_moe would replace this function on the package once imported
    from moeconvert.kernels.moe_wna16 import fused_moe as impl

    return impl(x, tensors, layer, topk_weights, topk_ids)
