"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


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
