"""vLLM's Marlin MoE kernel (``moe_wna16_marlin_gemm``, ``MarlinExperts``): WNA16 and MXFP4 folders."""

from __future__ import annotations

from moeconvert.integrations.vllm.methods.base import FinalLayoutMethod, MXFP4Method, RankShare


class MarlinWNA16Method(FinalLayoutMethod):
    """``marlin`` WNA16 (int4 / int8, group or channel, sym or asym): vLLM's ``MarlinExperts`` over
    ``moe_wna16_marlin_gemm``, built the way vLLM's compressed-tensors WNA16 method builds it after its
    own repack."""

    backend = "MARLIN"

    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        super().__init__(moe, entry, manifest, share)
        scheme = entry["scheme"]
        self.num_bits = scheme["bits"]
        self.group_size = scheme["group_size"]

    def get_fused_moe_quant_config(self, layer):
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import make_wna16_moe_quant_config

        return make_wna16_moe_quant_config(
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale, group_size=self.group_size,
            num_bits=self.num_bits, w1_zp=getattr(layer, "w13_weight_zero_point", None),
            w2_zp=getattr(layer, "w2_weight_zero_point", None), w1_bias=getattr(layer, "w13_bias", None),
            w2_bias=getattr(layer, "w2_bias", None), gemm1_clamp_limit=None, gemm1_alpha=None, gemm1_beta=None)

    def _make_kernel(self, layer):
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend, make_wna16_moe_kernel

        return make_wna16_moe_kernel(moe_quant_config=self.moe_quant_config, moe_config=self.moe,
                                     experts_cls=self.experts_cls, backend=WNA16MoEBackend[self.backend],
                                     routing_tables=layer._expert_routing_tables())


class MarlinMXFP4Method(MXFP4Method):
    """``marlin`` MXFP4 (``moeconvert quantize --format mxfp4``, and gpt-oss): vLLM's ``MarlinExperts`` with
    e2m1 weights and e8m0 scales, over H and I zero-padded as vLLM pads them for Marlin (the folder holds
    them padded)."""


    def get_fused_moe_quant_config(self, layer):
        from vllm.model_executor.layers.fused_moe.config import mxfp4_w4a16_moe_quant_config

        return mxfp4_w4a16_moe_quant_config(w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
                                            w1_bias=getattr(layer, "w13_bias", None),
                                            w2_bias=getattr(layer, "w2_bias", None), **self._activation_constants())
