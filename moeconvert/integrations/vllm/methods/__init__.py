"""The plugin's MoE methods: vLLM's expert parameters in the folder's final layout, loaded unchanged.

One module per kernel family, each method declaring what it serves in one spec (``spec.py``, read
without vLLM by the converter too): ``marlin`` (vLLM's Marlin: WNA16, MXFP4, NVFP4), ``triton_wna16``
(vLLM's Triton WNA16), ``triton_mxfp4`` (triton_kernels, gpt-oss), ``humming`` (humming-kernels, WNA16,
MXFP4 and NVFP4) and ``triton_fast`` (moeconvert's own kernel). What they share is in ``base``:
``create_weights`` makes each parameter with the shape and dtype the manifest records, cut for this rank
(``RankShare``); each parameter's loader copies the rank's bytes of the file's tensor into it as they are;
``process_weights_after_loading`` checks every tensor arrived and builds the kernel over the parameters:
no repack, no second copy. Adding a method is its module and its spec; nothing here names it.
"""

from __future__ import annotations

import importlib

from moeconvert.integrations.vllm.methods.spec import SPECS


def method_class(name: str):
    """The method class a layout names (``Layout.vllm_method``), imported from its module (imports vLLM)."""
    return getattr(importlib.import_module(f"{__name__}.{SPECS[name].module}"), name)
