"""moeconvert's own Triton kernels (docs/kernels.md): plain tensors and numbers in, no manifest.

* kernels/moe_fast.py ``fused_moe_fast``: the kernel of the ``triton-fast`` layouts (WNA16 int4/int8,
  MXFP4), one layer call: align.py, gemm.py with dequant.py, pdl.py; tuned tiles in configs.py;
* kernels/moe_wna16.py ``fused_moe_wna16``: the kernel of vLLM's WNA16 ``triton`` layout.

The runtime calls them through its ``triton`` kernel adapter (runtime/moeconvert_triton.py), which the
layouts that name ``triton`` are dispatched to (runtime/dispatch.py).
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
