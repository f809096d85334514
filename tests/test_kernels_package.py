"""The checkout's ``kernels/`` folder imported as a top-level ``kernels`` (the repository root on
``sys.path``, as under ``python -m`` from the checkout): it must hand over another installed package of
that name (Hugging Face's, which transformers imports), or, with none installed, leave a module that
transformers' availability check reports as absent (no ``__file__``, no version)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from interpreted import REPO

PROBE = """
import importlib, json, sys
sys.path = [sys.argv[1]] + [p for p in sys.path if p and not p.endswith(sys.argv[1])]
if sys.argv[2] == "hide-installed":  # only the standard library besides the checkout
    sys.path = [p for p in sys.path if "site-packages" not in p and "dist-packages" not in p]
import kernels
print(json.dumps({"file": getattr(kernels, "__file__", None), "version": getattr(kernels, "__version__", None),
                  "path": list(getattr(kernels, "__path__", [])), "ours": hasattr(kernels, "fused_moe")}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(REPO), mode], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_top_level_kernels_without_another_package_looks_absent():
    got = _probe("hide-installed")
    assert got == {"file": None, "version": None, "path": [], "ours": False}


def test_top_level_kernels_hands_over_an_installed_package():
    import importlib.machinery
    import os

    elsewhere = [p for p in sys.path if p and os.path.abspath(p) != str(REPO)]
    if importlib.machinery.PathFinder.find_spec("kernels", elsewhere) is None:
        pytest.skip("no other package named 'kernels' is installed")
    got = _probe("keep-installed")
    assert got["file"] is not None and not got["file"].startswith(str(REPO / "kernels"))
    assert not got["ours"]
