"""triton_kernels' ``matmul_ogs`` as vLLM's TRITON MXFP4 backend runs it (gpt-oss folders)."""

from __future__ import annotations

import torch

from moeconvert.integrations.vllm.methods.base import MXFP4Method, RankShare


class TritonMXFP4Method(MXFP4Method):
    """``triton`` MXFP4 (gpt-oss): vLLM's triton_kernels experts for its TRITON backend (``matmul_ogs`` with the
    fused swiglu epilogue; the first of ``OAITritonMxfp4ExpertsMonolithic`` and ``OAITritonExperts`` that
    supports the layer, as vLLM picks), over the folder's swizzled buffers wrapped as triton_kernels tensors
    without moving a byte (docs/layouts/triton-mxfp4.md, "Loader recipe"). The parameters stay the folder's
    bytes; the wrappers are views of them, held by the method."""

    backend = "TRITON"

    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        super().__init__(moe, entry, manifest, share)
        self.w13_tk = self.w2_tk = None

    def _experts_cls(self):
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend, backend_to_kernel_cls
        from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static

        why = None
        for cls in backend_to_kernel_cls(Mxfp4MoeBackend.TRITON):  # vLLM's preference order
            ok, why = cls.is_supported_config(cls, self.moe, kMxfp4Static, None, mk.FusedMoEActivationFormat.Standard)
            if ok:
                return cls
        raise ValueError(f"moeconvert: {self.moe.moe_parallel_config}: vLLM's triton_kernels MXFP4 experts do not "
                         f"run this layer ({why})")

    def _wrap(self, layer, gemm: str):
        """One GEMM's weight and precision config as triton_kernels objects over the parameters' ``.mT`` views
        (the recipe's ``rebuild``; the manifest's ``layout_metadata`` for this rank's sizes)."""
        from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
        from triton_kernels.numerics import InFlexData
        from triton_kernels.tensor import FP4, Storage, Tensor
        from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

        m = self._metadata()[gemm]
        E = getattr(layer, f"{gemm}_weight").shape[0]  # this rank's experts
        logical, scale_shape = [E, *m["logical_shape"][1:]], [E, *m["scale_shape"][1:]]
        vl, sl = m["value_layout"], m["scale_layout"]
        w = Tensor(Storage(getattr(layer, f"{gemm}_weight").data.mT,
                           HopperMXValueLayout([E, *vl["shape"][1:]], mx_axis=vl["mx_axis"],
                                               mma_version=vl["mma_version"])),
                   dtype=FP4, shape=logical, shape_max=logical)
        s = Tensor(Storage(getattr(layer, f"{gemm}_weight_scale").data.mT,
                           HopperMXScaleLayout([E, *sl["shape"][1:]], mx_axis=sl["mx_axis"], num_warps=sl["num_warps"])),
                   dtype=torch.uint8, shape=scale_shape)
        return w, PrecisionConfig(weight_scale=s, flex_ctx=FlexCtx(rhs_data=InFlexData()))

    def _metadata(self) -> dict:
        """The layout's metadata for this rank's sizes: the stored TP size's, the layout's own for a TP cut
        (its rank shape), else the layer's."""
        if self.share.stored:
            return self.share.stored["layout_metadata"]
        if self.share.tp_size > 1:
            from moeconvert.layouts import get_layout
            from moeconvert.layouts.output import layer_shape_from_manifest, parse_scheme, rank_shape

            layout = get_layout("triton", "mxfp4")
            scheme = parse_scheme(self.entry["scheme"], "scheme")
            shape = layer_shape_from_manifest(self.entry, self.manifest_dtype)
            return layout.layer_metadata(rank_shape(shape, layout, scheme, self.share.tp_size), scheme)
        return self.entry["layout_metadata"]

    def process_weights_after_loading(self, layer) -> None:
        # vLLM's TRITON path sets these process-wide when it swizzles (mxfp4_utils._swizzle_mxfp4); the bytes
        # were made for them: split_k 1 on SM90 (layout_metadata's opt_flags_constraints)
        from vllm.platforms import current_platform

        if current_platform.is_cuda() and current_platform.is_device_capability(90):
            from triton_kernels.matmul_ogs_details.opt_flags import update_opt_flags_constraints

            update_opt_flags_constraints(self.entry["layout_metadata"]["opt_flags_constraints"])
        (self.w13_tk, self.w13_precision), (self.w2_tk, self.w2_precision) = self._wrap(layer, "w13"), self._wrap(layer, "w2")
        super().process_weights_after_loading(layer)

    def get_fused_moe_quant_config(self, layer):
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend, make_mxfp4_moe_quant_config

        c = self._activation_constants()
        return make_mxfp4_moe_quant_config(
            mxfp4_backend=Mxfp4MoeBackend.TRITON, w1_scale=self.w13_precision, w2_scale=self.w2_precision,
            w1_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
            gemm1_alpha=c["gemm1_alpha"], gemm1_beta=c["gemm1_beta"], swiglu_limit=c["gemm1_clamp_limit"], layer=layer)

    def _kernel_weights(self, layer) -> tuple:
        return self.w13_tk, self.w2_tk
