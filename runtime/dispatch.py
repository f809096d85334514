"""Which kernel runs a layer: explicit, inspectable, keyed by the names layouts declare.

A runtime kernel is a :class:`Kernel` registered under its name with how to tell whether it can run a
layer here and how to run it (:func:`register_kernel`): the built-in adapters are vllm_marlin.py
(``vllm-marlin``), moeconvert_triton.py (``triton``) and humming.py (``humming``); other distributions
add theirs through the ``moeconvert.kernels`` entry-point group, loaded the first time the registry is
asked. A layout declares the names of the runtime kernels that read it, in order of preference
(``Layout.runtime_kernels``): that is the only link between the two. For a layer, :func:`select` takes

1. the override, if any: the ``kernel=`` argument of ``load``, else ``$MOECONVERT_KERNEL``; an
   override that cannot run the layer is an error, not a fallback;
2. else the first of its layout's runtime kernels that can run here (``reference`` among them means
   the PyTorch reference is the layout's own kernel, as for ``plain``);
3. else the reference, which reads every layout (it decodes to the canonical block). A
   :class:`KernelFallbackWarning` says which kernel could not run and why (not installed, wrong device
   or GPU, another library version, or no runtime kernel reads the layout yet), once per reason.

``MoELayer.kernel`` names the choice and ``MoELayer.kernel_note`` the reason for a fallback.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.plugins import KERNELS_GROUP, EntryPointGroup

ENV_KERNEL = "MOECONVERT_KERNEL"
REFERENCE = "reference"


class KernelFallbackWarning(UserWarning):
    """The kernel a layout was made for cannot run here; the runtime runs another one (said once)."""


@dataclass(frozen=True)
class Kernel:
    """A runtime kernel: the layouts that name it (``Layout.runtime_kernels``) are the ones it reads."""

    name: str
    #: unavailable(layer, device): why it cannot run this ``MoELayer`` on this device (None: it can)
    unavailable: Callable[["object", torch.device], str | None]
    #: run(layer, x [M, H], topk_weights [M, k] fp32, topk_ids [M, k] int32 global ids) -> [M, H] in
    #: x.dtype; the layer's tensors are ``layer.tensors``, by the names its layout's plan declares
    run: Callable[..., torch.Tensor]


_KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    """Register a runtime kernel under ``kernel.name``; layouts that list the name are dispatched to it."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"{kernel!r} is not a moeconvert.runtime.Kernel")
    if kernel.name in _KERNELS or kernel.name == REFERENCE:
        raise ValueError(f"kernel {kernel.name!r} registered twice")
    _KERNELS[kernel.name] = kernel
    return kernel


def _add_plugin(obj: object) -> None:
    import types

    if isinstance(obj, types.ModuleType):
        return  # its kernels registered themselves when it was imported
    if isinstance(obj, Kernel) and _KERNELS.get(obj.name) is obj:
        return  # registered by its module while the entry point imported it
    register_kernel(obj)  # type: ignore[arg-type]


_PLUGINS = EntryPointGroup(KERNELS_GROUP, _add_plugin)


def _registry() -> dict[str, Kernel]:
    """The registry, with the ``moeconvert.kernels`` entry points loaded (once)."""
    _PLUGINS.load()
    return _KERNELS


def kernel_names() -> list[str]:
    return list(_registry()) + [REFERENCE]


def get_kernel(name: str) -> Kernel:
    try:
        return _registry()[name]
    except KeyError:
        raise MoeConvertError("unknown kernel", tensor="kernel / $" + ENV_KERNEL,
                              expected=" | ".join(kernel_names()), found=name) from None


def reads(name: str) -> list[tuple[str, str]]:
    """The (layout name, scheme kind) pairs whose layouts name kernel ``name`` (from the layouts' own
    declarations: nothing here says it twice)."""
    from moeconvert.layouts import layout_classes

    return [(cls.name, kind) for cls in layout_classes() if name in cls.runtime_kernels for kind in cls.schemes]


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
    """The kernel for ``layer`` (an ``MoELayer``) on ``device``.

    The layer's layout is the registered class the manifest's layout name and scheme kind resolved to
    (``layer.entry.layout``); its ``runtime_kernels`` are the candidates, nothing else."""
    override = override or os.environ.get(ENV_KERNEL) or None
    layout, kind = layer.entry.layout, layer.entry.scheme.kind
    declared = layout.runtime_kernels
    if override is not None:
        if override == REFERENCE:
            return Choice(REFERENCE)
        k = get_kernel(override)
        if override not in declared:
            raise MoeConvertError(f"kernel {override} does not read the '{layout.name}' layout of {kind} experts",
                                  tensor=layer.prefix, expected=", ".join(f"{a} ({b})" for a, b in reads(override)),
                                  found=f"{layout.name} ({kind})")
        why = k.unavailable(layer, device)
        if why is not None:
            raise MoeConvertError(f"kernel {override} was asked for but cannot run: {why}", tensor=layer.prefix)
        return Choice(override)
    reasons = []
    for name in declared:
        if name == REFERENCE:
            return Choice(REFERENCE)  # the layout's own kernel
        k = _registry().get(name)
        why = ("no runtime kernel of that name is registered (a plugin not installed?)" if k is None
               else k.unavailable(layer, device))
        if why is None:
            return Choice(name)
        reasons.append(f"{name}: {why}")
    note = ("; ".join(reasons) if reasons else
            f"the runtime does not call {layout.kernel} (the kernel the '{layout.name}' layout was made for) yet")
    _say_once(f"moeconvert.runtime: '{layout.name}' layout ({kind}) on {device}: running the PyTorch reference "
              f"instead of its kernel, because {note}")
    return Choice(REFERENCE, note)


# The built-in runtime kernels register themselves on import (one adapter module per kernel).
from moeconvert.runtime import vllm_marlin  # noqa: E402,F401
from moeconvert.runtime import moeconvert_triton  # noqa: E402,F401
from moeconvert.runtime import humming  # noqa: E402,F401
