"""moeconvert's own Triton kernels (docs/kernels.md), the runtime's ``triton`` kernel (runtime/dispatch.py).

``supports(layout, kind)`` and ``fused_moe(x, tensors, layer, topk_weights, topk_ids)`` are the hook
the runtime calls. Triton itself is imported on the first ``fused_moe`` call, so that loading a folder
does not pay for it and ``TRITON_INTERPRET`` is read when the kernels are defined.

* ``triton-fast`` layouts (WNA16 int4/int8, MXFP4): adapter.py -> moe_fast.py (one layer call: align.py,
  gemm.py with dequant.py, pdl.py), tuned tiles (configs.py);
* the WNA16 ``triton`` layout (vLLM's own Triton layout): kernels/moe_wna16.py.
"""

from __future__ import annotations

if __name__ == "kernels":
    # Imported as a top-level ``kernels`` because the repository root is on sys.path (``python -m``
    # run from the checkout) while something asked for another package of that name (transformers
    # imports Hugging Face's ``kernels``). Hand that package over instead of this folder.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        # none installed: leave what a namespace folder shadowing one looks like (no __file__, no
        # version), which transformers' availability check reports as not installed
        import types

        sys.modules["kernels"] = types.ModuleType("kernels", "no package named 'kernels' is installed")
        sys.modules["kernels"].__path__ = []
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
    # the import system returns sys.modules['kernels']: the rest of this file defines nothing it uses
#: (layout name, scheme kind) pairs the fused MoE kernels read
SUPPORTED = frozenset({("triton", "wna16"), ("triton-fast", "wna16"), ("triton-fast", "mxfp4")})


def supports(layout: str, kind: str) -> bool:
    return (layout, kind) in SUPPORTED


def fused_moe(x, tensors, layer, topk_weights, topk_ids):
    """Routed experts' output ``[M, H]`` in ``x.dtype`` for ``x [M, H]`` and global ``topk_ids [M, k]``."""
    # a submodule named fused_moe would replace this function on the package once imported
    if layer.entry.layout.name == "triton-fast":
        from moeconvert.kernels.adapter import layer_forward
    else:
        from moeconvert.kernels.moe_wna16 import fused_moe as layer_forward

    return layer_forward(x, tensors, layer, topk_weights, topk_ids)
