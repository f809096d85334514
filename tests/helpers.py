"""What many test modules share, in one place: the CLI run in-process, an output folder's tensors, a
bit-for-bit comparison, and the engines' own Python (vLLM's, FlashInfer's) read from their source for
the oracle comparisons.

The oracles never import vLLM or FlashInfer (both need their CUDA builds): the functions a layout must
equal are lifted out of the source files with ``ast`` and run on CPU tensors. The source is a wheel or a
folder named by an environment variable (``MOECONVERT_VLLM_SRC``, ``MOECONVERT_FLASHINFER_SRC``), else
the installed package, found without importing it, else the one in the vLLM environment the plugin tests
run (``MOECONVERT_VLLM_PYTHON``, or the ``.venv-vllm-cpu`` that ``scripts/setup.sh`` makes). vLLM's oracles
run once per version in ``VLLM_VERSIONS`` (the ``vllm_version`` fixture), each against that version's source.
"""

from __future__ import annotations

import __future__
import ast
import contextlib
import functools
import importlib.util
import io
import os
import re
import zipfile
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
from safetensors import safe_open

# ---------------------------------------------------------------------------------------------------
# the CLI, an output folder, bits, errors


class CliRun(NamedTuple):
    code: int
    out: str
    err: str


def cli(*args, expect: int | None = None) -> CliRun:
    """``moeconvert ARGS...`` run in this process: (exit code, stdout, stderr). With ``expect``, a
    different exit code fails the test, showing the command and what it wrote on stderr."""
    from moeconvert.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    run = CliRun(exc.value.code, out.getvalue(), err.getvalue())
    if expect is not None and run.code != expect:
        pytest.fail(f"moeconvert {' '.join(map(str, args))} exited {run.code}, not {expect}:\n{run.err}")
    return run


def st_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's ``*.safetensors`` files, read with safetensors' own reader."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error ``|a - b| / |b|`` (Frobenius norms; a zero ``b`` counts as tiny, not as zero)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bytes (NaN and -0.0 compare by their bits)."""
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def assert_refused(src, out, *phrases, extra=(), backend: str = "plain") -> str:
    """``moeconvert repack SRC OUT --backend BACKEND`` refuses: exit 2, one line on stderr holding every phrase,
    and nothing in OUT nor beside it that looks like an output. Returns the line."""
    code, _, err = cli("repack", src, out, "--backend", backend, *extra)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("moeconvert: error: "), err
    for p in phrases:
        assert p in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())
    assert not [p for p in out.parent.iterdir() if "moeconvert-partial" in p.name]
    return lines[0]


def resave(src: Path, drop=(), replace=None) -> None:
    """Rewrite a one-shard checkpoint's ``model.safetensors`` without ``drop`` and with ``replace``'s tensors."""
    from safetensors.torch import load_file, save_file

    f = Path(src) / "model.safetensors"
    tensors = load_file(f)
    for name in drop:
        del tensors[name]
    tensors.update(replace or {})
    save_file(tensors, f, metadata={"format": "pt"})


def assert_lists_exactly(problems: list[str], needles: list[str]) -> None:
    """``check``'s golden list: as many problems as needles, and each needle in exactly one problem."""
    assert len(problems) == len(needles), "\n".join(problems)
    for needle in needles:
        assert sum(needle in p for p in problems) == 1, needle


# ---------------------------------------------------------------------------------------------------
# an engine's source, read without importing it

VLLM_SRC = "MOECONVERT_VLLM_SRC"
FLASHINFER_SRC = "MOECONVERT_FLASHINFER_SRC"
#: every vLLM version the oracle tests check the layouts named after a vLLM kernel against, each against
#: that version's own source; a layout's ``made_for["vllm"]`` lists those whose tests it passes
VLLM_VERSIONS = ("0.33.0", "0.34.0")
VLLM_VERSION = VLLM_VERSIONS[0]  # the reference version (the first one checked)
REPO_VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm-cpu"  # made by scripts/setup.sh


def package_location(env: str, package: str) -> Path | None:
    """Where ``package``'s files are: ``$env`` (a wheel, a folder holding ``package/``, or the package
    folder itself; the first of several separated by ``os.pathsep``), else the installed package, found
    without importing it (so its CUDA dependencies are not needed). None when neither is at hand."""
    found = _locations(env, package)
    return found[0] if found else None


def _env_paths(env: str, package: str) -> list[Path]:
    """The sources ``$env`` names (``os.pathsep``-separated), each as a wheel or a package folder."""
    out = []
    for src in filter(None, os.environ.get(env, "").split(os.pathsep)):
        path = Path(src)
        if path.exists():
            out.append(path if path.is_file() or not (path / package).is_dir() else path / package)
    return out


def _locations(env: str, package: str) -> list[Path]:
    """Every copy of ``package`` at hand, in order: those ``$env`` names, else the installed one, else the
    ones in the vLLM environments the plugin tests run (``vllm_pythons``)."""
    named = _env_paths(env, package)
    if named or os.environ.get(env):
        return named
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return [Path(list(spec.submodule_search_locations)[0])]
    return [p for p in (_package_folder_of(python, package) for python in vllm_pythons()) if p is not None]


def vllm_locations() -> dict[str, Path]:
    """Each vLLM source at hand, by the version its ``_version.py`` assigns (the first copy of a version
    wins): every wheel or folder ``$MOECONVERT_VLLM_SRC`` names, then the installed vLLM, then those of the
    vLLM environments the plugin tests run. A copy whose version cannot be read is left out: the oracles
    compare against one version's code, named."""
    found: dict[str, Path] = {}
    named = _env_paths(VLLM_SRC, "vllm")
    candidates = named + ([] if named else [p for p in _installed_vllms() if p not in named])
    for where in candidates:
        version = package_version(_reader_at(where, "vllm"))
        if version is not None:
            found.setdefault(version, where)
    return found


def _installed_vllms() -> list[Path]:
    spec = importlib.util.find_spec("vllm")
    mine = [Path(list(spec.submodule_search_locations)[0])] if spec and spec.submodule_search_locations else []
    return mine + [p for p in (_package_folder_of(python, "vllm") for python in vllm_pythons()) if p is not None]


def vllm_location(version: str) -> Path | None:
    """vLLM ``version``'s source (a wheel or its ``vllm/`` folder), or None (see :func:`vllm_locations`)."""
    return vllm_locations().get(version)


def vllm_pythons() -> list[str]:
    """The Pythons of the vLLM environments the plugin tests use: ``MOECONVERT_VLLM_PYTHON``, then the
    ``.venv-vllm-cpu`` that scripts/setup.sh makes."""
    found = [os.environ["MOECONVERT_VLLM_PYTHON"]] if os.environ.get("MOECONVERT_VLLM_PYTHON") else []
    found += [str(p) for p in (REPO_VLLM_VENV / "bin" / "python", REPO_VLLM_VENV / "bin" / "python3") if p.exists()]
    return found


@functools.lru_cache(maxsize=None)
def _package_folder_of(python: str, package: str) -> Path | None:
    """Where ``python`` would import ``package`` from, asked of that interpreter without importing the
    package (whatever its environment's layout: a venv, conda, lib/python3.X or lib64)."""
    import subprocess

    code = ("import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
            "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')")
    try:
        p = subprocess.run([python, "-c", code, package], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    where = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else ""
    return Path(where) if where and Path(where).is_dir() else None


def _reader_at(where: Path, package: str) -> Callable[[str], str]:
    if where.is_file():
        zf = zipfile.ZipFile(where)
        return lambda rel: zf.read(f"{package}/{rel}").decode()
    return lambda rel: (where / rel).read_text()


def package_reader(env: str, package: str) -> Callable[[str], str] | None:
    """``read(rel)``: the text of ``package/rel`` (see :func:`package_location`), or None."""
    where = package_location(env, package)
    return None if where is None else _reader_at(where, package)


def package_version(read: Callable[[str], str], rel: str = "_version.py") -> str | None:
    """The ``__version__`` that ``rel`` assigns, or None when the file is absent or assigns none."""
    try:
        text = read(rel)
    except (KeyError, OSError):
        return None
    found = re.search(r"""^__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
    return found.group(1) if found else None


def vllm_missing(version: str) -> str:
    """Why an oracle against vLLM ``version`` cannot run: its source is not at hand, and how to get it."""
    have = ", ".join(sorted(vllm_locations())) or "none"
    return (f"vLLM {version}'s source not found (vLLM sources at hand: {have}): run scripts/setup-tests.sh, which "
            f"downloads it into .oracles/, or set MOECONVERT_VLLM_SRC to its wheel (pip download --no-deps "
            f"vllm=={version}) or a folder holding vllm/; several, separated by '{os.pathsep}'")


def vllm_reader(version: str = VLLM_VERSION) -> Callable[[str], str]:
    """vLLM ``version``'s source reader (:func:`vllm_locations`), or skip saying why."""
    where = vllm_location(version)
    if where is None:
        pytest.skip(vllm_missing(version))
    return _reader_at(where, "vllm")


#: the environment of a child running vLLM on its CPU platform (the plugin and parallel tests). No CUDA device is
#: visible (``CUDA_VISIBLE_DEVICES`` empty): vLLM 0.34.0's CPU platform refuses an x86 CPU whose Triton has no
#: active driver (platforms/cpu.py ``check_and_update_config``; the stock triton wheel has none for the CPU), and
#: vllm/triton_utils/importing.py keeps Triton where no device is visible. Nothing in those children runs a Triton
#: kernel.
VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}


@functools.lru_cache(maxsize=1)
def vllm_moe_ops():
    """vLLM's compiled MoE ops (its ``_moe_C`` library, as the runtime loads it), or skip."""
    from moeconvert.runtime import vllm_marlin

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if vllm_marlin.find_library()[0] is None:
        pytest.skip("set MOECONVERT_VLLM_MOE_LIB to vLLM 0.33.0's _moe_C library (vllm/_moe_C_stable_libtorch.abi3.so)")
    return vllm_marlin.ops()


def top_level(source: str) -> dict[str, ast.stmt]:
    """A module's top-level functions, classes and one-name assignments, by name (the last one wins)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node
    return out


def exec_nodes(nodes: list[ast.stmt], filename: str, ns: dict) -> dict:
    """Run ``nodes`` as a module named ``filename`` in the namespace ``ns`` (annotations left unevaluated)."""
    module = ast.fix_missing_locations(ast.Module(body=list(nodes), type_ignores=[]))
    exec(compile(module, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns


def undecorated(name: str, node: ast.stmt) -> ast.stmt:
    """An ``edit`` for :func:`lift`: the definition without its decorators (caches, API wrappers)."""
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        node.decorator_list = []
    return node


def lift(read: Callable[[str], str], rel: str, names, ns: dict, *, package: str = "vllm", optional=(),
         edit: Callable[[str, ast.stmt], ast.stmt] | None = None) -> dict:
    """Run the top-level definitions ``names`` of ``package/rel`` (functions, classes, one-name
    assignments) in ``ns``, in file order, as the module would; ``optional`` ones are taken when the
    file has them, ``edit(name, node)`` may rewrite a definition first. Fails naming what is missing."""
    filename = f"{package}/{rel}"
    found = top_level(read(rel))
    missing = set(names) - set(found)
    assert not missing, f"{filename} no longer defines {sorted(missing)}"
    wanted = set(names) | (set(optional) & set(found))
    nodes = sorted((found[n] for n in wanted), key=lambda node: node.lineno)
    by_node = {id(found[n]): n for n in wanted}
    if edit is not None:
        nodes = [edit(by_node[id(node)], node) for node in nodes]
    return exec_nodes(nodes, filename, ns)


def kernel_and_reference(layer, M: int, dtype):
    """(input, the layer's kernel's output, the reference's) for M tokens drawn from a seed of M and routed
    by the layer's own router: the GPU dispatch tests compare the two."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = (torch.randn(M, layer.hidden_size, device="cuda", generator=gen) * 4).to(dtype)
    w, ids = layer.route(layer.router_logits(x))
    return x, layer(x, w, ids), layer.reference(x, w, ids)
