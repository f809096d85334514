"""humming-kernels' grouped GEMM as vLLM builds it (``select_humming_moe_experts``): WNA16, MXFP4 and NVFP4
folders."""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.integrations.vllm.methods.base import FinalLayoutMethod, MXFP4Method, RankShare


class HummingWNA16Method(FinalLayoutMethod):
    """``humming`` WNA16 (int4 / int8, group or channel, sym or asym, unsigned or sign-magnitude codes): vLLM's
    humming experts over humming-kernels' grouped GEMM, built as vLLM's compressed-tensors WNA16 method builds
    them after ``convert_to_humming_moe_kernel_format`` (what vLLM 0.33.0 picks on SM90), with the parameters
    the folder holds in place of the transformed ones.

    The weight and input schemas and each sublayer's humming ``LayerConfig`` are made by humming's own
    ``prepare_layer_config`` (the first half of ``prepare_and_transform_humming_tensors``; the second,
    ``transform_humming_tensors``, is what the folder holds already) from what the manifest records: the
    scheme, and per sublayer the weight dtype the conversion chose (docs/layouts/humming.md)."""

    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        super().__init__(moe, entry, manifest, share)
        scheme = entry["scheme"]
        self.num_bits, self.group_size, self.symmetric = scheme["bits"], scheme["group_size"], scheme["symmetric"]
        self.made_for = manifest["layout"]["made_for"]
        self.metadata = (share.stored.get("rank_layout_metadata", [None] * share.tp_size)[share.tp_rank]
                         or share.stored["layout_metadata"]) if share and share.stored else entry["layout_metadata"]

    @staticmethod
    def _experts_cls():
        return None  # chosen from vLLM's humming experts once the platform is checked (create_weights)

    # -- what the folder was made for, checked before any byte is read ------------------------------------

    def _check_humming(self, layer) -> None:
        """One line for each thing this vLLM would do otherwise than the folder's bytes assume: no humming,
        another humming, a GPU that is not the folder's SM, humming activations that are not 16-bit."""
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import has_humming

        problem = self._vllm_state_problem()
        if problem:
            raise self._refuse(f"{problem}: {self._instead()}")
        want = self.made_for.get("humming-kernels")
        if not has_humming():
            raise self._refuse(f"this folder holds humming-kernels {want}'s bytes and this Python has no humming "
                               f"(import humming fails): pip install --no-deps humming-kernels=={want} "
                               f"(vLLM 0.33.0's pin), or {self._elsewhere()}")
        import humming

        have = getattr(humming, "__version__", None)
        if have != want:
            raise self._refuse(f"this folder holds humming-kernels {want}'s bytes; this Python has humming-kernels "
                               f"{have}, whose transform may differ: install humming-kernels=={want} "
                               f"(vLLM 0.33.0's pin), or {self._elsewhere()}")
        sm = self.made_for.get("sm")
        cap = current_platform.get_device_capability()  # None off GPUs
        # humming transforms weights per GPU architecture (LayerConfig.sm_version decides raw / flat / native
        # dequant layouts) and refuses to run a config made for another SM (LayerConfig.check_device): the
        # folder's bytes are made and checked for one SM only, so any other GPU is refused, not warned about
        if cap is None or str(cap.to_int()) != sm:
            where = f"an SM{cap.to_int()} GPU" if cap is not None else f"its {current_platform.device_type} platform"
            raise self._refuse(f"this folder holds humming's SM{sm} bytes (H100 / H200) and vLLM runs on {where}: "
                               f"humming lays weights out per GPU architecture; {self._elsewhere()}")
        input_schema = self._input_schema(layer, self._weight_schema("w13"))
        bits = input_schema.a_dtype.num_bits if input_schema.a_dtype is not None else 16
        if bits != 16:
            raise self._refuse(f"VLLM_HUMMING_INPUT_QUANT_CONFIG makes humming quantize this layer's activations "
                               f"to {input_schema.a_dtype}; this folder's humming bytes are made for 16-bit "
                               "activations in the model dtype: unset it for this model, or list the layer under "
                               "its ignored_layers")

    def _vllm_state_problem(self) -> str | None:
        from moeconvert.layouts.humming import vllm_state_problem

        return vllm_state_problem(self.symmetric, self.group_size)

    def _weight_key(self, params_dtype: torch.dtype):
        """The weight key vLLM's oracle chooses among its humming experts with: for WNA16, the checkpoint's
        integer weight key (the unsigned codes, before humming's sign-magnitude choice)."""
        from vllm.model_executor.layers.quantization.utils.humming.schema import weight_schema_to_quant_key

        unsigned = dataclasses.replace(self._weight_schema("w13"), b_dtype=self._dtype(f"uint{self.num_bits}"))
        return weight_schema_to_quant_key(unsigned, params_dtype)

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        self._check_humming(layer)
        from vllm.model_executor.layers.quantization.utils.humming import select_humming_moe_experts

        self.experts_cls = select_humming_moe_experts(self.moe, self._weight_key(params_dtype), None)
        if self.experts_cls is None:
            raise self._refuse("none of vLLM's humming experts supports this deployment (vLLM's oracle says why "
                               f"at debug level); {self._elsewhere()}")
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)

    # -- humming's schemas and LayerConfig, without transforming ------------------------------------------

    @staticmethod
    def _dtype(name: str):
        from vllm.utils.humming import dtypes

        return dtypes.DataType.from_str(name)

    def _weight_schema(self, sub: str):
        """humming's weight schema for a sublayer (``moeconvert.layouts.humming``, shared with the runtime)."""
        from moeconvert.errors import MoeConvertError
        from moeconvert.layouts.humming import humming_weight_schema

        try:
            return humming_weight_schema(self.metadata, sub, group_size=self.group_size, symmetric=self.symmetric)
        except MoeConvertError as e:
            raise self._refuse(e.line()) from None

    @staticmethod
    def _input_schema(layer, weight_schema):
        """The input schema vLLM's ``convert_to_humming_moe_kernel_format`` settles on for this layer: from
        ``VLLM_HUMMING_INPUT_QUANT_CONFIG`` (16-bit when unset or when it skips the layer), then vLLM's own
        ``check_and_fallback_input_schema``."""
        from vllm import envs
        from vllm.model_executor.layers.quantization.utils.humming import schema as hs
        from vllm.utils.humming import HummingInputSchema

        config = dict(envs.VLLM_HUMMING_INPUT_QUANT_CONFIG or {})
        allow_fallback = True
        if hs.humming_is_layer_skipped(config, layer.layer_name):
            schema = HummingInputSchema()
        else:
            config = hs.resolve_humming_layer_config(config, layer.layer_name)
            allow_fallback = config.pop("allow_fallback", False)
            schema = HummingInputSchema.from_config(config)
        return hs.check_and_fallback_input_schema(weight_schema=weight_schema, input_schema=schema,
                                                  param_dtype=layer.params_dtype, allow_fallback=allow_fallback)

    def _humming_configs(self, layer) -> None:
        """``layer.weight_schemas``, ``layer.input_schemas`` and ``layer.humming_configs`` as vLLM's conversion
        leaves them: each sublayer's schema and ``LayerConfig`` from ``moeconvert.layouts.humming.humming_configs``
        (humming's own ``prepare_layer_config``, the runtime's humming kernel builds its configs there too),
        with vLLM's sizes, dtype and input schemas, checked against every field the folder records."""
        from moeconvert.errors import MoeConvertError

        mc = layer.moe_config
        if not mc.activation.is_gated:
            raise self._refuse(f"vLLM builds this layer with the non-gated activation {mc.activation}; the humming "
                               "layout holds gated experts (w13 = gate and up rows)")
        input_schemas = {sub: self._input_schema(layer, self._weight_schema(sub)) for sub in ("w13", "w2")}
        try:
            subs = self._configs(hidden_size=mc.hidden_dim, intermediate_size=mc.intermediate_size_per_partition,
                                 num_experts=mc.num_local_experts, has_bias=mc.has_bias, dtype=layer.params_dtype,
                                 input_schemas=input_schemas, device=layer.w13_weight.device)
        except MoeConvertError as e:
            raise self._refuse(e.line()) from None
        layer.weight_schemas = {sub: s.weight_schema for sub, s in subs.items()}
        layer.input_schemas = input_schemas
        layer.humming_configs = {sub: s.config for sub, s in subs.items()}

    def _configs(self, **kw):
        from moeconvert.layouts.humming import humming_configs

        return humming_configs(self.metadata, group_size=self.group_size, symmetric=self.symmetric, **kw)

    def get_fused_moe_quant_config(self, layer):
        from vllm.model_executor.layers.quantization.utils.humming import get_humming_moe_quant_config

        self._humming_configs(layer)
        # as CompressedTensorsWNA16MoEMethod.get_fused_moe_quant_config for its HUMMING backend
        return get_humming_moe_quant_config(layer, gemm1_alpha=getattr(layer, "swiglu_alpha", None),
                                            gemm1_beta=getattr(layer, "swiglu_beta", None),
                                            gemm1_clamp_limit=getattr(layer, "swiglu_limit", None))

    def _make_kernel(self, layer):
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend, make_wna16_moe_kernel

        return make_wna16_moe_kernel(moe_quant_config=self.moe_quant_config, moe_config=self.moe,
                                     experts_cls=self.experts_cls, backend=WNA16MoEBackend.HUMMING,
                                     routing_tables=layer._expert_routing_tables())


class HummingMXFP4Method(MXFP4Method, HummingWNA16Method):
    """``humming`` MXFP4 (``moeconvert quantize --format mxfp4 --backend humming``): vLLM's humming experts over
    humming-kernels' grouped GEMM with e2m1 weights and e8m0 scales, built as vLLM's ``Mxfp4MoEMethod`` builds
    them for its HUMMING backend (what vLLM 0.33.0 picks on SM90 for MXFP4 experts outside gpt-oss) after
    ``convert_to_humming_moe_kernel_format``, with the parameters the folder holds in place of the transformed
    ones, over I rounded up to 64 as vLLM rounds it for HUMMING. The schemas and LayerConfigs come from
    humming's own ``Mxfp4WeightSchema`` and ``prepare_layer_config`` (``layouts/humming_mxfp4.py``), checked
    against the manifest's; the refusals are the WNA16 method's (docs/layouts/humming.md, "MXFP4")."""

    backend = "HUMMING"

    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        FinalLayoutMethod.__init__(self, moe, entry, manifest, share)
        self.made_for = manifest["layout"]["made_for"]
        self.metadata = share.stored["layout_metadata"] if share and share.stored else entry["layout_metadata"]

    def _vllm_state_problem(self) -> str | None:
        return None

    def _weight_key(self, params_dtype: torch.dtype):
        # vLLM's MXFP4 oracle checks its HUMMING experts with the static MXFP4 weight key, 16-bit activations
        from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static

        return kMxfp4Static

    def _weight_schema(self, sub: str):
        from moeconvert.layouts.humming_mxfp4 import MODEL_DTYPE, mxfp4_weight_schema

        return mxfp4_weight_schema(MODEL_DTYPE)

    def _configs(self, **kw):
        from moeconvert.layouts.humming_mxfp4 import HummingMXFP4Layout

        return HummingMXFP4Layout().humming_sublayers(self.metadata, None, **kw)

    def get_fused_moe_quant_config(self, layer):
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend, make_mxfp4_moe_quant_config

        self._humming_configs(layer)
        # as vLLM's Mxfp4MoEMethod.get_fused_moe_quant_config for its HUMMING backend
        return make_mxfp4_moe_quant_config(mxfp4_backend=Mxfp4MoeBackend.HUMMING, w1_scale=layer.w13_weight_scale,
                                           w2_scale=layer.w2_weight_scale, w1_bias=getattr(layer, "w13_bias", None),
                                           w2_bias=getattr(layer, "w2_bias", None),
                                           swiglu_limit=getattr(layer, "swiglu_limit", None), layer=layer)


class HummingNVFP4Method(HummingWNA16Method):
    """``humming`` NVFP4 (compressed-tensors ``nvfp4-pack-quantized`` sources): vLLM's humming experts over
    humming-kernels' grouped GEMM with e2m1 weights, e4m3 group-16 scales and one fp32 secondary scale per
    expert, built as vLLM's ``CompressedTensorsW4A4Nvfp4MoEMethod`` builds them for its HUMMING backend (what
    vLLM picks for NVFP4 experts on SM90, ahead of Marlin) after ``convert_to_humming_moe_kernel_format``, with
    16-bit activations, over the parameters the folder holds. The schemas and LayerConfigs come from humming's
    own compressed-tensors NVFP4 schema and ``prepare_layer_config`` (``layouts/humming_nvfp4.py``), checked
    against the manifest's; the refusals are the WNA16 method's (docs/layouts/humming.md, "NVFP4")."""

    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        FinalLayoutMethod.__init__(self, moe, entry, manifest, share)
        self.made_for = manifest["layout"]["made_for"]
        self.metadata = share.stored["layout_metadata"] if share and share.stored else entry["layout_metadata"]

    def _vllm_state_problem(self) -> str | None:
        return None

    def _weight_key(self, params_dtype: torch.dtype):
        # vLLM's compressed-tensors NVFP4 method selects its experts with the static NVFP4 weight key
        from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Static

        return kNvfp4Static

    def _weight_schema(self, sub: str):
        from moeconvert.layouts.humming_nvfp4 import nvfp4_weight_schema

        # the NVFP4 schema holds no dtype of the model's (e4m3 scales, fp32 secondary scale)
        return nvfp4_weight_schema(torch.bfloat16)

    def _configs(self, **kw):
        from moeconvert.layouts.humming_nvfp4 import HummingNVFP4Layout

        return HummingNVFP4Layout().humming_sublayers(self.metadata, None, **kw)

    # get_fused_moe_quant_config: the WNA16 method's, as vLLM's make_nvfp4_moe_quant_config for HUMMING is
    # get_humming_moe_quant_config with the layer's swiglu constants

    def _make_kernel(self, layer):
        from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend, make_nvfp4_moe_kernel

        kernel = make_nvfp4_moe_kernel(moe_quant_config=self.moe_quant_config, moe_config=self.moe,
                                       experts_cls=self.experts_cls, backend=NvFp4MoeBackend.HUMMING,
                                       routing_tables=layer._expert_routing_tables())
        kernel.fused_experts.process_weights_after_loading(layer)  # as vLLM's NVFP4 method does
        return kernel
