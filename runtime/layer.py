"""``MoELayer``: one MoE layer's tensors on the device, its router, its shared experts, and the kernel
that runs it."""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock
from moeconvert.errors import MoeConvertError
from moeconvert.runtime import dispatch
from moeconvert.runtime.manifest import LayerEntry
from moeconvert.runtime.reference import DequantizedExperts, activation_fn, dequantize_block, reference_moe
from moeconvert.runtime.routing import Router, route
from moeconvert.runtime.shared import SharedExperts, shared_from_tensors


class MoELayer:
    """``layer(hidden_states, topk_weights, topk_ids)`` -> routed experts' output ``[M, H]``.

    * ``hidden_states`` ``[M, H]`` (or ``[..., H]``), bfloat16/float16 (float32 runs on the reference);
    * ``topk_weights`` ``[M, k]``, ``topk_ids`` ``[M, k]`` global expert ids (as :meth:`route` gives); where the
      manifest declares zero experts (LongCat-Flash), ids ``num_experts_global`` .. ``+ zero_experts.num - 1``
      are those, each adding ``weight * x`` on a whole (TP 1, EP 1) layer;
    * ``kernel`` names what runs (see dispatch.py), ``kernel_note`` why it is not the layout's own.
    """

    def __init__(self, entry: LayerEntry, tensors: dict[str, torch.Tensor], device: torch.device,
                 router: Router | None, shared_tensors: dict[str, torch.Tensor], config: dict, tp_size: int,
                 kernel: str | None):
        self.entry = entry
        self.prefix = entry.prefix
        self.tensors = tensors
        self.device = device
        self.router = router
        #: the shared experts' tensors as stored (copied through from the checkpoint), by full name
        self.shared_tensors = shared_tensors
        self._config = config
        self._shared: SharedExperts | None = None
        self.tp_size = tp_size
        self.act = activation_fn(entry.activation, entry.activation_params)
        self._dequantized: DequantizedExperts | None = None
        #: what a kernel derives once from the layer's tensors and keeps with the layer (kernels/moe_fast.py)
        self.kernel_state: dict = {}
        choice = dispatch.select(self, device, kernel)
        self.kernel, self.kernel_note = choice.kernel, choice.note

    # -- facts ------------------------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        return self.entry.num_experts

    @property
    def hidden_size(self) -> int:
        return self.entry.hidden_size

    @property
    def top_k(self) -> int | None:
        return self.router.config.top_k if self.router is not None else self.entry.top_k

    def describe(self) -> dict:
        e = self.entry
        return {"prefix": self.prefix, "layout": e.layout.name, "scheme": e.scheme.describe(),
                "experts": e.num_experts, "expert_offset": e.expert_offset, "hidden_size": e.hidden_size,
                "intermediate_size": e.intermediate_size, "activation": e.activation, "kernel": self.kernel,
                "kernel_note": self.kernel_note,
                "routing": self.router.config.to_json() if self.router is not None else None,
                "shared_experts": bool(self.shared_tensors)}

    def __repr__(self) -> str:
        return f"MoELayer({self.prefix!r}, {self.entry.layout.name}/{self.entry.scheme.describe()}, kernel={self.kernel!r})"

    # -- the experts ------------------------------------------------------------------------------

    def canonical(self) -> ExpertBlock:
        """The layer decoded by its layout back to the canonical block (on the layer's device)."""
        e = self.entry
        return e.layout.decode(dict(self.tensors), e.shape, e.scheme)

    def dequantized(self) -> DequantizedExperts:
        """Float32 weights of the reference, made on first use and kept (``release_reference`` drops them)."""
        if self._dequantized is None:
            self._dequantized = dequantize_block(self.canonical())
        return self._dequantized

    def release_reference(self) -> None:
        self._dequantized = None
        self._shared = None

    @property
    def shared(self) -> SharedExperts | None:
        """The shared experts (dequantized to float32 on first use), or None when the layer has none."""
        if self._shared is None and self.shared_tensors:
            self._shared = shared_from_tensors(self.entry.shared, self.shared_tensors, self._config)
        return self._shared

    def _check_inputs(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if x.shape[-1] != self.hidden_size:
            raise MoeConvertError("hidden_states have the wrong hidden size", tensor=self.prefix,
                                  expected=self.hidden_size, found=x.shape[-1])
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
            raise MoeConvertError("topk_weights and topk_ids must both be [M, k] for M tokens", tensor=self.prefix,
                                  expected=f"[{x.shape[0]}, k] twice",
                                  found=f"{list(topk_weights.shape)}, {list(topk_ids.shape)}")

    def reference(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The PyTorch reference, whatever ``kernel`` says."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        self._check_inputs(x, topk_weights, topk_ids)
        y = reference_moe(x, self.dequantized(), topk_weights, topk_ids, self.act,
                          expert_offset=self.entry.expert_offset)
        return y.reshape(hidden_states.shape)

    def __call__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.entry.router_weight_on_input:
            # Llama 4 (transformers' Llama4TextMoe, vLLM's apply_router_weight_on_input): each routed
            # expert sees x * w, and its output is summed unweighted; one expert slot at a time
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            self._check_inputs(x, topk_weights, topk_ids)
            ones = torch.ones_like(topk_weights[:, :1])
            y = None
            for j in range(topk_ids.shape[1]):
                xj = (x.float() * topk_weights[:, j:j + 1].float()).to(x.dtype)
                yj = self._run(xj, ones, topk_ids[:, j:j + 1])
                y = yj if y is None else y + yj
            return y.reshape(hidden_states.shape)
        if not self.entry.zero_experts:
            return self._run(hidden_states, topk_weights, topk_ids)
        # the kernels never see a zero expert's id: as vLLM's ZeroExpertRouter, it becomes expert 0 with weight 0
        zero = topk_ids.long() >= self.entry.num_experts_global
        y = self._run(hidden_states, topk_weights.masked_fill(zero, 0.0), topk_ids.masked_fill(zero, 0))
        return self._add_zero_experts(y, hidden_states, topk_weights, topk_ids)

    def _add_zero_experts(self, y: torch.Tensor, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
        """LongCat-Flash's identity zero experts: ``weight * x`` for each slot routed to one, added to the routed
        experts' output as vLLM's MoE runner adds its ZeroExpertRouter's ``zero_experts_compute_triton`` output
        (vllm/model_executor/layers/fused_moe/router/zero_expert_router.py). The routed experts ignore those ids
        (reference_moe adds nothing for an id outside the layer's experts). A cut layer leaves the term to the
        caller: every rank would add it, and the all-reduce would count it once per rank."""
        E, Z = self.entry.num_experts_global, self.entry.zero_experts
        if not Z or self.tp_size != 1 or self.entry.num_experts != E:
            return y
        ids = topk_ids.long()
        w = torch.where((ids >= E) & (ids < E + Z), topk_weights.float(), 0.0).sum(-1, keepdim=True)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return (y.reshape(x.shape).float() + x.float() * w).to(y.dtype).reshape(y.shape)

    def _run(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.kernel == dispatch.REFERENCE:
            return self.reference(hidden_states, topk_weights, topk_ids)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        self._check_inputs(x, topk_weights, topk_ids)
        kernel = dispatch.get_kernel(self.kernel)
        return kernel.run(self, x, topk_weights, topk_ids.to(torch.int32)).reshape(hidden_states.shape)

    # -- routing and the whole block --------------------------------------------------------------

    def router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.router is None:
            raise MoeConvertError("this layer has no router tensors in the output", tensor=self.prefix)
        return self.router.logits(hidden_states.reshape(-1, hidden_states.shape[-1]))

    def route(self, router_logits: torch.Tensor, top_k: int | None = None, renormalize: bool | None = None):
        """(topk_weights fp32, topk_ids int32) with the model's routing function (routing.py);
        ``top_k`` / ``renormalize`` override the config's."""
        if self.router is None:
            raise MoeConvertError("this layer has no router (no routing parameters)", tensor=self.prefix)
        return route(router_logits, self.router.config, top_k=top_k, renormalize=renormalize,
                     e_score_correction_bias=self.router.e_score_correction_bias)

    def block(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The whole MoE block: router, routed experts, shared experts (as transformers' MoE block)."""
        if self.tp_size != 1 or self.entry.num_experts != self.entry.num_experts_global:
            raise MoeConvertError("block() runs a whole MoE block: it needs a TP 1, EP 1 output (a cut output "
                                  "gives partial sums that the ranks must all-reduce)", tensor=self.prefix,
                                  expected="tp_size 1, ep_size 1", found=f"tp_size {self.tp_size}")
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        w, ids = self.route(self.router_logits(x))
        y = self(x, w, ids)
        shared = self.shared
        if shared is not None:
            y = (y.float() + shared(x)).to(x.dtype)
        return y.reshape(hidden_states.shape)
