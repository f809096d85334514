"""What the kernel tests share: running a test module's child under ``TRITON_INTERPRET=1`` and reading
its report, and the error measure they compare with the reference.

The variable changes every Triton kernel defined after it is set, so it is set only in a child
process (``python tests/<module>.py <mode> <path>``), never in the pytest process itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from helpers import rel  # noqa: F401  (the error measure, re-exported for the kernel tests)

REPO = Path(__file__).resolve().parents[1]
# rel = |y - ref| / |ref| (Frobenius); fp32 dots are exact-ish, fp16/bf16 round weights and GEMM1's output
TOL = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 2e-2}


def run_child(module_file: str, mode: str, path: Path, timeout: int) -> None:
    """Run ``module_file mode path`` under the interpreter; fail the test with its output if it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, module_file, mode, str(path)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"interpreter child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def record(results: dict, key: str, fn, *args) -> None:
    """In the child: ``results[key] = fn(*args)``, or its traceback (read back by :func:`result`)."""
    try:
        results[key] = fn(*args)
    except Exception:
        results[key] = {"error": traceback.format_exc()}


def result(results: dict, key: str) -> dict:
    """One case of a child's report; a case that raised there fails here with its traceback."""
    r = results[key]
    if "error" in r:
        pytest.fail(f"{key} raised in the interpreter child:\n{r['error']}")
    return r
