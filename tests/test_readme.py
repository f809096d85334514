"""The README's Python snippet runs as written, on the folder its main job writes."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest

import torch

pytest.importorskip("transformers")

from moeconvert.cli import main  # noqa: E402
from moeconvert.runtime import KernelFallbackWarning, dispatch  # noqa: E402
from moeconvert.example import make_example  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_the_load_snippet_runs_as_written(tmp_path, capsys):
    blocks = [b for b in python_blocks(README.read_text()) if "from moeconvert.runtime import load" in b]
    assert len(blocks) == 1, "the README has one load snippet"
    # the README's main job, with the CLI's defaults: the example checkpoint, repacked for Marlin
    make_example(tmp_path / "out" / "example")
    with pytest.raises(SystemExit) as exc:
        main(["repack", str(tmp_path / "out" / "example"), str(tmp_path / "out" / "example-marlin"),
              "--backend", "marlin"])
    assert exc.value.code == 0
    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the snippet names out/example-marlin relative to where the main job ran
    try:
        scope: dict = {}
        dispatch._SAID.clear()  # said once per process: an earlier test may have loaded a marlin folder on CPU
        # without CUDA the layer says once that it runs the reference (as the README says)
        with contextlib.nullcontext() if torch.cuda.is_available() else pytest.warns(KernelFallbackWarning):
            exec(compile(blocks[0], "README.md", "exec"), scope)
    finally:
        os.chdir(cwd)
    y, x, layer = scope["y"], scope["x"], scope["layer"]
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(y.isfinite().all())
    # what it prints is the layer's kernel and the output's shape
    printed = capsys.readouterr().out.strip()
    assert printed == f"{layer.kernel} {tuple(y.shape)}"

