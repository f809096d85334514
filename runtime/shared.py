"""Shared experts (Qwen2-MoE's gated ``shared_expert``, DeepSeek / GLM ``shared_experts``): a dense
SiLU-and-mul MLP the MoE block adds to the routed output. Copied unchanged by the converter, so they
are in the checkpoint's own form: float ``{proj}.weight``, or compressed-tensors pack-quantized
``{proj}.weight_packed`` / ``weight_scale`` / ``weight_zero_point`` / ``weight_shape``, dequantized
here to float32 once (the same rule as the routed experts: ``(u - z) * s``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.packing import unpack_int32
from moeconvert.schemes import parse_quantization_config

_PROJ = ("gate_proj", "up_proj", "down_proj")


def dequantize_linear(module: str, tensors: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of one (possibly pack-quantized) Linear."""
    if f"{module}.weight" in tensors:
        return tensors[f"{module}.weight"].float()
    packed = tensors.get(f"{module}.weight_packed")
    scale = tensors.get(f"{module}.weight_scale")
    if packed is None or scale is None:
        raise MoeConvertError("shared expert projection has neither weight nor weight_packed + weight_scale",
                              tensor=module, found=", ".join(n for n in tensors if n.startswith(module)) or "nothing")
    qc = parse_quantization_config(config, "config.json")
    scheme = qc.scheme_for({"w": module}, "bfloat16") if qc is not None else None
    if scheme is None:
        raise MoeConvertError("shared expert is pack-quantized but config.json's quantization_config does not "
                              "cover it", file="config.json", tensor=module)
    N, K = (int(v) for v in tensors[f"{module}.weight_shape"].tolist())
    codes = unpack_int32(packed, scheme.bits, K, dim=1).float()
    g = K if scheme.group_size <= 0 else scheme.group_size
    cols = torch.arange(K, device=codes.device) // g
    zp = tensors.get(f"{module}.weight_zero_point")
    z = unpack_int32(zp, scheme.bits, N, dim=0).float()[:, cols] if zp is not None and not scheme.symmetric \
        else float(scheme.offset)
    return (codes - z) * scale.float()[:, cols]


@dataclass
class SharedExperts:
    """``down(silu(gate(x)) * up(x))``, times ``sigmoid(x @ gate_weight.T)`` when gated (Qwen2-MoE)."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    w_expert_gate: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (torch.nn.functional.silu(xf @ self.w_gate.T) * (xf @ self.w_up.T)) @ self.w_down.T
        if self.w_expert_gate is not None:
            y = torch.sigmoid(xf @ self.w_expert_gate.T) * y
        return y


def shared_from_tensors(names: list[str], tensors: dict[str, torch.Tensor], config: dict) -> SharedExperts | None:
    """Build the shared experts of a layer from the tensors the manifest lists (``shared_experts``)."""
    if not names:
        return None
    modules = {n.rsplit(".", 2)[0] for n in names if n.rsplit(".", 2)[-2] in _PROJ}
    if len(modules) != 1:
        raise MoeConvertError("cannot tell the shared expert MLP from its tensors", tensor=", ".join(names[:4]),
                              expected="one {gate,up,down}_proj set", found=sorted(modules))
    mlp = modules.pop()
    w = [dequantize_linear(f"{mlp}.{p}", tensors, config) for p in _PROJ]
    gate = [n for n in names if n.endswith("shared_expert_gate.weight")]
    return SharedExperts(*w, w_expert_gate=tensors[gate[0]].float() if gate else None)
