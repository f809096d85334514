"""The README and docs/ as a user meets them: every command block runs as written where a CPU can run it.

* CI (``.ci/run``) runs exactly the README's two commands, the main job and the tests.
* The README's main job, run as written, succeeds and prints no warning; the README's Python snippet runs
  on the folder it writes.
* Every command block of README.md and docs/ is listed below, either as run here on the CPU (and run) or
  with the reason it is not (a GPU, vLLM's CUDA build, a synopsis with placeholders, ...). A new block
  fails :func:`test_every_command_block_is_accounted_for` until it is listed.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch

pytest.importorskip("transformers")

from moeconvert.runtime import KernelFallbackWarning, dispatch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
BIN = Path(sys.executable).parent  # where this environment's `python3` and `moeconvert` are

# A command block: a fence marked bash / sh / console / shell / python, or an unmarked one whose lines
# start with a command (the unmarked diagrams of docs/architecture.md are not).
COMMAND_FENCES = {"bash", "sh", "console", "shell", "python"}
COMMAND_START = re.compile(r"^((moeconvert|python3?|pip|vllm) |\./|[A-Z_]+=)", re.M)

#: blocks run here, on the CPU, by the test named
RUN_ON_CPU = {
    ("README.md", "./scripts/setup.sh && python3 -m moeconvert example out/example --overwrite && python3 -m "
                  "moeconvert repack out/example out/example-marlin --backend marlin --verify --overwrite"):
        "test_the_main_job_runs_as_written_and_warns_of_nothing (without ./scripts/setup.sh: this is its environment)",
    ("README.md", "import torch"): "test_the_load_snippet_runs_as_written",
    ("docs/runtime.md", "from moeconvert.layouts import W13, W2"): "test_the_cpu_blocks_of_docs_run_as_written",
    ("docs/scale-out.md", "moeconvert example dsv3/ --family deepseek-v3 --header-only      # 1.3 TB of sparse "
                          "shards, 11 MB on disk"): "test_the_cpu_blocks_of_docs_run_as_written",
}
#: blocks not run by a test, and why
NOT_RUN = {
    ("docs/scale-out.md", "moeconvert example k3/ --family kimi-k3 --scheme mxfp4 --header-only      # 1.48 TB of "
                          "sparse shards"):
        "all 92 layers take minutes to plan; tests/test_families.py writes the same form with --layers 2 and plans it "
        "(test_kimi_k3_shipped_mxfp4_is_planned_one_chunk_of_a_layer_per_job)",
    ("README.md", "./scripts/setup-tests.sh && python3 -m pytest -q"):
        "the tests themselves: CI runs this command (test_ci_runs_exactly_the_readmes_two_commands)",
    ("README.md", "moeconvert --version | -h | --help                       (every command takes -h / --help)"):
        "a synopsis with placeholders; tests/test_docs.py checks it against every command's --help",
    ("docs/quantize.md", "moeconvert quantize SRC OUT --format mxfp4 --backend "
                         "plain|emulation|marlin|humming|triton|triton-fast|flashinfer-cutlass|flashinfer-trtllm"):
        "a synopsis with placeholders; tests/test_docs.py checks that each option and value it names exists",
    ("docs/scale-out.md", "moeconvert quantize SRC OUT --format mxfp4 --backend marlin --dry-run         # jobs, "
                          "memory, time estimate"):
        "placeholders (SRC, OUT, a Ray head's address); the header-only block of the same page runs",
    ("docs/vllm.md", "pip install 'moeconvert[vllm]'                      # vLLM 0.33.0 and the plugin (an entry "
                     "point)"):
        "vLLM's CUDA build and a GPU (vllm serve, bench vllm-*), and 30B-parameter checkpoints from the Hub",
    ("docs/vllm.md", "./scripts/setup-tests.sh && python3 -m pytest tests/test_vllm_plugin.py"):
        "tests of this suite (the README's test command runs them)",
    ("docs/vllm.md", "MOECONVERT_VLLM_PYTHON=python3 python3 -m pytest -m gpu tests/test_vllm_plugin.py"):
        "a GPU and vLLM's CUDA build",
    ("docs/vllm.md", "moeconvert quantize openai/gpt-oss-20b gpt-oss-marlin/ --backend marlin   # or --backend triton"):
        "a 21B-parameter checkpoint from the Hub, and vllm serve needs vLLM's CUDA build and a GPU; the gpt-oss "
        "plugin tests run this path on a tiny gpt-oss checkpoint",
    ("docs/vllm.md", "moeconvert repack RedHatAI/Qwen3-30B-A3B-quantized.w4a16 qwen3-fast/ --backend triton-fast"):
        "a 30B-parameter checkpoint from the Hub, and vllm serve needs a CUDA GPU; the plugin tests run this path "
        "on tiny checkpoints (vLLM's CPU platform, TRITON_INTERPRET=1)",
    ("docs/vllm.md", "moeconvert repack RedHatAI/Qwen3-30B-A3B-quantized.w4a16 qwen3-humming/ --backend humming"):
        "a 30B-parameter checkpoint from the Hub, and vllm serve needs an SM90 GPU; the humming plugin tests run "
        "this path on a tiny checkpoint",
    ("docs/runtime.md", "import torch"):
        "written for a CUDA device (device=\"cuda\"); the README's load snippet is its CPU form and runs",
    ("docs/layouts/triton-mxfp4.md", "import torch"):
        "triton_kernels' matmul_ogs compiled for an SM90 GPU",
}


def command_blocks(page: Path) -> list[tuple[str, str, str]]:
    """(fence info string, first line, body) of each command block of ``page``."""
    out = []
    for indent, info, body in re.findall(r"^( *)```(\S*)\n(.*?)^\1```", page.read_text(), re.S | re.M):
        body = textwrap.dedent(body)  # a block inside a list item is indented with it
        if info in COMMAND_FENCES or (info == "" and COMMAND_START.search(body)):
            out.append((info, body.splitlines()[0].rstrip(), body))
    return out


def blocks() -> dict[tuple[str, str], tuple[str, str]]:
    return {(str(p.relative_to(REPO)), first): (info, body) for p in PAGES for info, first, body in command_blocks(p)}


def readme_commands() -> tuple[str, str]:
    """The README's two commands: the main job and the tests."""
    text = README.read_text()
    section = text[text.index("## Set up and run"):text.index("## Commands")]
    found = [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]
    assert len(found) == 2, "the README's set-up section has two commands, the main job and the tests"
    return found[0], found[1]


def test_every_command_block_is_accounted_for():
    found = blocks()
    listed = set(RUN_ON_CPU) | set(NOT_RUN)
    assert not set(RUN_ON_CPU) & set(NOT_RUN)
    assert sorted(set(found) - listed) == [], "a command block that runs nowhere: list it in RUN_ON_CPU or NOT_RUN"
    assert sorted(listed - set(found)) == [], "listed blocks that are no longer in the docs"


def test_ci_runs_exactly_the_readmes_two_commands():
    main_job, tests = readme_commands()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert main_job in ci and tests in ci and ci.index(main_job) < ci.index(tests)
    assert "./scripts/check-extras.sh" in ci  # and that every documented extra resolves
    # the main job's set-up installs what it needs; the tests' set-up the rest
    assert main_job.startswith("./scripts/setup.sh && ") and tests.startswith("./scripts/setup-tests.sh && ")


def run_block(body: str, cwd: Path, shell: bool = True) -> subprocess.CompletedProcess:
    assert (BIN / "moeconvert").exists(), "the console script is installed beside this Python"
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    argv = ["bash", "-euo", "pipefail", "-c", body] if shell else [sys.executable, "-c", body]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The README's main job, run as written in a fresh folder (its set-up step is this environment)."""
    command, _ = readme_commands()
    setup = "./scripts/setup.sh && "
    assert command.startswith(setup)
    cwd = tmp_path_factory.mktemp("readme")
    return cwd, run_block(command[len(setup):], cwd)


def test_the_main_job_runs_as_written_and_warns_of_nothing(main_job):
    cwd, done = main_job
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", "the README's own example should not trip a warning (or any other line)"
    assert "verified: identical to the source" in done.stdout
    assert (cwd / "out" / "example-marlin" / "moeconvert.json").is_file()


def test_the_load_snippet_runs_as_written(main_job, capsys):
    cwd, done = main_job
    assert done.returncode == 0, done.stderr
    python = [b for _, b in [blocks()[k] for k in blocks() if k == ("README.md", "import torch")]]
    assert len(python) == 1 and "from moeconvert.runtime import load" in python[0]
    old = os.getcwd()
    os.chdir(cwd)  # the snippet names out/example-marlin relative to where the main job ran
    try:
        scope: dict = {}
        dispatch._SAID.clear()  # said once per process: an earlier test may have loaded a marlin folder on CPU
        # without CUDA the layer says once that it runs the reference (as the README says)
        with contextlib.nullcontext() if torch.cuda.is_available() else pytest.warns(KernelFallbackWarning):
            exec(compile(python[0], "README.md", "exec"), scope)
    finally:
        os.chdir(old)
    y, x, layer = scope["y"], scope["x"], scope["layer"]
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(y.isfinite().all())
    # what it prints is the layer's kernel and the output's shape
    printed = capsys.readouterr().out.strip()
    assert printed == f"{layer.kernel} {tuple(y.shape)}"


@pytest.mark.parametrize("key", [k for k, test in RUN_ON_CPU.items() if test == "test_the_cpu_blocks_of_docs_run_as_written"],
                         ids=lambda k: k[0])
def test_the_cpu_blocks_of_docs_run_as_written(key, tmp_path):
    info, body = blocks()[key]
    done = run_block(body, tmp_path, shell=info != "python")
    assert done.returncode == 0, f"{key[0]}: {done.stderr}"
    assert "Traceback" not in done.stderr and "error" not in done.stderr.lower(), done.stderr
