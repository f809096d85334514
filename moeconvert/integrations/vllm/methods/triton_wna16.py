"""vLLM's Triton WNA16 MoE kernel (``fused_moe_kernel_gptq_awq``, ``TritonWNA16Experts``)."""

from __future__ import annotations

from moeconvert.integrations.vllm.methods.marlin import MarlinWNA16Method


class TritonWNA16Method(MarlinWNA16Method):
    """``triton`` WNA16 (int4 sym / asym, int8 sym): vLLM's ``TritonWNA16Experts`` over its Triton kernel
    ``fused_moe_kernel_gptq_awq``, built as vLLM's compressed-tensors WNA16 method builds it after its
    TRITON conversion (what ``--moe-backend triton`` gives)."""

    backend = "TRITON"

    @staticmethod
    def _experts_cls():
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonWNA16Experts

        return TritonWNA16Experts
