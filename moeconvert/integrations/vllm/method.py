"""Our MoE methods: vLLM's expert parameters in the folder's final Marlin layout, loaded unchanged.

``create_weights`` makes each parameter with the shape and dtype the manifest records, cut for this rank
(its experts, its TP slice: :class:`RankShare`); each parameter's loader copies the rank's bytes of the
file's tensor into it as they are (the file's tensor of the manifest's shape and dtype, or an error naming
both); ``process_weights_after_loading`` checks every tensor arrived and builds vLLM's kernel over the
parameters as they are: no repack, no permutation, no second copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from moeconvert.format import DTYPES
from moeconvert.layouts.base import TPCut


@dataclass(frozen=True)
class RankShare:
    """What one rank of vLLM's layer takes of the folder's stacked tensors (``MoeconvertConfig._check_parallel``).

    ``experts_from_layer``: the folder holds every expert and the rank takes those vLLM's expert map gives
    the layer (read from the layer when the tensors arrive), else the folder is the rank's own. ``cuts``:
    the layout's TP cut of each tensor (``Layout.tp_cuts``), for TP rank ``tp_rank`` of ``tp_size``."""

    experts_from_layer: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    cuts: dict[str, TPCut] = field(default_factory=dict)
    #: the layer's ``tp_sizes`` entry for ``tp_size`` where its rank tensors are stored (``--tp-sizes``):
    #: ``{prefix}.tp{T}.{suffix}``, ``[T, E, ...]``, this rank's at ``[tp_rank]``
    stored: dict | None = None

    def tensors(self, entry: dict) -> dict[str, dict]:
        """suffix -> the manifest entry of the folder tensor this rank reads for it."""
        return self.stored["tensors"] if self.stored else entry["tensors"]

    def names(self, entry: dict) -> dict[str, str]:
        """The layer-relative names of the tensors this rank reads -> their parameter (suffix)."""
        if self.stored:
            return {f"tp{self.tp_size}.{suffix}": suffix for suffix in self.stored["tensors"]}
        return {suffix: suffix for suffix in entry["tensors"]}


def other_tensors(entry: dict) -> set[str]:
    """Layer-relative names of every stacked tensor of a layer entry (the full ones, each stored TP size's)."""
    names = set(entry["tensors"])
    for key, v in entry.get("tp_sizes", {}).items():
        if v["stored"]:
            names |= {f"tp{key}.{suffix}" for suffix in v["tensors"]}
    return names


def local_experts(layer) -> list[int]:
    """The folder's (logical) expert each local slot of vLLM's layer holds, in slot order.

    vLLM's expert map (``ExpertMapManager.expert_map``: physical expert -> local slot, -1 elsewhere; None
    without EP) says which physical experts the rank owns under whatever placement it chose ("linear",
    "round_robin"); with EPLB's redundant experts a physical expert is a copy of the logical one vLLM's
    initial arrangement gives it (``EplbState.build_initial_global_physical_to_logical_map``, which vLLM's
    per-expert checkpoint mapping uses too: ``RoutedExperts.build_expert_params_mapping``)."""
    emap = layer.expert_map_manager.expert_map
    if emap is None:
        physical = list(range(layer.local_num_experts))
    else:
        owned = torch.nonzero(emap >= 0).flatten()
        physical = owned[torch.argsort(emap[owned])].tolist()
    n_logical = layer.moe_config.num_logical_experts
    if layer.global_num_experts == n_logical:
        return physical
    from vllm.distributed.eplb.eplb_state import EplbState

    to_logical = EplbState.build_initial_global_physical_to_logical_map(
        n_logical, layer.global_num_experts - n_logical)
    return [to_logical[p] for p in physical]


def _expert_runs(experts: list[int]) -> list[tuple[int, slice]]:
    """``(first local slot, slice of the stacked tensor)`` runs covering ``experts``: one strided slice for
    linear and round-robin placements (a view, one copy), one slice an expert otherwise."""
    if len(experts) == 1:
        return [(0, slice(experts[0], experts[0] + 1))]
    step = experts[1] - experts[0]
    if step > 0 and all(b - a == step for a, b in zip(experts, experts[1:])):
        return [(0, slice(experts[0], experts[-1] + 1, step))]
    return [(i, slice(e, e + 1)) for i, e in enumerate(experts)]


class _FinalLayoutMethod(FusedMoEMethodBase):
    """What every method shares: parameters from the manifest, exact loading, the kernel over them."""

    #: vLLM's EPLB moves whole experts between ranks (``RoutedExperts.get_expert_weights`` views each
    #: parameter ``[E_local, -1]``), which every layout allows; the plugin follows vLLM's own method for
    #: the same kernel, which is what vLLM was checked with (set per method below)
    supports_eplb = False

    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        super().__init__(moe)
        self.experts_cls = self._experts_cls()
        self.entry = entry
        self.partition = manifest["partition"]
        self.manifest_dtype = manifest["dtype"]
        self.share = share or RankShare()
        self.loaded: dict[str, int] = {}

    @staticmethod
    def _experts_cls():
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts

        return MarlinExperts

    def _sizes(self, entry: dict | None = None) -> tuple[int, int]:
        """(H, I per partition) the layer's parameters are made for, from the layer's entry (or a stored TP
        size's entry over it)."""
        e = entry or self.entry
        return e["hidden_size"], e["intermediate_size"]

    def _refuse(self, what: str) -> ValueError:
        return ValueError(f"moeconvert: {self.entry['prefix']}: {what}")

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        e, share = self.entry, self.share
        H, I = self._sizes()
        T = share.tp_size
        per_partition = I // T if I % T == 0 else I / T
        if share.stored:  # the rank's own sizes (MXFP4: its I padded on its own)
            H, per_partition = self._sizes({**e, **share.stored})
        want = {"hidden size": (hidden_size, H), "intermediate size per partition": (intermediate_size_per_partition,
                                                                                     per_partition)}
        if share.experts_from_layer:
            experts = local_experts(layer)
            want["experts on this rank"] = (num_experts, len(experts))
            held = f"all {e['num_experts']} experts at TP 1 (a rank takes its experts and its TP cut)"
        else:
            experts = None
            want["experts on this rank"] = (num_experts, e["num_experts"])
            held = f"TP {self.partition['tp_size']}, EP {self.partition['ep_size']}"
        for what, (vllm_has, folder_has) in want.items():
            if vllm_has != folder_has:
                raise self._refuse(f"vLLM builds this layer with {what} {vllm_has}; the folder was converted for "
                                   f"{folder_has} ({held})")
        for suffix, t in share.tensors(e).items():
            dtype = DTYPES[t["dtype"]][1]
            shape = list(t["shape"][1:] if share.stored else t["shape"])
            if experts is not None:
                shape[0] = len(experts)
            cut = share.cuts.get(suffix) if T > 1 and not share.stored else None
            if cut is not None:
                shape = list(cut.rank_shape(tuple(shape), T))
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = self._loader(layer, suffix, tuple(t["shape"]), dtype, cut)
            layer.register_parameter(suffix, param)
        layer.load_weights = self._load_weights(layer)

    def _load_weights(self, layer):
        """This layer's ``load_weights``: vLLM's own (``RoutedExperts.load_weights``) matches only
        per-expert and fused checkpoint names and drops a stacked ``w13_weight`` without a word, so our
        tensors (names relative to the layer, or to its runner) go to their parameters here and anything
        else to vLLM's."""
        ours = self.share.names(self.entry)
        skip = other_tensors(self.entry) - set(ours)  # the full tensors a stored TP size replaces, other sizes'
        theirs = type(layer).load_weights

        def load_weights(weights):
            rest = []
            for name, tensor in weights:
                rel = name.removeprefix("routed_experts.")
                if rel in ours:
                    param = getattr(layer, ours[rel])
                    param.weight_loader(param, tensor)
                    yield ours[rel]
                elif rel not in skip:
                    rest.append((name, tensor))
            if rest:
                yield from theirs(layer, rest)

        return load_weights

    def _loader(self, layer, suffix: str, shape: tuple, dtype: torch.dtype, cut: TPCut | None):
        """The parameter's ``weight_loader``: the folder's whole tensor in, this rank's bytes of it copied
        into the parameter (its experts, as vLLM's expert map gives them when the tensor arrives; its TP
        cut), nothing else read."""
        share = self.share

        def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
            if tuple(loaded_weight.shape) != shape or loaded_weight.dtype != dtype:
                raise self._refuse(f"{suffix}: the file holds {tuple(loaded_weight.shape)} {loaded_weight.dtype}, "
                                   f"the layout {shape} {dtype}")
            if share.stored:
                loaded_weight = loaded_weight[share.tp_rank]  # this rank's block of [T, E, ...]
            runs = _expert_runs(local_experts(layer)) if share.experts_from_layer else [(0, slice(None))]
            if cut is not None and cut.zeros_on(share.tp_rank):  # added once after the all-reduce: rank 0's
                param.data.zero_()
                runs = []
            for slot, rows in runs:
                src = loaded_weight[rows]
                dst = param.data.narrow(0, slot, src.shape[0])
                if cut is None or cut.dim is None:
                    dst.copy_(src)
                    continue
                for start, at, n in cut.pieces(src.shape[cut.dim], share.tp_size, share.tp_rank):
                    dst.narrow(cut.dim, at, n).copy_(src.narrow(cut.dim, start, n))
            self.loaded[suffix] = self.loaded.get(suffix, 0) + 1
            return True if kwargs.get("return_success") else None

        return load

    def process_weights_after_loading(self, layer) -> None:
        missing = [s for s in self.entry["tensors"] if s not in self.loaded]
        if missing:
            raise self._refuse(f"{', '.join(missing)} never loaded (is the checkpoint the converted folder?)")
        twice = [s for s, n in self.loaded.items() if n > 1]
        if twice:
            raise self._refuse(f"{', '.join(twice)} loaded more than once")
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = self._make_kernel(layer)

    def _activation_constants(self) -> dict:
        """``gemm1_alpha`` / ``gemm1_beta`` / ``gemm1_clamp_limit`` for the quant config: for swigluoai, the
        layer's alpha and limit (the manifest's; vLLM's kernels take gpt-oss's only, ``scope.SWIGLUOAI``) and
        beta 1, as vLLM's GptOssMxfp4MoEMethod passes them; nothing for silu, as vLLM's Mxfp4MoEMethod."""
        if self.entry["activation"] != "swigluoai":
            return {"gemm1_alpha": None, "gemm1_beta": None, "gemm1_clamp_limit": None}
        from moeconvert.integrations.vllm.scope import SWIGLUOAI, SWIGLUOAI_BETA

        params = {**SWIGLUOAI, **(self.entry.get("activation_params") or {})}
        return {"gemm1_alpha": params["alpha"], "gemm1_beta": SWIGLUOAI_BETA, "gemm1_clamp_limit": params["limit"]}

    def _kernel_weights(self, layer) -> tuple:
        """(w1, w2) as the kernel takes them: the parameters themselves."""
        return layer.w13_weight, layer.w2_weight

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        w1, w2 = self._kernel_weights(layer)
        return self.moe_kernel.apply(
            x, w1, w2, topk_weights=topk_weights, topk_ids=topk_ids,
            activation=layer.activation, global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
            apply_router_weight_on_input=layer.apply_router_weight_on_input, shared_experts=shared_experts,
            shared_experts_input=shared_experts_input)

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        """A monolithic kernel (routing inside it, e.g. triton_kernels' for vLLM's TRITON backend) is called
        with the layer's routing settings, as vLLM's own MXFP4 methods call it (quantization/mxfp4.py)."""
        w1, w2 = self._kernel_weights(layer)
        return self.moe_kernel.apply_monolithic(
            hidden_states=x, w1=w1, w2=w2, router_logits=router_logits, activation=layer.activation,
            global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
            apply_router_weight_on_input=layer.apply_router_weight_on_input, num_expert_group=layer.num_expert_group,
            topk_group=layer.topk_group, e_score_correction_bias=layer.e_score_correction_bias,
            routed_scaling_factor=layer.routed_scaling_factor, routing_sink=layer.routing_sink, input_ids=input_ids,
            hash_indices_table=layer.hash_indices_table)


class MarlinWNA16Method(_FinalLayoutMethod):
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


class TritonWNA16Method(MarlinWNA16Method):
    """``triton`` WNA16 (int4 sym / asym, int8 sym): vLLM's ``TritonWNA16Experts`` over its Triton kernel
    ``fused_moe_kernel_gptq_awq``, built as vLLM's compressed-tensors WNA16 method builds it after its
    TRITON conversion (what ``--moe-backend triton`` gives)."""

    backend = "TRITON"
    supports_eplb = True  # as CompressedTensorsWNA16MoEMethod with the TRITON backend

    @staticmethod
    def _experts_cls():
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonWNA16Experts

        return TritonWNA16Experts


class _MXFP4Method(_FinalLayoutMethod):
    """What the MXFP4 methods share: the padded sizes the folder holds, and gpt-oss's activation constants
    passed to vLLM's quant config as its own gpt-oss method passes them."""

    #: vLLM's MXFP4 backend whose round-up of (H, I) the layout was padded with
    backend = "MARLIN"

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
            Mxfp4MoeBackend, mxfp4_round_up_hidden_size_and_intermediate_size)

        H, I = super().maybe_roundup_sizes(hidden_size, intermediate_size_per_partition, act_dtype,
                                           moe_parallel_config)
        return mxfp4_round_up_hidden_size_and_intermediate_size(Mxfp4MoeBackend[self.backend], H, I)

    def _sizes(self, entry: dict | None = None) -> tuple[int, int]:
        e = entry or self.entry
        return e["hidden_size_padded"], e["intermediate_size_padded"]

    def _make_kernel(self, layer):
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend, make_mxfp4_moe_kernel

        kernel = make_mxfp4_moe_kernel(moe_quant_config=self.moe_quant_config, moe_config=self.moe,
                                       experts_cls=self.experts_cls, mxfp4_backend=Mxfp4MoeBackend[self.backend],
                                       routing_tables=layer._expert_routing_tables())
        kernel.fused_experts.process_weights_after_loading(layer)  # as vLLM's MXFP4 methods do (a no-op today)
        return kernel


class MarlinMXFP4Method(_MXFP4Method):
    """``marlin`` MXFP4 (``moeconvert quantize --format mxfp4``, and gpt-oss): vLLM's ``MarlinExperts`` with
    e2m1 weights and e8m0 scales, over H and I zero-padded as vLLM pads them for Marlin (the folder holds
    them padded)."""

    supports_eplb = True  # as vLLM's Mxfp4MoEMethod (quantization/mxfp4.py), Marlin backend included

    def get_fused_moe_quant_config(self, layer):
        from vllm.model_executor.layers.fused_moe.config import mxfp4_w4a16_moe_quant_config

        return mxfp4_w4a16_moe_quant_config(w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
                                            w1_bias=getattr(layer, "w13_bias", None),
                                            w2_bias=getattr(layer, "w2_bias", None), **self._activation_constants())


class HummingWNA16Method(_FinalLayoutMethod):
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
            raise self._refuse(f"{problem}: convert with --backend marlin")
        want = self.made_for.get("humming-kernels")
        if not has_humming():
            raise self._refuse(f"this folder holds humming-kernels {want}'s bytes and this Python has no humming "
                               f"(import humming fails): pip install --no-deps humming-kernels=={want} "
                               "(vLLM 0.33.0's pin), or convert with --backend marlin")
        import humming

        have = getattr(humming, "__version__", None)
        if have != want:
            raise self._refuse(f"this folder holds humming-kernels {want}'s bytes; this Python has humming-kernels "
                               f"{have}, whose transform may differ: install humming-kernels=={want} "
                               "(vLLM 0.33.0's pin), or convert with --backend marlin")
        sm = self.made_for.get("sm")
        cap = current_platform.get_device_capability()  # None off GPUs
        # humming transforms weights per GPU architecture (LayerConfig.sm_version decides raw / flat / native
        # dequant layouts) and refuses to run a config made for another SM (LayerConfig.check_device): the
        # folder's bytes are made and checked for one SM only, so any other GPU is refused, not warned about
        if cap is None or str(cap.to_int()) != sm:
            where = f"an SM{cap.to_int()} GPU" if cap is not None else f"its {current_platform.device_type} platform"
            raise self._refuse(f"this folder holds humming's SM{sm} bytes (H100 / H200) and vLLM runs on {where}: "
                               "humming lays weights out per GPU architecture; convert with --backend marlin for "
                               "this machine")
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
                               "at debug level); serve a --backend marlin folder")
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


class HummingMXFP4Method(_MXFP4Method, HummingWNA16Method):
    """``humming`` MXFP4 (``moeconvert quantize --format mxfp4 --backend humming``): vLLM's humming experts over
    humming-kernels' grouped GEMM with e2m1 weights and e8m0 scales, built as vLLM's ``Mxfp4MoEMethod`` builds
    them for its HUMMING backend (what vLLM 0.33.0 picks on SM90 for MXFP4 experts outside gpt-oss) after
    ``convert_to_humming_moe_kernel_format``, with the parameters the folder holds in place of the transformed
    ones, over I rounded up to 64 as vLLM rounds it for HUMMING. The schemas and LayerConfigs come from
    humming's own ``Mxfp4WeightSchema`` and ``prepare_layer_config`` (``layouts/humming_mxfp4.py``), checked
    against the manifest's; the refusals are the WNA16 method's (docs/layouts/humming.md, "MXFP4")."""

    backend = "HUMMING"
    supports_eplb = True  # as vLLM's Mxfp4MoEMethod

    def __init__(self, moe, entry: dict, manifest: dict, share: RankShare | None = None):
        _FinalLayoutMethod.__init__(self, moe, entry, manifest, share)
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


class TritonMXFP4Method(_MXFP4Method):
    """``triton`` MXFP4 (gpt-oss): vLLM's triton_kernels experts for its TRITON backend (``matmul_ogs`` with the
    fused swiglu epilogue; the first of ``OAITritonMxfp4ExpertsMonolithic`` and ``OAITritonExperts`` that
    supports the layer, as vLLM picks), over the folder's swizzled buffers wrapped as triton_kernels tensors
    without moving a byte (docs/layouts/triton-mxfp4.md, "Loader recipe"). The parameters stay the folder's
    bytes; the wrappers are views of them, held by the method."""

    backend = "TRITON"
    supports_eplb = False  # vLLM's GptOssMxfp4MoEMethod declares none, and the monolithic kernel takes none

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


class TritonFastMethod(_FinalLayoutMethod):
    """``triton-fast`` (moeconvert's own layout; int4 / int8 in groups or channelwise, with or without zero
    points, MXFP4; biases; silu and swigluoai): moeconvert's own ``fused_moe_fast`` as vLLM modular experts
    (:class:`~moeconvert.integrations.vllm.fast_experts.MoeconvertFastExperts`) behind the prepare / finalize
    step vLLM makes for the layer's parallel shape. The parameters hold the folder's bytes; nothing is
    processed. The kernel needs CUDA (or Triton's interpreter): anything else is refused when the layer is
    built, before a byte is read."""

    supports_eplb = False  # not yet run with vLLM's expert rebalancing

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
            raise self._refuse(f"{why}; serve a --backend marlin folder on this machine")
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
