"""Shared pytest fixtures, and where the oracle tests find the engines' sources by default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The engines' sources the oracle tests read as the reference, where scripts/setup-tests.sh downloads them
# (.oracles/): used unless the variable names another copy. Set here, before any test module reads them.
ORACLES = Path(__file__).resolve().parents[1] / ".oracles"
ORACLE_DEFAULTS = {
    "MOECONVERT_VLLM_SRC": "vllm-0.33.0-*.whl",
    "MOECONVERT_FLASHINFER_SRC": "flashinfer_python-*.whl",
    "MOECONVERT_TRITON_KERNELS_SRC": "triton_kernels-from-vllm/vllm/third_party",  # holds triton_kernels/
    "MOECONVERT_HUMMING_SRC": "humming_kernels-*.whl",
}
for _env, _pattern in ORACLE_DEFAULTS.items():
    _found = sorted(ORACLES.glob(_pattern))
    if _found and not os.environ.get(_env):
        os.environ[_env] = str(_found[-1])


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
