"""The layout registry: ``--backend NAME`` finds the layout registered under NAME.

Everything about one layout (constraints, padding, encode, decode, tensor names, the kernel that reads
it) lives in its module; nothing outside this registry branches on a backend name.
"""

from __future__ import annotations

from moeconvert.errors import MoeConvertError
from moeconvert.layouts.base import Layout, TensorSpec

_REGISTRY: dict[str, list[type[Layout]]] = {}


def register(cls: type[Layout]) -> type[Layout]:
    """One backend name may have one layout per scheme kind (e.g. ``marlin`` for WNA16 and for MXFP4)."""
    for other in _REGISTRY.get(cls.name, []):
        if set(other.schemes) & set(cls.schemes):
            raise ValueError(f"layout {cls.name!r} registered twice for {set(other.schemes) & set(cls.schemes)}")
    _REGISTRY.setdefault(cls.name, []).append(cls)
    return cls


def get_layout(name: str, kind: str | None = None) -> Layout:
    """The layout ``--backend name`` writes for experts of scheme kind ``kind`` ("float", "wna16", "mxfp4").

    Without a kind, or when no layout of that name takes the kind, the first one registered is given:
    its ``check`` then says which schemes it takes.
    """
    try:
        classes = _REGISTRY[name]
    except KeyError:
        raise MoeConvertError(
            "unknown backend layout", expected=" | ".join(sorted(_REGISTRY)), found=name
        ) from None
    for cls in classes:
        if kind in cls.schemes:
            return cls()
    return classes[0]()


def layout_kinds(name: str) -> list[str]:
    """The scheme kinds backend ``name`` has layouts for."""
    return [kind for cls in _REGISTRY.get(name, []) for kind in cls.schemes]


def layout_names() -> list[str]:
    return sorted(_REGISTRY)


# Each layout module registers itself on import.
from moeconvert.layouts import plain  # noqa: E402,F401
from moeconvert.layouts import marlin  # noqa: E402,F401
from moeconvert.layouts import emulation_mxfp4  # noqa: E402,F401
from moeconvert.layouts import triton_wna16  # noqa: E402,F401
from moeconvert.layouts import emulation  # noqa: E402,F401
from moeconvert.layouts import marlin_mxfp4  # noqa: E402,F401
from moeconvert.layouts import flashinfer_trtllm  # noqa: E402,F401
from moeconvert.layouts import flashinfer_mxfp4  # noqa: E402,F401
from moeconvert.layouts import triton_mxfp4  # noqa: E402,F401
from moeconvert.layouts import triton_fast  # noqa: E402,F401

__all__ = ["Layout", "TensorSpec", "register", "get_layout", "layout_names"]
