"""The PyTorch reference MoE: the oracle every kernel is compared with. Runs on CPU and GPU.

A layer's tensors are decoded by its layout to the canonical block (moeconvert/canonical.py) and
dequantized once, to float32:

* float: the weights as they are;
* wna16: ``(u - z) * s`` per group, with ``z`` the zero point or ``2^(b-1)`` when symmetric (exact
  in fp32: a small integer times a 16-bit float);
* mxfp4: ``E2M1(code) * 2^(S - 127)`` (``dequantize_mxfp4``, exact);
* nvfp4: ``E2M1(code) * scale * global`` (``dequantize_nvfp4``; w13's gate rows take the gate's global
  multiplier, its up rows the up's).

Then, per expert ``e`` and the tokens routed to it, all in float32::

    h = x @ w13[e].T (+ b13[e])            # [gate; up] rows, padded halves (zeros) included
    a = act(h[:, :Ip], h[:, Ip:])          # silu(gate) * up, or a clamped variant (docs/format.md)
    y += topk_weight * (a @ w2[e].T (+ b2[e]))

``x`` is zero-padded from H to the block's (padded) K and ``y`` cut back to H. The result is cast
to the activation dtype once, at the end. Kernels round in between (vLLM's Marlin path writes GEMM1's
output and the activation in the activation dtype); that is what their tolerance covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeconvert.canonical import ExpertBlock
from moeconvert.errors import MoeConvertError
from moeconvert.mxfp4 import dequantize_mxfp4, dequantize_nvfp4
from moeconvert.schemes import MXFP4Scheme, NVFP4Scheme, WNA16Scheme

#: gpt-oss' SwigluOAIAndMul defaults (transformers' GptOssExperts: swiglu_alpha, swiglu_limit)
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """SiLU-and-mul; a ``limit`` > 0 clamps gate from above and up on both sides first (DeepSeek-V4's
    ``swiglu_limit``: vLLM's ``_swiglu_limit_torch``, ``silu_and_mul_with_clamp``)."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def swigluoai_and_mul(gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLUOAI_ALPHA,
                      limit: float = SWIGLUOAI_LIMIT) -> torch.Tensor:
    """transformers' ``GptOssExperts._apply_gate`` / vLLM's ``swigluoai_and_mul`` on split halves."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 1.0,
                 linear_beta: float | None = None) -> torch.Tensor:
    """Kimi-K3's SITU on split halves, as vLLM's ``SituAndMul`` (vllm/model_executor/layers/activation.py)
    defines it: ``beta * tanh(gate / beta) * sigmoid(gate) * up``, with ``up`` softly clipped to
    ``linear_beta * tanh(up / linear_beta)`` where ``linear_beta`` is set."""
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return g * up


def swiglustep_and_mul(gate: torch.Tensor, up: torch.Tensor, limit: float = 7.0) -> torch.Tensor:
    """Step-3.5's clamped SwiGLU on split halves, as vLLM's ``swiglustep_and_mul_triton`` and
    ``SwigluStepAndMul.forward_native`` (vllm/model_executor/layers/activation.py) compute it: SiLU of gate
    clamped from above at ``limit`` after the SiLU, times up clamped to ``[-limit, limit]``."""
    return torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


ACTIVATIONS = {"silu": silu_and_mul, "swigluoai": swigluoai_and_mul, "situ": situ_and_mul,
               "swiglustep": swiglustep_and_mul}
#: activation -> the ``activation_params`` its function takes (the manifest's names)
PARAMS = {"silu": ("limit",), "swigluoai": ("alpha", "limit"), "situ": ("beta", "linear_beta"), "swiglustep": ("limit",)}


def activation_fn(name: str, params: dict | None = None):
    """``f(gate, up)`` for a manifest ``activation`` with its ``activation_params``."""
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise MoeConvertError("unknown activation", tensor="activation", expected=" | ".join(ACTIVATIONS), found=name)
    kw = {k: float(v) for k, v in (params or {}).items() if k in PARAMS[name]}
    return lambda gate, up: fn(gate, up, **kw)


def _dequant_wna16(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, s: WNA16Scheme) -> torch.Tensor:
    """Canonical ``[E, N, K]`` codes -> float32 weights."""
    K = codes.shape[-1]
    g = K if s.group_size <= 0 else s.group_size
    cols = torch.arange(K, device=codes.device) // g
    z = zeros.float()[..., cols] if zeros is not None else float(s.offset)
    return (codes.float() - z) * scales.float()[..., cols]


@dataclass
class DequantizedExperts:
    """Float32 weights of one layer's local experts: ``w13 [E, 2Ip, Hp]`` rows ``[gate; up]``, ``w2 [E, Hp, Ip]``."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.w13_bias, self.w2_bias)
                   if t is not None)


def dequantize_block(block: ExpertBlock) -> DequantizedExperts:
    s = block.scheme
    if isinstance(s, WNA16Scheme):
        w13 = _dequant_wna16(block.w13, block.w13_scale, block.w13_zero, s)
        w2 = _dequant_wna16(block.w2, block.w2_scale, block.w2_zero, s)
    elif isinstance(s, MXFP4Scheme):
        as_bytes = lambda t: t.view(torch.uint8) if t.dtype != torch.uint8 else t
        w13 = dequantize_mxfp4(block.w13, as_bytes(block.w13_scale))
        w2 = dequantize_mxfp4(block.w2, as_bytes(block.w2_scale))
    elif isinstance(s, NVFP4Scheme):
        half = block.w13.shape[1] // 2
        w13 = dequantize_nvfp4(block.w13, block.w13_scale, block.w13_global.repeat_interleave(half, 1).unsqueeze(-1))
        w2 = dequantize_nvfp4(block.w2, block.w2_scale, block.w2_global.view(-1, 1, 1))
    else:
        w13, w2 = block.w13.float(), block.w2.float()
    bias = lambda t: None if t is None else t.float()
    return DequantizedExperts(w13.contiguous(), w2.contiguous(), bias(block.w13_bias), bias(block.w2_bias))


def reference_moe(x: torch.Tensor, experts: DequantizedExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  act, *, expert_offset: int = 0) -> torch.Tensor:
    """``sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x)`` in float32, cast to ``x.dtype``.

    ``topk_ids`` are global expert ids; ids outside this output's experts (other EP ranks) add nothing.
    """
    M, H = x.shape
    E, two_ip, Kp = experts.w13.shape
    Ip = two_ip // 2
    Hp = experts.w2.shape[1]
    xf = x.float()
    if Kp != H:
        xf = torch.nn.functional.pad(xf, (0, Kp - H))
    out = torch.zeros(M, Hp, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_offset
    weights = topk_weights.float()
    for e in torch.unique(local).tolist():
        if not 0 <= e < E:
            continue
        rows, slots = torch.where(local == e)
        h = xf[rows] @ experts.w13[e].T
        if experts.w13_bias is not None:
            h = h + experts.w13_bias[e]
        y = act(h[:, :Ip], h[:, Ip:]) @ experts.w2[e].T
        if experts.w2_bias is not None:
            y = y + experts.w2_bias[e]
        out.index_add_(0, rows, y * weights[rows, slots, None])
    return out[:, :H].to(x.dtype)
