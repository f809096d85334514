"""The layout registry: ``--backend NAME`` finds the layout registered under NAME.

Everything about one layout (constraints, padding, encode, decode, tensor names, the runtime kernels
that read it) lives in its module; nothing outside this registry branches on a backend name. Layouts
of other distributions register with :func:`register`, or through the ``moeconvert.layouts``
entry-point group, loaded the first time the registry is asked (docs/architecture.md, "Adding a
backend").
"""

from __future__ import annotations

import types

from moeconvert.errors import MoeConvertError
from moeconvert.plugins import LAYOUTS_GROUP, EntryPointGroup
from moeconvert.layouts.base import PROJECTIONS, W2, W13, Layout, ProjectionNames, TensorSpec

_REGISTRY: dict[str, list[type[Layout]]] = {}


def register(cls: type[Layout]) -> type[Layout]:
    """One backend name may have one layout per scheme kind (e.g. ``marlin`` for WNA16 and for MXFP4)."""
    if not (isinstance(cls, type) and issubclass(cls, Layout)):
        raise TypeError(f"{cls!r} is not a Layout subclass")
    declared = vars(cls).get("runtime_kernels")
    if not (isinstance(declared, tuple) and all(isinstance(k, str) for k in declared)):
        raise ValueError(f"layout {cls.__name__} must declare its own runtime_kernels, a tuple of runtime kernel "
                         f"names (() when none reads it), not inherit {getattr(cls, 'runtime_kernels', None)!r}")
    for other in _REGISTRY.get(cls.name, []):
        if set(other.schemes) & set(cls.schemes):
            raise ValueError(f"layout {cls.name!r} registered twice for {set(other.schemes) & set(cls.schemes)}")
    _REGISTRY.setdefault(cls.name, []).append(cls)
    return cls


def _add_plugin(obj: object) -> None:
    if isinstance(obj, types.ModuleType):
        return  # its layouts registered themselves when it was imported
    if isinstance(obj, type) and obj in _REGISTRY.get(getattr(obj, "name", None), []):
        return  # registered by its module's ``@register`` while the entry point imported it
    register(obj)  # type: ignore[arg-type]


_PLUGINS = EntryPointGroup(LAYOUTS_GROUP, _add_plugin)


def _registry() -> dict[str, list[type[Layout]]]:
    """The registry, with the ``moeconvert.layouts`` entry points loaded (once)."""
    _PLUGINS.load()
    return _REGISTRY


def get_layout(name: str, kind: str | None = None) -> Layout:
    """The layout ``--backend name`` writes for experts of scheme kind ``kind`` ("float", "wna16", "mxfp4", "nvfp4").

    Without a kind, or when no layout of that name takes the kind, the first one registered is given:
    its ``check`` then says which schemes it takes.
    """
    registry = _registry()
    try:
        classes = registry[name]
    except KeyError:
        raise MoeConvertError(
            "unknown backend layout", expected=" | ".join(sorted(registry)), found=name
        ) from None
    for cls in classes:
        if kind in cls.schemes:
            return cls()
    return classes[0]()


def layout_kinds(name: str) -> list[str]:
    """The scheme kinds backend ``name`` has layouts for."""
    return [kind for cls in _registry().get(name, []) for kind in cls.schemes]


def layout_names() -> list[str]:
    return sorted(_registry())


def layout_classes() -> list[type[Layout]]:
    """Every registered layout class, by name, then in registration order."""
    registry = _registry()
    return [cls for name in sorted(registry) for cls in registry[name]]


# Each layout module registers itself on import.
from moeconvert.layouts import plain  # noqa: E402,F401
from moeconvert.layouts import marlin  # noqa: E402,F401
from moeconvert.layouts import emulation_mxfp4  # noqa: E402,F401
from moeconvert.layouts import triton_wna16  # noqa: E402,F401
from moeconvert.layouts import emulation  # noqa: E402,F401
from moeconvert.layouts import marlin_mxfp4  # noqa: E402,F401
from moeconvert.layouts import flashinfer_trtllm  # noqa: E402,F401
from moeconvert.layouts import flashinfer_cutlass  # noqa: E402,F401
from moeconvert.layouts import flashinfer_trtllm_mxfp4  # noqa: E402,F401
from moeconvert.layouts import triton_mxfp4  # noqa: E402,F401
from moeconvert.layouts import triton_fast  # noqa: E402,F401
from moeconvert.layouts import humming  # noqa: E402,F401
from moeconvert.layouts import humming_mxfp4  # noqa: E402,F401
from moeconvert.layouts import marlin_nvfp4  # noqa: E402,F401
from moeconvert.layouts import humming_nvfp4  # noqa: E402,F401
from moeconvert.layouts import flashinfer_trtllm_nvfp4  # noqa: E402,F401
from moeconvert.layouts import flashinfer_cutlass_nvfp4  # noqa: E402,F401

__all__ = ["Layout", "TensorSpec", "ProjectionNames", "W13", "W2", "PROJECTIONS", "register", "get_layout",
           "layout_names", "layout_kinds", "layout_classes"]
