"""Which kernel runs a layer: explicit, inspectable, one table.

Every runtime kernel is a :class:`Kernel` registered here with the (layout name, scheme kind) pairs it
reads, in order of preference; the PyTorch ``reference`` reads every layout (it decodes to the
canonical block). For a layer, :func:`select` takes

1. the override, if any: the ``kernel=`` argument of ``load``, else ``$MOECONVERT_KERNEL``; an
   override that cannot run the layer is an error, not a fallback;
2. else the first registered kernel that reads the layer's layout and can run here;
3. else the reference. When the layout was made for a kernel that cannot run here (not installed,
   wrong device or GPU, another library version, not wired into the runtime yet), a
   :class:`KernelFallbackWarning` says which and why, once per reason.

``MoELayer.kernel`` names the choice and ``MoELayer.kernel_note`` the reason for a fallback.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from moeconvert.errors import MoeConvertError

ENV_KERNEL = "MOECONVERT_KERNEL"
REFERENCE = "reference"


class KernelFallbackWarning(UserWarning):
    """The kernel a layout was made for cannot run here; the runtime runs another one (said once)."""


@dataclass(frozen=True)
class Kernel:
    name: str
    reads: tuple[tuple[str, str], ...]  # (layout name, scheme kind)
    #: why it cannot run this layer on this device (None: it can)
    unavailable: Callable[["object", torch.device], str | None]
    #: run(layer, x [M, H], topk_weights [M, k] fp32, topk_ids [M, k] int32 global ids) -> [M, H]
    run: Callable[..., torch.Tensor]


_KERNELS: list[Kernel] = []


def register(kernel: Kernel) -> Kernel:
    if any(k.name == kernel.name for k in _KERNELS) or kernel.name == REFERENCE:
        raise ValueError(f"kernel {kernel.name!r} registered twice")
    _KERNELS.append(kernel)
    return kernel


def kernel_names() -> list[str]:
    return [k.name for k in _KERNELS] + [REFERENCE]


def kernels_for(layout: str, kind: str) -> list[Kernel]:
    return [k for k in _KERNELS if (layout, kind) in k.reads]


@dataclass(frozen=True)
class Choice:
    kernel: str
    note: str | None = None  # why the layout's own kernel is not the one running


_SAID: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        warnings.warn(text, KernelFallbackWarning, stacklevel=4)


def select(layer, device: torch.device, override: str | None = None) -> Choice:
    """The kernel for ``layer`` (an ``MoELayer``) on ``device``."""
    override = override or os.environ.get(ENV_KERNEL) or None
    layout, kind = layer.entry.layout.name, layer.entry.scheme.kind
    if override is not None:
        if override == REFERENCE:
            return Choice(REFERENCE)
        k = next((k for k in _KERNELS if k.name == override), None)
        if k is None:
            raise MoeConvertError("unknown kernel", tensor="kernel / $" + ENV_KERNEL,
                                  expected=" | ".join(kernel_names()), found=override)
        if (layout, kind) not in k.reads:
            raise MoeConvertError(f"kernel {override} does not read the '{layout}' layout of {kind} experts",
                                  tensor=layer.prefix, expected=", ".join(f"{a} ({b})" for a, b in k.reads),
                                  found=f"{layout} ({kind})")
        why = k.unavailable(layer, device)
        if why is not None:
            raise MoeConvertError(f"kernel {override} was asked for but cannot run: {why}", tensor=layer.prefix)
        return Choice(override)
    reasons = []
    for k in kernels_for(layout, kind):
        why = k.unavailable(layer, device)
        if why is None:
            return Choice(k.name)
        reasons.append(f"{k.name}: {why}")
    made_for = layer.entry.layout.kernel
    if not reasons and made_for == REFERENCE:
        return Choice(REFERENCE)
    note = ("; ".join(reasons) if reasons else
            f"the runtime does not call {made_for} (the kernel the '{layout}' layout was made for) yet")
    _say_once(f"moeconvert.runtime: '{layout}' layout ({kind}) on {device}: running the PyTorch reference "
              f"instead of its kernel, because {note}")
    return Choice(REFERENCE, note)


# ---------------------------------------------------------------------------------------------------
# vLLM's Marlin MoE (marlin layouts, WNA16 and MXFP4)


def _marlin_unavailable(layer, device: torch.device) -> str | None:
    from moeconvert.runtime import vllm_marlin

    return vllm_marlin.unavailable_reason(device, layer.entry.layout.made_for)


def _local_ids(layer, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
    """Global expert ids -> this output's local ids; other ranks' experts get weight 0 (EP)."""
    e = layer.entry
    if e.expert_offset == 0 and e.num_experts == e.num_experts_global:
        return topk_weights, topk_ids
    local = topk_ids.long() - e.expert_offset
    mine = (local >= 0) & (local < e.num_experts)
    return (torch.where(mine, topk_weights.float(), 0.0),
            torch.where(mine, local, 0).to(torch.int32).contiguous())


def _marlin_run(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    from moeconvert.runtime import vllm_marlin

    e = layer.entry
    if x.dtype not in (torch.float16, torch.bfloat16) or (e.scheme.kind == "mxfp4" and x.dtype != torch.bfloat16):
        raise MoeConvertError("vLLM's Marlin MoE runs float16/bfloat16 activations (bfloat16 only for MXFP4)",
                              tensor=layer.prefix, expected="bfloat16" + ("" if e.scheme.kind == "mxfp4" else " or float16"),
                              found=str(x.dtype).replace("torch.", ""))
    s = e.scheme
    type_id = vllm_marlin.weight_type_id(s.kind, getattr(s, "bits", None), getattr(s, "symmetric", True))
    H, Hp = e.hidden_size, e.shape.hidden_size
    Ip = e.intermediate_size_padded
    xin = x if Hp == H else torch.nn.functional.pad(x, (0, Hp - H))
    w, ids = _local_ids(layer, topk_weights, topk_ids)
    y = vllm_marlin.fused_moe(xin.contiguous(), layer.tensors, E=e.num_experts, Hp=Hp, Ip=Ip, type_id=type_id,
                              topk_weights=w, topk_ids=ids.to(torch.int32).contiguous(), act=layer.act,
                              w13_rows=e.metadata.get("w13_rows") or "gate_up")
    return y[:, :H]


register(Kernel("vllm-marlin", (("marlin", "wna16"), ("marlin", "mxfp4")), _marlin_unavailable, _marlin_run))


# ---------------------------------------------------------------------------------------------------
# moeconvert's own Triton kernels (kernels/, moeconvert.kernels)
#
# The hook: ``moeconvert.kernels.supports(layout, kind) -> bool`` and
# ``moeconvert.kernels.fused_moe(x, tensors, layer, topk_weights, topk_ids) -> [M, H]`` (docs/runtime.md).


def _kernels_module():
    import moeconvert.kernels as k

    return k if callable(getattr(k, "fused_moe", None)) and callable(getattr(k, "supports", None)) else None


def _triton_unavailable(layer, device: torch.device) -> str | None:
    k = _kernels_module()
    if k is None:
        return "moeconvert.kernels has no fused MoE kernel yet"
    if not k.supports(layer.entry.layout.name, layer.entry.scheme.kind):
        return f"moeconvert.kernels does not take the {layer.entry.layout.name} layout of {layer.entry.scheme.kind} experts"
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        return f"Triton kernels need a CUDA device (device is {device}; TRITON_INTERPRET=1 runs them on CPU)"
    return None


def _triton_run(layer, x, topk_weights, topk_ids):
    return _kernels_module().fused_moe(x, layer.tensors, layer, topk_weights, topk_ids)


register(Kernel("triton", (("triton-fast", "wna16"), ("triton-fast", "mxfp4"), ("triton", "wna16"), ("triton", "mxfp4")),
                _triton_unavailable, _triton_run))
