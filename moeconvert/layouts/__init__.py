"""The layout registry: ``--backend NAME`` finds the layout registered under NAME.

Everything about one layout (constraints, padding, encode, decode, tensor names, the kernel that reads
it) lives in its module; nothing outside this registry branches on a backend name.
"""

from __future__ import annotations

from moeconvert.errors import MoeConvertError
from moeconvert.layouts.base import Layout, TensorSpec

_REGISTRY: dict[str, type[Layout]] = {}


def register(cls: type[Layout]) -> type[Layout]:
    if cls.name in _REGISTRY:
        raise ValueError(f"layout {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def get_layout(name: str) -> Layout:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise MoeConvertError(
            "unknown backend layout", expected=" | ".join(sorted(_REGISTRY)), found=name
        ) from None


def layout_names() -> list[str]:
    return sorted(_REGISTRY)


# Each layout module registers itself on import.
from moeconvert.layouts import plain  # noqa: E402,F401
from moeconvert.layouts import marlin  # noqa: E402,F401

__all__ = ["Layout", "TensorSpec", "register", "get_layout", "layout_names"]
