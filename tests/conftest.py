"""Shared pytest fixtures, and where the oracle tests find the engines' sources by default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import VLLM_VERSIONS

# The engines' sources the oracle tests read as the reference, where scripts/setup-tests.sh downloads them
# (.oracles/): used unless the variable names another copy. Set here, before any test module reads them.
# MOECONVERT_VLLM_SRC names every vLLM wheel there (one per version the oracles check, os.pathsep-separated).
ORACLES = Path(__file__).resolve().parents[1] / ".oracles"
ORACLE_DEFAULTS = {
    "MOECONVERT_VLLM_SRC": "vllm-*.whl",
    "MOECONVERT_FLASHINFER_SRC": "flashinfer_python-*.whl",
    "MOECONVERT_TRITON_KERNELS_SRC": "triton_kernels-from-vllm/vllm/third_party",  # holds triton_kernels/
    "MOECONVERT_HUMMING_SRC": "humming_kernels-*.whl",
}
for _env, _pattern in ORACLE_DEFAULTS.items():
    _found = sorted(ORACLES.glob(_pattern))
    if _found and not os.environ.get(_env):
        os.environ[_env] = os.pathsep.join(map(str, _found)) if _env == "MOECONVERT_VLLM_SRC" else str(_found[-1])


@pytest.fixture(params=VLLM_VERSIONS, ids=lambda v: f"vllm{v}")
def vllm_version(request):
    """Each vLLM version an oracle test compares against, read from that version's own source
    (``helpers.vllm_reader(vllm_version)`` skips, saying how to get it, where it is not at hand)."""
    return request.param


@pytest.fixture(scope="session")
def example_ckpt(tmp_path_factory):
    """Factory ``example_ckpt(family="qwen3-moe", scheme="bf16", **make_example_kwargs) -> Path``.

    Builds a real checkpoint with :func:`moeconvert.example.make_example` once per distinct set of
    arguments and session, so tests share them. The checkpoints are shared: treat them as
    read-only (copy one before damaging it).
    """
    pytest.importorskip("transformers")
    from moeconvert.example import make_example

    cache: dict = {}

    def make(family: str = "qwen3-moe", scheme: str = "bf16", **kw):
        key = (family, scheme, tuple(sorted(kw.items())))
        if key not in cache:
            base = tmp_path_factory.mktemp(f"{family}-{scheme}")
            cache[key] = make_example(base / "ckpt", family, scheme, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def kimi_k3_ckpt(tmp_path_factory):
    """Factory ``kimi_k3_ckpt(scheme="bf16") -> Path``: the tiny Kimi-K3 checkpoint of
    ``helpers.make_kimi_k3_checkpoint`` (bf16, or compressed-tensors ``mxfp4``), built once per session."""
    from helpers import make_kimi_k3_checkpoint

    cache: dict = {}

    def make(scheme: str = "bf16"):
        if scheme not in cache:
            if scheme != "bf16":
                pytest.importorskip("compressed_tensors")
            # the experts' sizes (latent L, I) are ones vLLM's compressed-tensors MXFP4 path holds unpadded for
            # Marlin (L a multiple of 256, I of 128), which the marlin layout needs to hold its bytes
            cache[scheme] = make_kimi_k3_checkpoint(tmp_path_factory.mktemp(f"kimi-k3-{scheme}") / "ckpt",
                                                    scheme=scheme, H=512, L=256, I=128)
        return cache[scheme]

    return make
