"""The vLLM plugin's family scope (moeconvert/integrations/vllm/scope.py) against vLLM's own model registries.

The family table says which vLLM versions have each family's model classes; these tests read the registry
file of each version's wheel as text (no vLLM import) and hold the table to it, and check the one line the
plugin refuses a folder with.
"""

import dataclasses
import re

import pytest

from helpers import vllm_reader
from moeconvert.format import families
from moeconvert.format.families import FAMILIES, VLLM_REGISTRIES
from moeconvert.integrations.vllm import SUPPORTED_VLLM, scope

REGISTRY = "model_executor/models/registry.py"


def _architectures(version: str) -> set[str]:
    """Every architecture name vLLM ``version``'s registry maps to a model class (``"Name": (module, class)``)."""
    return set(re.findall(r'^\s*"(\w+)":\s*\(', vllm_reader(version)(REGISTRY), re.M))


@pytest.fixture(scope="module")
def registries() -> dict[str, set[str]]:
    return {v: _architectures(v) for v in VLLM_REGISTRIES}


def test_the_table_reads_the_registries_of_the_vllm_versions_the_plugin_serves():
    assert VLLM_REGISTRIES == SUPPORTED_VLLM


@pytest.mark.parametrize("version", VLLM_REGISTRIES)
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_each_familys_vllm_versions_are_those_whose_registry_has_its_classes(registries, family, version):
    f = families.BY_NAME[family]
    assert len(registries[version]) > 100  # the parse found the registry's tables, not a stray line
    has = all(c in registries[version] for c in f.vllm_classes)
    assert (version in f.vllm_versions) == has, (family, version, [c for c in f.vllm_classes
                                                                   if c not in registries[version]])
    why = scope.family_refusal(family, version)
    if not has:
        assert why.startswith(f"vLLM {version} has no {family} model") and "\n" not in why
    elif f.plugin_proven:
        assert why is None
    else:
        assert why.startswith(f"the vLLM plugin has not been proven on {family} models") and "\n" not in why


def test_a_vllm_without_the_family_is_refused_naming_the_version_and_the_family(monkeypatch):
    only = dataclasses.replace(families.BY_NAME["qwen3-moe"], vllm_versions=("0.34.0",))
    monkeypatch.setitem(scope.BY_NAME, "qwen3-moe", only)
    assert scope.family_refusal("qwen3-moe", "0.34.0") is None
    assert scope.family_refusal("qwen3-moe", "0.33.0") == (
        "vLLM 0.33.0 has no qwen3-moe model (Qwen3MoeForCausalLM is not in its model registry; vLLM 0.34.0 has it)")
    why = scope.refusal("marlin", "wna16", "qwen3-moe", [("silu", {})], vllm_version="0.33.0")
    assert why.startswith("vLLM 0.33.0 has no qwen3-moe model")


def test_a_family_the_plugin_was_not_proven_on_is_refused_whatever_the_layout():
    unproven = [f.name for f in FAMILIES if not f.plugin_proven and not f.refused and not f.plan_only]
    assert unproven  # the table has such families; each is refused before the layout is looked at
    for name in unproven:
        why = scope.refusal("marlin", "wna16", name, [("silu", {})])  # as the converter asks, before any vLLM
        assert why.startswith(f"the vLLM plugin has not been proven on {name} models"), why


def test_registration_problem_says_in_one_line_why_vllm_would_not_serve_a_folder(monkeypatch):
    """What ``bench vllm-serve`` says instead of vLLM's "Load format `moeconvert` is not supported": the plugin
    not installed where vLLM looks (no entry point), or its ``register`` failed (here: an import failing)."""
    import importlib.metadata
    import sys

    import moeconvert.integrations.vllm as plugin

    monkeypatch.setattr(plugin, "REGISTER_ERROR", None)
    assert plugin.registration_problem() is None  # this environment's install has the entry point
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.quantization", None)  # its import fails
    plugin.register()  # never raises (vLLM would stop for every model)
    assert plugin.registration_problem() == ("moeconvert's vLLM plugin did not register: ModuleNotFoundError: "
                                             "import of vllm.model_executor.layers.quantization halted; None in "
                                             "sys.modules")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    problem = plugin.registration_problem()
    assert "no 'vllm.general_plugins' entry point named moeconvert" in problem and "\n" not in problem
