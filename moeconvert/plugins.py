"""Layouts and runtime kernels from other distributions, through entry points (docs/architecture.md,
"Adding a backend"): group ``moeconvert.layouts`` (a ``Layout`` subclass, or a module that registers
its layouts on import) and group ``moeconvert.kernels`` (a runtime ``Kernel``, or a module that
registers its kernels on import). Each registry loads its group once, the first time it is asked.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable

from moeconvert.errors import MoeConvertError

LAYOUTS_GROUP = "moeconvert.layouts"
KERNELS_GROUP = "moeconvert.kernels"


def load_entry_points(group: str, add: Callable[[object], None]) -> None:
    """Load every entry point of ``group`` and hand what it names to ``add``. A plugin that cannot be
    loaded or added is one ``MoeConvertError`` line naming the entry point and its distribution."""
    for ep in importlib.metadata.entry_points(group=group):
        try:
            add(ep.load())
        except Exception as e:
            dist = getattr(ep, "dist", None)
            where = f"entry point '{ep.name} = {ep.value}' (group {group}" + (
                f", distribution {dist.name})" if dist is not None else ")")
            raise MoeConvertError(f"cannot load the plugin {where}: {type(e).__name__}: {e}") from e


class EntryPointGroup:
    """One group's entry points, handed to a registry's ``add`` once, the first time it is asked.

    The group counts as loaded while it loads, so a plugin that asks the registry sees it as it is;
    a plugin that fails leaves it unloaded, so the next use says so again instead of the plugin being
    silently missing.
    """

    def __init__(self, group: str, add: Callable[[object], None]):
        self.group, self.add, self.loaded = group, add, False

    def load(self) -> None:
        if self.loaded:
            return
        self.loaded = True
        try:
            load_entry_points(self.group, self.add)
        except BaseException:
            self.loaded = False
            raise
