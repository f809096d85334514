"""moeconvert's own fused-MoE Triton kernel (kernels/moe_fast.py ``fused_moe_fast``) as vLLM modular experts.

vLLM's modular kernel (``FusedMoEKernel``, model_executor/layers/fused_moe/modular_kernel.py) is a
prepare / finalize step, chosen by vLLM for the layer's parallel shape (nothing for TP and EP alone, an
all-gather and reduce-scatter for DP + EP, ...), around an experts object that gets the (gathered) tokens,
their top-k ids in vLLM's global expert space and the layer's expert map, and writes ``[M, H]``. Ours maps
the ids to the rank's local slots through the expert map (any placement: linear, round-robin, EPLB's copies)
and hands plain tensors to ``fused_moe_fast``, which aligns, runs both GEMMs with the activation in GEMM1's
epilogue, weighs by top-k and sums: the finalize step has nothing left to weigh or reduce
(``TopKWeightAndReduceNoOP``, as for Marlin's experts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

#: vLLM's activations -> the names ``fused_moe_fast`` takes (its ``ACTIVATIONS``)
ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.SWIGLUOAI: "swigluoai"}


@dataclass(frozen=True)
class FastFormat:
    """What ``fused_moe_fast`` needs to know of a layer besides its tensors (the manifest's entry)."""

    fmt: str  # "int4" | "int8" | "mxfp4"
    group_size: int  # <= 0: channelwise


def runs_here() -> str | None:
    """Why the kernel cannot run in this process, or None: it needs CUDA, or Triton's interpreter on the CPU
    (``TRITON_INTERPRET=1``, slow; for tests), the runtime's rule (runtime/moeconvert_triton.py)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"moeconvert's Triton kernel needs a CUDA GPU (vLLM runs on its {current_platform.device_type} "
            "platform; TRITON_INTERPRET=1 runs it on the CPU, slowly, for tests)")


class MoeconvertFastExperts(mk.FusedMoEExpertsModular):
    """``fused_moe_fast`` over a ``triton-fast`` layer's parameters as they are (w1 / w2 from vLLM's call; the
    scales, zero points and biases from the quant config the method made over the parameters)."""

    def __init__(self, moe_config, quant_config, fast: FastFormat, mx_small_scales: bool = False):
        super().__init__(moe_config=moe_config, quant_config=quant_config)
        self.fast = fast
        self.mx_small_scales = mx_small_scales

    # -- what vLLM's oracle asks of every experts class ----------------------------------------------------

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return runs_here() is None

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False  # w13 holds gate and up rows; GEMM1's epilogue multiplies them

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        # the weight formats are the triton-fast layout's (its ``check`` at conversion); activations stay
        # in the model dtype: nothing quantizes them
        return activation_key is None

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        # the passthrough all2all leaves dispatch and combine to the experts, which ours do not do; the
        # two-sided FlashInfer NVL kernels are refused as for Marlin's experts (vLLM's MarlinExpertsBase)
        return not (moe_parallel_config.use_passthrough_all2all
                    or getattr(moe_parallel_config, "use_fi_nvl_two_sided_kernels", False))

    # -- sizes and buffers ---------------------------------------------------------------------------------

    def _intermediate(self, w2: torch.Tensor) -> int:
        """I per partition from w2 (``[E, H/16, 8I]`` 4-bit fragments, ``[E, H/16, 16I]`` int8 ones)."""
        return w2.shape[2] // (16 if self.fast.fmt == "int8" else 8)

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        # the default reads N from w1's second dimension, which fragment atoms hold 16 rows to
        return w1.shape[0], a1.shape[0], 2 * self._intermediate(w2), a1.shape[-1], topk_ids.shape[1]

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        # fused_moe_fast allocates its own intermediate buffers; vLLM provides only the output
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # fused_moe_fast weighs by top-k and sums

    # -- one call ------------------------------------------------------------------------------------------

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        from moeconvert.kernels.moe_fast import FastWeights, fused_moe_fast

        qc = self.quant_config
        w13 = FastWeights(w1, qc.w1_scale, qc.w1_zp, qc.w1_bias)
        w2w = FastWeights(w2, qc.w2_scale, qc.w2_zp, qc.w2_bias)
        E = w1.shape[0]
        # vLLM's expert map: global (physical) expert -> this rank's slot, -1 elsewhere; fused_moe_fast leaves
        # every id outside [0, E) out, so other ranks' pairs add nothing
        ids = topk_ids if expert_map is None else expert_map[topk_ids.long()]
        # prepare has multiplied the input by the (top-1) weight already
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        # swigluoai's alpha and limit as the method put them in the quant config (the manifest's); beta is 1
        # there, as in fused_moe_fast's swiglu (and vLLM's gpt-oss method)
        consts = {k: float(v) for k, v in (("alpha", qc.gemm1_alpha), ("limit", qc.gemm1_clamp_limit)) if v is not None}
        f = self.fast
        y = fused_moe_fast(hidden_states, w13, w2w, weights, ids, fmt=f.fmt, group_size=f.group_size,
                           activation=ACTIVATIONS[activation], expert_offset=0, **consts,
                           all_ids_local=expert_map is None and E == global_num_experts,
                           mx_small_scales=self.mx_small_scales)
        output.copy_(y)
