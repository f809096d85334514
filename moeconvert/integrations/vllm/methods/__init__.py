"""The plugin's MoE methods: vLLM's expert parameters in the folder's final layout, loaded unchanged.

One module per kernel family, each method named by the layouts it serves (``Layout.vllm_method``):
``marlin`` (vLLM's Marlin, WNA16 and MXFP4), ``triton_wna16`` (vLLM's Triton WNA16), ``triton_mxfp4``
(triton_kernels, gpt-oss), ``humming`` (humming-kernels, WNA16 and MXFP4) and ``triton_fast``
(moeconvert's own kernel). What they share is in ``base``: ``create_weights`` makes each parameter with
the shape and dtype the manifest records, cut for this rank (:class:`RankShare`); each parameter's
loader copies the rank's bytes of the file's tensor into it as they are; ``process_weights_after_loading``
checks every tensor arrived and builds the kernel over the parameters: no repack, no second copy.
"""

from __future__ import annotations

from moeconvert.integrations.vllm.methods.base import FinalLayoutMethod, RankShare, local_experts, other_tensors
from moeconvert.integrations.vllm.methods.humming import HummingMXFP4Method, HummingWNA16Method
from moeconvert.integrations.vllm.methods.marlin import MarlinMXFP4Method, MarlinWNA16Method
from moeconvert.integrations.vllm.methods.triton_fast import TritonFastMethod
from moeconvert.integrations.vllm.methods.triton_mxfp4 import TritonMXFP4Method
from moeconvert.integrations.vllm.methods.triton_wna16 import TritonWNA16Method

__all__ = ["FinalLayoutMethod", "RankShare", "local_experts", "other_tensors", "MarlinWNA16Method",
           "MarlinMXFP4Method", "TritonWNA16Method", "TritonMXFP4Method", "HummingWNA16Method",
           "HummingMXFP4Method", "TritonFastMethod"]
