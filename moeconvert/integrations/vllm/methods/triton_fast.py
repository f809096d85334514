"""moeconvert's own ``fused_moe_fast`` as vLLM modular experts (``triton-fast`` folders)."""

from __future__ import annotations

import torch

from moeconvert.integrations.vllm.methods.base import FinalLayoutMethod, RankShare


class TritonFastMethod(FinalLayoutMethod):
    """``triton-fast`` (moeconvert's own layout; int4 / int8 in groups or channelwise, with or without zero
    points, MXFP4; biases; silu and swigluoai): moeconvert's own ``fused_moe_fast`` as vLLM modular experts
    (:class:`~moeconvert.integrations.vllm.fast_experts.MoeconvertFastExperts`) behind the prepare / finalize
    step vLLM makes for the layer's parallel shape. The parameters hold the folder's bytes; nothing is
    processed. The kernel needs CUDA (or Triton's interpreter): anything else is refused when the layer is
    built, before a byte is read."""


    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        super().__init__(moe, entry, manifest, share)
        from moeconvert.integrations.vllm.fast_experts import FastFormat

        scheme = entry["scheme"]
        mx = scheme["kind"] == "mxfp4"
        self.fast = FastFormat(fmt="mxfp4" if mx else f"int{scheme['bits']}", group_size=32 if mx else
                               scheme["group_size"])

    @staticmethod
    def _experts_cls():
        from moeconvert.integrations.vllm.fast_experts import MoeconvertFastExperts

        return MoeconvertFastExperts

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        """MXFP4 folders hold H and I rounded up to 64 (the layout's ``pad_multiples``): vLLM then pads x to
        H and cuts the output back, as it does for its own MXFP4 kernels."""
        H, I = super().maybe_roundup_sizes(hidden_size, intermediate_size_per_partition, act_dtype,
                                           moe_parallel_config)
        if self.fast.fmt != "mxfp4":
            return H, I
        from moeconvert.layouts import get_layout
        from moeconvert.layouts.base import padded_sizes

        return padded_sizes(H, I, get_layout("triton-fast", "mxfp4").pad_multiples)

    def _sizes(self, entry: dict | None = None) -> tuple[int, int]:
        e = entry or self.entry
        return e.get("hidden_size_padded", e["hidden_size"]), e.get("intermediate_size_padded",
                                                                    e["intermediate_size"])

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk

        from moeconvert.integrations.vllm.fast_experts import runs_here

        why = runs_here()
        if why is None:
            ok, why = self.experts_cls.is_supported_config(self.experts_cls, self.moe, None, None,
                                                           mk.FusedMoEActivationFormat.Standard)
            why = None if ok else f"vLLM's modular kernel cannot take moeconvert's experts here: {why}"
        if why is not None:
            raise self._refuse(f"{why}; {self._elsewhere()}")
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer):
        """vLLM's quant config for 16-bit activations over the parameters themselves (the experts read their
        scales, zero points, biases and swigluoai's constants there; nothing quantizes the input)."""
        bias = {"w1_bias": getattr(layer, "w13_bias", None), "w2_bias": getattr(layer, "w2_bias", None),
                **self._activation_constants()}
        if self.fast.fmt == "mxfp4":
            from vllm.model_executor.layers.fused_moe.config import mxfp4_w4a16_moe_quant_config

            return mxfp4_w4a16_moe_quant_config(w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
                                                **bias)
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import make_wna16_moe_quant_config

        return make_wna16_moe_quant_config(
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale, group_size=self.fast.group_size,
            num_bits=int(self.fast.fmt[3:]), w1_zp=getattr(layer, "w13_weight_zero_point", None),
            w2_zp=getattr(layer, "w2_weight_zero_point", None), **bias)

    def _make_kernel(self, layer):
        """vLLM's prepare / finalize for this layer (``maybe_make_prepare_finalize``, as its WNA16 and MXFP4
        oracles call it) around our experts."""
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize

        from moeconvert.kernels.moe_fast import FastWeights, mx_small_scales

        prepare_finalize = maybe_make_prepare_finalize(moe=self.moe, quant_config=self.moe_quant_config,
                                                       routing_tables=layer._expert_routing_tables(),
                                                       allow_new_interface=True, use_monolithic=False)
        if prepare_finalize is None or prepare_finalize.activation_format != mk.FusedMoEActivationFormat.Standard:
            raise self._refuse(f"vLLM dispatches this layer's tokens with {type(prepare_finalize).__name__}, whose "
                               "batched format moeconvert's experts do not take; serve without that all2all backend")
        small = False
        if self.fast.fmt == "mxfp4":  # one host read of the scales, here, never during a CUDA graph capture
            small = mx_small_scales(FastWeights(layer.w13_weight, layer.w13_weight_scale),
                                    FastWeights(layer.w2_weight, layer.w2_weight_scale))
        experts = self.experts_cls(self.moe, self.moe_quant_config, self.fast, mx_small_scales=small)
        return mk.FusedMoEKernel(prepare_finalize, experts)
