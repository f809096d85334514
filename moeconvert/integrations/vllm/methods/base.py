"""What every plugin method shares: the rank's share of the folder (:class:`RankShare`), the experts vLLM's
layer holds (:func:`local_experts`), and :class:`FinalLayoutMethod`: parameters made from the manifest,
the folder's bytes copied into them as they are, vLLM's kernel built over them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from moeconvert.format import DTYPES
from moeconvert.integrations.vllm.methods.spec import SPECS, MethodSpec, alternatives, elsewhere, layout_fits
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


class FinalLayoutMethod(FusedMoEMethodBase):
    """What every method shares: parameters from the manifest, exact loading, the kernel over them."""

    #: what the method serves, and why not (``spec.py``): bound by the class's name, so a method without a
    #: spec fails when its module is imported
    spec: ClassVar[MethodSpec]
    #: what vLLM asks before it rebalances experts (``--enable-eplb``): the spec's answer. vLLM's EPLB moves
    #: whole experts between ranks (``RoutedExperts.get_expert_weights`` views each parameter
    #: ``[E_local, -1]``), which every layout allows; a spec follows vLLM's own method for the same kernel
    supports_eplb = False

    def __init_subclass__(cls, shared: bool = False, **kwargs):
        """``shared``: a base of several methods (no spec of its own)."""
        super().__init_subclass__(**kwargs)
        if shared:
            return
        if cls.__name__ not in SPECS:
            raise TypeError(f"{cls.__name__}: a plugin method needs its spec in methods/spec.py")
        cls.spec = SPECS[cls.__name__]
        cls.supports_eplb = cls.spec.supports_eplb()[0]

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

    def _alternatives(self, **kw) -> list[MethodSpec]:
        """The other methods that serve this layer (``spec.alternatives``; ``kw``: ``eplb``, ``portable``)."""
        e = self.entry
        return alternatives(e["scheme"]["kind"], e["activation"], e.get("activation_params"),
                            layout_fits(e, self.manifest_dtype), exclude=self.spec, **kw)

    def _instead(self) -> str:
        """The fix where no vLLM holds what this folder holds: a folder of another method's layout."""
        alts = self._alternatives()
        return (f"convert with --backend {alts[0].layout} ({alts[0].command(self.entry['scheme']['kind'])})" if alts
                else "no other layout the plugin serves holds these experts")

    def _elsewhere(self) -> str:
        """The fix where this method's kernel cannot run on this machine: the first other method whose
        layout holds this layer and whose kernel runs on any CUDA GPU (none off GPUs), from the specs."""
        from vllm.platforms import current_platform

        alts = self._alternatives(portable=True)
        on_gpu = current_platform.get_device_capability() is not None
        return elsewhere(alts, None if on_gpu else current_platform.device_type)

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
        layer's alpha and limit (the manifest's; vLLM's kernels take gpt-oss's only, ``spec.SWIGLUOAI``) and
        beta 1, as vLLM's GptOssMxfp4MoEMethod passes them; nothing for silu, as vLLM's Mxfp4MoEMethod."""
        if self.entry["activation"] != "swigluoai":
            return {"gemm1_alpha": None, "gemm1_beta": None, "gemm1_clamp_limit": None}
        from moeconvert.integrations.vllm.methods.spec import SWIGLUOAI, SWIGLUOAI_BETA

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


class MXFP4Method(FinalLayoutMethod, shared=True):
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
