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
import inspect
import io
import json
import math
import os
import re
import types
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


def damaged_copy(ckpt: Path, tmp_path: Path, replace=None, quantization_config=None) -> Path:
    """A copy of the one-shard checkpoint ``ckpt`` in ``tmp_path / "src"``, its tensors passed through
    ``replace`` (all tensors in, the changed ones out) and its ``quantization_config`` through
    ``quantization_config`` (edited in place)."""
    import shutil

    from safetensors.torch import load_file

    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    if replace:
        resave(src, replace=replace(load_file(src / "model.safetensors")))
    if quantization_config:
        cfg = json.loads((src / "config.json").read_text())
        quantization_config(cfg["quantization_config"])
        (src / "config.json").write_text(json.dumps(cfg))
    return src


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


_VLLM_MARLIN_FUNCTIONS = {
    "model_executor/layers/fused_moe/oracle/int_wna16.py":
        ["_pad_w13_shard_cols", "_pad_rows", "_pad_w13_bias", "_process_weights_marlin", "_process_awq_weights_marlin",
         "_unpack_and_dequant_int4_gptq", "_unpack_and_dequant_int4_awq"],
    "model_executor/layers/quantization/utils/marlin_utils.py":
        ["marlin_moe_padded_intermediate", "get_scale_perms", "marlin_permute_scales", "marlin_permute_bias",
         "marlin_moe_permute_scales", "marlin_zero_points", "moe_packed_to_marlin_zero_points",
         "awq_to_marlin_zero_points", "moe_awq_to_marlin_zero_points"],
    "model_executor/layers/quantization/utils/quant_utils.py": ["get_pack_factor", "pack_cols", "unpack_cols"],
    "model_executor/layers/quantization/utils/marlin_utils_test.py":
        ["marlin_permute_weights", "marlin_weights", "get_weight_perm"],
    "utils/math_utils.py": ["round_up"],
}


@functools.lru_cache(maxsize=None)
def vllm_marlin_reference(version: str):
    """vLLM ``version``'s own WNA16 Marlin MoE processing, lifted out of its files with ast and run with
    numpy/torch only (the compressed-tensors / GPTQ path, the AWQ path, and the Python dequantizations of
    GPTQ- and AWQ-packed int4 its emulation backend runs).

    Importing the modules would drag in vLLM's CUDA build and config machinery; these functions need
    none of it. The CUDA repack op is stood in by vLLM's own Python reference (``get_weight_perm`` +
    ``marlin_weights``), which the spec checked against an emulation of the CUDA kernel. The AWQ repack op
    is stood in by the same, after undoing AWQ's column order as vLLM's own ``awq_to_marlin_zero_points``
    undoes it for the zero points (``unpack_cols`` + ``argsort([0, 2, 4, 6, 1, 3, 5, 7])``).
    """
    import numpy

    read = vllm_reader(version)
    ns: dict = {"torch": torch, "numpy": numpy, "np": numpy, "math": math, "GPTQ_MARLIN_TILE": 16,
                "logger": types.SimpleNamespace(warning_once=lambda *a, **k: None, info_once=lambda *a, **k: None)}
    for path, names in _VLLM_MARLIN_FUNCTIONS.items():
        lift(read, path, names, ns)

    def gptq_marlin_moe_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        # 0.33.0 passes is_a_8bit (False for 16-bit activations, the only path the layout is for); 0.34.0
        # dropped the 8-bit activation path and the argument with it
        assert not is_a_8bit
        perm = ns["get_weight_perm"](num_bits)
        out = []
        for e in range(b_q_weight.shape[0]):
            q = ns["unpack_cols"](b_q_weight[e].T.contiguous(), num_bits, size_n, size_k).T.contiguous()
            out.append(ns["marlin_weights"](q, size_k, size_n, num_bits, perm))
        return torch.stack(out)

    def awq_marlin_moe_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        assert not is_a_8bit
        perm, undo = ns["get_weight_perm"](num_bits), numpy.argsort(numpy.array([0, 2, 4, 6, 1, 3, 5, 7]))
        out = []
        for e in range(b_q_weight.shape[0]):
            q = ns["unpack_cols"](b_q_weight[e], num_bits, size_k, size_n)
            q = q.reshape(-1, 8)[:, undo].reshape(size_k, size_n).contiguous()
            out.append(ns["marlin_weights"](q, size_k, size_n, num_bits, perm))
        return torch.stack(out)

    ns["ops"] = types.SimpleNamespace(gptq_marlin_moe_repack=gptq_marlin_moe_repack,
                                      awq_marlin_moe_repack=awq_marlin_moe_repack)
    return types.SimpleNamespace(**ns)


@functools.lru_cache(maxsize=None)
def vllm_nvfp4_dequantization(version: str) -> Callable:
    """vLLM ``version``'s ``dequantize_nvfp4_moe_weights`` (quantization/utils/nvfp4_emulation_utils.py), the
    dequantization its ``CompressedTensorsW4A4Nvfp4MoEMethod.dequantize_weight`` hands the online MXFP4
    method, lifted out with ast. Returns ``f(w13, s13, g13, w2, s2, g2, dtype) -> (w13, w2)`` over all
    experts: 0.33.0 returns the pair, 0.34.0 yields it per group of experts (concatenated here)."""
    ns: dict = {"torch": torch, "SimpleNamespace": types.SimpleNamespace,
                # only the CUDA (unswizzled) branch asks the platform; these tensors are on the CPU
                "current_platform": types.SimpleNamespace(is_cuda_alike=lambda: False)}
    lift(vllm_reader(version), "model_executor/layers/quantization/utils/nvfp4_emulation_utils.py",
         ["kE2M1ToFloat_handle", "break_fp4_bytes", "convert_swizzled_to_linear", "dequantize_to_dtype",
          "dequantize_nvfp4_moe_weights"], ns, optional=["_DEQUANT_CHUNK_BYTES", "_dequantize_nvfp4_moe_experts"])

    def run(w13, s13, g13, w2, s2, g2, dtype):
        out = ns["dequantize_nvfp4_moe_weights"](w13, s13, g13, w2, s2, g2, dtype, group_size=16,
                                                 invert_global_scales=True)
        if isinstance(out, tuple):
            return out
        chunks = list(out)
        return tuple(torch.cat([c[i] for c in chunks]) for i in (1, 2))
    return run


def vllm_process_marlin(ref, bits: int, g: int, I: int, p: dict) -> dict:
    """``_process_weights_marlin`` of ``ref``'s version on ``p`` for 16-bit activations, its outputs by name.

    0.33.0 takes an ``input_dtype`` (None: 16-bit activations) and returns the 8-bit path's input global
    scales (None here) between the zero points and the biases; 0.34.0 has neither."""
    layer = types.SimpleNamespace(intermediate_size_per_partition=I)
    fn = ref._process_weights_marlin
    lead = (layer, None) if "input_dtype" in inspect.signature(fn).parameters else (layer,)
    out = fn(*lead, bits, 32 // bits, g, p["w13"], p["w2"], p["w13_scale"], p["w2_scale"], p["w13_zero"],
             p["w2_zero"], p["w13_bias"], p["w2_bias"])
    if len(out) == 10:
        assert out[6] is None and out[7] is None  # no input global scales for 16-bit activations
        out = out[:6] + out[8:]
    return dict(zip(("w13", "w2", "s13", "s2", "z13", "z2", "b13", "b2"), out, strict=True))



def vllm_process_awq_marlin(ref, g: int, I: int, p: dict) -> dict:
    """``_process_awq_weights_marlin`` of ``ref``'s version (AWQ int4, 16-bit activations) on the params
    vLLM's AutoAWQMoEMethod holds after loading (``p``: w13 ``[E, H, 2I/8]``, w2 ``[E, I, H/8]``, scales
    ``[E, G, N]``, zeros ``[E, G, N/8]``), its outputs by name (0.33.0 takes an ``input_dtype`` and returns
    input global scales; 0.34.0 has neither)."""
    layer = types.SimpleNamespace(intermediate_size_per_partition=I, num_groups_w13=None, num_groups_w2=None)
    fn = ref._process_awq_weights_marlin
    lead = (layer, 4, 8, g) + ((None,) if "input_dtype" in inspect.signature(fn).parameters else ())
    out = fn(*lead, p["w13"], p["w2"], p["w13_scale"], p["w2_scale"], p["w13_zero"], p["w2_zero"],
             p["w13_bias"], p["w2_bias"])
    if len(out) == 10:  # 0.33.0: the 8-bit activation path's input global scales sit before the biases
        assert out[6] is None and out[7] is None
        out = out[:6] + out[8:]
    return dict(zip(("w13", "w2", "s13", "s2", "z13", "z2", "b13", "b2"), out, strict=True))


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


# ---------------------------------------------------------------------------------------------------
# GPTQ and AWQ checkpoints, written from their formats' specification (docs/sources.md)

#: AWQ's GEMM packing order: nibble i of a word holds column 8j + AWQ_PACK_ORDER[i] (AutoAWQ's pack)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts\.\d+\.(?:gate_proj|up_proj|down_proj))\.weight$")


def pack_words(fields: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """``[..., n]`` unsigned fields -> ``[..., n / pf]`` int32 words, field ``order[i]`` of each run of
    ``pf`` in bits ``[b*i, b*i + b)`` (plain order when None): shifts and sums, nothing of moeconvert's."""
    pf = 32 // bits
    f = fields.to(torch.int64).reshape(*fields.shape[:-1], -1, pf)
    if order is not None:
        f = f[..., list(order)]
    words = (f << (torch.arange(pf, dtype=torch.int64) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool):
    """Round-to-nearest codes ``u [N, K]`` (int64), fp16 scales and zero points ``[N, G]`` of ``w [N, K]``."""
    N, K = w.shape
    g = K if group_size == -1 else group_size
    wg = w.float().reshape(N, K // g, g)
    maxq = (1 << bits) - 1
    if sym:
        scale = (wg.abs().amax(-1) * 2 / maxq).clamp(min=1e-6).half()
        zero = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(0, maxq).to(torch.int64)
    u = torch.round(wg / scale.float()[..., None] + zero[..., None]).clamp(0, maxq).to(torch.int64)
    return u.reshape(N, K), scale, zero


def _autoround_packed(method: str, w: torch.Tensor, bits: int, group_size: int, scale, zero) -> dict:
    """One projection packed by AutoRound's own exporters (its GPTQ ``QuantLinear.pack``, its AWQ
    ``WQLinear_GEMM.from_linear``) from the same round-to-nearest scales and zero points."""
    N, K = w.shape
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = w.float()
    if method == "gptq":
        from auto_round.export.utils import get_autogptq_packing_qlinear

        ql = get_autogptq_packing_qlinear("auto_gptq", bits, group_size, True)(bits, group_size, K, N, False,
                                                                              g_idx=True)
        ql.pack(linear, scale.float(), 1 << (bits - 1), None, "cpu")  # symmetric: one zero, stored minus 1
        return {"qweight": ql.qweight, "qzeros": ql.qzeros, "scales": ql.scales, "g_idx": ql.g_idx}
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM

    q = WQLinear_GEMM.from_linear(linear, bits, group_size, scales=scale.float().T.contiguous(),
                                  zeros=zero.float().T.contiguous(), device="cpu")
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}


def int_loaded(src: Path, prefix: str, num_experts: int, suffixes=("qweight", "scales", "qzeros"),
               k_first: bool = True) -> dict[str, torch.Tensor]:
    """The params vLLM's GPTQ / AWQ MoE method holds after its loader: each projection's tensors stacked
    over experts as stored (K-first), gate then up along the output dim for w13. ``suffixes`` names the
    words, scales and zero points (None: absent); ``k_first=False`` reads N-first tensors (compressed-tensors'
    ``weight_packed [N, K/8]``, ``weight_scale [N, G]``) transposed to those shapes."""
    t = st_tensors(src)

    def per(proj: str, suffix: str) -> torch.Tensor:
        return torch.stack([t[f"{prefix}.{e}.{proj}.{suffix}"] if k_first else t[f"{prefix}.{e}.{proj}.{suffix}"].T
                            for e in range(num_experts)])

    out = {}
    for key, suffix in zip(("w", "s", "z"), suffixes):
        if suffix is not None:
            out[f"{key}13"] = torch.cat([per("gate_proj", suffix), per("up_proj", suffix)], dim=2)
            out[f"{key}2"] = per("down_proj", suffix)
    return out


#: checkpoints written by AutoRound itself (tests/data/autoround/make.py)
AUTOROUND = Path(__file__).resolve().parent / "data" / "autoround"


def make_int_checkpoint(bf16_dir: Path, out: Path, method: str, *, bits: int = 4, group_size: int = 32,
                        config: dict | None = None, g_idx: bool = True, producer: str = "spec") -> Path:
    """A GPTQ (``method`` "gptq": symmetric, ``checkpoint_format`` gptq, zeros stored minus 1) or AWQ
    (``method`` "awq": GEMM, asymmetric) copy of a bf16 example: every expert projection quantized by
    round-to-nearest and packed, as the format specifies (``producer`` "spec") or by AutoRound's own
    exporters (``producer`` "autoround"), every other tensor copied; ``config`` overrides
    quantization_config keys."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in bf16_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(bf16_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    written = {}
    for name, t in tensors.items():
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            written[name] = t
            continue
        module, K = m[1], t.shape[1]
        u, scale, zero = _rtn(t, bits, group_size, sym=method == "gptq")
        if producer == "autoround":
            packed = _autoround_packed(method, t, bits, group_size, scale, zero)
            written.update({f"{module}.{k}": v.contiguous() for k, v in packed.items() if g_idx or k != "g_idx"})
        elif method == "gptq":
            written[f"{module}.qweight"] = pack_words(u, bits).T.contiguous()  # [K/pf, N], packed along K
            written[f"{module}.qzeros"] = pack_words(zero.T.contiguous() - 1, bits)  # v1: zero - 1
            written[f"{module}.scales"] = scale.T.contiguous()
            if g_idx:
                written[f"{module}.g_idx"] = (torch.arange(K) // (K if group_size == -1 else group_size)).to(torch.int32)
        else:
            written[f"{module}.qweight"] = pack_words(u.T.contiguous(), bits, AWQ_PACK_ORDER)
            written[f"{module}.qzeros"] = pack_words(zero.T.contiguous(), bits, AWQ_PACK_ORDER)
            written[f"{module}.scales"] = scale.T.contiguous()
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    qc = ({"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": True,
           "checkpoint_format": "gptq", "lm_head": False, "pack_dtype": "int32"} if method == "gptq" else
          {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": None})
    cfg["quantization_config"] = {**qc, **(config or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


# ---------------------------------------------------------------------------------------------------
# tiny checkpoints of the families moeconvert.example does not make (built by transformers itself)

_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
#: model_type -> the tiny config's keyword arguments (E = 8 routed experts, top-2 unless the family is top-1)
FAMILY_CONFIGS: dict[str, dict] = {
    "qwen3_5_moe_text": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=16, intermediate_size=64,
                             shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                             linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
    "llama4_text": dict(_TINY, num_hidden_layers=2, intermediate_size=16, intermediate_size_mlp=64,
                        num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2),
    # rotary_dim, scoring_func, use_routing_bias: MiniMax-M2's published config.json writes them and vLLM's
    # MiniMaxM2 model reads them (transformers' config class keeps them as they are)
    "minimax_m2": dict(_TINY, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                       bos_token_id=1, eos_token_id=2, rotary_dim=8, scoring_func="sigmoid", use_routing_bias=True),
    "glm_moe_dsa": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_head_dim=16,
                        index_n_heads=2, topk_method="noaux_tc", scoring_func="sigmoid"),
    # first_k_dense_replace: GLM-4.7-Flash's config.json writes it and vLLM's Glm4MoeLite model reads it
    # (transformers' config class keeps it as it is, and says the same with mlp_layer_types)
    "glm4_moe_lite": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8,
                          num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32,
                          first_k_dense_replace=1,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "ernie4_5_moe": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, moe_num_experts=8,
                         moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1),
    "hunyuan_v1_moe": dict(_TINY, num_hidden_layers=2, intermediate_size=32, num_experts=8, moe_topk=2),
    "dots1": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1),
    # moe_layer_freq, hybrid_layer_pattern, layernorm_epsilon, swa_*, sliding_window_size: MiMo-V2-Flash's config.json
    # writes them and vLLM's MiMoV2 model reads them (transformers' config class keeps them as they are)
    "mimo_v2_flash": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8,
                          num_experts_per_tok=2, n_group=2, topk_group=1, v_head_dim=16, moe_layer_freq=[0, 1],
                          hybrid_layer_pattern=[0, 1], layernorm_epsilon=1e-5, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=16, sliding_window_size=128,
                          add_swa_attention_sink_bias=True),
    # zero_expert_type, mla_scale_q_lora, mla_scale_kv_lora: LongCat-Flash's config.json writes them and vLLM's
    # LongcatFlash model reads them (transformers' config class keeps them as they are); 4 zero experts beside the
    # 8 routed ones
    "longcat_flash": dict(_TINY, num_layers=2, expert_ffn_hidden_size=32, ffn_hidden_size=64, n_routed_experts=8,
                          moe_topk=2, zero_expert_num=4, zero_expert_type="identity", q_lora_rank=32, kv_lora_rank=32,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.0,
                          mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "qwen3_next": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, num_experts=8,
                       num_experts_per_tok=2, shared_expert_intermediate_size=32, norm_topk_prob=True,
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
}


def make_family_checkpoint(out: Path, model_type: str, *, fused: bool = False, seed: int = 0, **config) -> Path:
    """A tiny random checkpoint of ``model_type`` written by transformers: ``save_pretrained``'s own files,
    or with ``fused`` the model's tensors as it holds them (3-D experts: how published Qwen3.5 checkpoints
    store them, since save_pretrained splits them per expert) with save_pretrained's config.json;
    ``config`` overrides the tiny config's keywords."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**FAMILY_CONFIGS[model_type], **config})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # some experts are created empty (uninitialised): draw every parameter
        for p in model.parameters():
            p.normal_(0, 0.05)
    out.mkdir(parents=True)
    if fused:
        model.config.save_pretrained(out)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(out)
    return out


def split_fused_experts(src: Path, dst: Path, transposed: bool) -> Path:
    """``src`` with each fused ``experts.gate_up_proj`` / ``experts.down_proj`` split into one
    ``experts.E.{gate_proj,up_proj,down_proj}.weight [N, K]`` per expert, as llm-compressor's calibration
    modules save Llama 4 / Qwen3.5 experts (one MLP per expert); ``transposed``: stored ``x @ W``
    (``[E, H, 2I]``, ``[E, I, H]``: Llama 4), else ``[E, 2I, H]``, ``[E, H, I]``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, t in load_file(f).items():
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                t = t.transpose(1, 2) if transposed else t  # [E, N, K]
                module, proj = k.rsplit(".", 1)
                if proj == "down_proj":
                    out.update({f"{module}.{e}.down_proj.weight": t[e].contiguous() for e in range(t.shape[0])})
                    continue
                I = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{module}.{e}.gate_proj.weight"] = t[e, :I].contiguous()
                    out[f"{module}.{e}.up_proj.weight"] = t[e, I:].contiguous()
            else:
                out[k] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def make_bailing_checkpoint(out: Path, *, E: int = 8, H: int = 64, I: int = 32, seed: int = 0) -> Path:
    """A tiny Ling 2.0 (``bailing_moe_v2``) checkpoint: transformers has no class for it, so its config holds
    the fields vLLM 0.33.0's BailingMoE / BailingMoeBlock read (vllm/model_executor/models/bailing_moe.py:
    num_experts, num_experts_per_tok, moe_intermediate_size, num_shared_experts, first_k_dense_replace,
    score_function, moe_router_enable_expert_bias, n_group, topk_group, routed_scaling_factor,
    norm_topk_prob), and its tensors the names that model's load_weights maps: layer 0 dense
    (``mlp.{gate,up,down}_proj``), layer 1 MoE (``mlp.gate.weight``, ``mlp.gate.expert_bias``,
    ``mlp.experts.E.{gate,up,down}_proj.weight``, ``mlp.shared_experts.*``), attention as
    ``attention.query_key_value`` / ``attention.dense``, embeddings as ``model.word_embeddings``."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    heads, kv, hd, vocab = 4, 2, 16, 128
    t = {"model.word_embeddings.weight": w(vocab, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "lm_head.weight": w(vocab, H)}
    for L in range(2):
        p = f"model.layers.{L}"
        t.update({f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                  f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                  f"{p}.attention.query_key_value.weight": w((heads + 2 * kv) * hd, H),
                  f"{p}.attention.dense.weight": w(H, heads * hd)})
    t.update({f"model.layers.0.mlp.{n}.weight": w(*s) for n, s in
              (("gate_proj", (4 * I, H)), ("up_proj", (4 * I, H)), ("down_proj", (H, 4 * I)))})
    moe = "model.layers.1.mlp"
    t[f"{moe}.gate.weight"] = w(E, H)
    t[f"{moe}.gate.expert_bias"] = torch.zeros(E, dtype=torch.float32)
    for n, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        t[f"{moe}.shared_experts.{n}.weight"] = w(*s)
        t.update({f"{moe}.experts.{e}.{n}.weight": w(*s) for e in range(E)})
    out.mkdir(parents=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(model_type="bailing_moe_v2", architectures=["BailingMoeV2ForCausalLM"], vocab_size=vocab, hidden_size=H,
               intermediate_size=4 * I, moe_intermediate_size=I, num_experts=E, num_shared_experts=1,
               num_experts_per_tok=2, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=hd, hidden_act="silu", score_function="sigmoid",
               moe_router_enable_expert_bias=True, n_group=2, topk_group=1, routed_scaling_factor=2.5,
               norm_topk_prob=True, use_bias=False, use_qkv_bias=False, rms_norm_eps=1e-6, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def wrap_text_model(src: Path, dst: Path, wrapper: str, architecture: str) -> Path:
    """``src`` (a text model's checkpoint: ``model.*`` tensors) as its multimodal wrapper publishes it:
    config.json ``{"model_type": wrapper, "text_config": ..., "quantization_config": ...}`` and the text
    model's tensors under ``model.language_model.`` (transformers' Qwen3.5-MoE / Qwen3-VL checkpoint
    mapping; e.g. Qwen/Qwen3.5-35B-A3B-GPTQ-Int4 loads experts from ``model.language_model.layers.L.mlp.experts``)."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file({("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures", None)
    cfg = {"model_type": wrapper, "architectures": [architecture], "text_config": text}
    if "quantization_config" in text:
        cfg["quantization_config"] = text.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def rtn_dequantized(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """What the round-to-nearest codes :func:`make_int_checkpoint` writes for ``w [N, K]`` stand for:
    ``(u - zero) * scale`` per group, in float32."""
    u, scale, zero = _rtn(w, bits, group_size, sym)
    N, K = w.shape
    g = K if group_size == -1 else group_size
    return ((u.reshape(N, K // g, g) - zero[..., None]).float() * scale.float()[..., None]).reshape(N, K)


def to_gptoss_mxfp4(src: Path, dst: Path) -> None:
    """Rewrite a bf16 gpt-oss checkpoint in gpt-oss' own MXFP4 form (*_blocks / *_scales, N-first,
    rows interleaved), quantized with the vLLM rule."""
    import json
    import shutil

    from safetensors.torch import save_file

    from moeconvert.mxfp4 import quantize_mxfp4

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = {}
        with safe_open(f, "pt") as h:
            meta = h.metadata()
            for k in h.keys():
                t = h.get_tensor(k)
                if k.endswith(("gate_up_proj", "down_proj")):
                    p, s = quantize_mxfp4(t.transpose(1, 2).contiguous())  # [E, N, K]
                    tensors[k + "_blocks"] = p.view(*p.shape[:2], -1, 16).contiguous()
                    tensors[k + "_scales"] = s
                else:
                    tensors[k] = t
        save_file(tensors, str(f), metadata=meta)
    index = dst / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        wm = {}
        for k, v in idx["weight_map"].items():
            if k.endswith(("gate_up_proj", "down_proj")):
                wm[k + "_blocks"] = wm[k + "_scales"] = v
            else:
                wm[k] = v
        idx["weight_map"] = wm
        index.write_text(json.dumps(idx))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(cfg))


def make_deepseek_v4_checkpoint(out: Path, *, expert_dtype: str = "fp4", E: int = 4, H: int = 128, I: int = 64,
                                seed: int = 0) -> Path:
    """A tiny DeepSeek-V4 checkpoint in the published form (deepseek-ai/DeepSeek-V4-Flash; Flash-Base for
    ``expert_dtype="fp8"``): config.json with the fields of transformers' DeepseekV4Config that the family
    reads, ``expert_dtype`` and the ``fp8`` quantization_config (ue8m0 block scales); tensors under the names
    vLLM 0.33.0's DeepSeek-V4 loader maps (vllm/models/deepseek_v4/cpu/model.py, ``hf_to_vllm_mapper``):
    ``layers.L.ffn.experts.E.w{1,2,3}.{weight,scale}``, ``layers.L.ffn.gate.weight``, the hash layer's
    ``ffn.gate.tid2eid``, the other's ``ffn.gate.bias``, ``ffn.shared_experts.w{1,2,3}``, ``mtp.0`` tensors.
    FP4 experts: ``weight [N, K/2]`` int8 (two e2m1 codes a byte) and ``scale [N, K/32]`` float8_e8m0fnu;
    FP8 experts: ``weight [N, K]`` float8_e4m3fn and ``scale [N/128, K/128]`` fp32. Layer 0 routes by hash
    (``mlp_layer_types``), layer 1 by score."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    vocab, top_k = 64, 2

    def bf16(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    def fp4(n: int, k: int) -> dict[str, torch.Tensor]:
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.int8)
        scale = torch.randint(120, 128, (n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        return {"weight": codes, "scale": scale.view(torch.float8_e8m0fnu)}

    def fp8(n: int, k: int) -> dict[str, torch.Tensor]:
        w = (torch.randn(n, k, generator=gen) * 2).to(torch.float8_e4m3fn)
        return {"weight": w, "scale": torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 0.01 + 0.001}

    t = {"embed.weight": bf16(vocab, H), "head.weight": bf16(vocab, H), "norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "mtp.0.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    # the MTP layer's experts (copied as they are: not under layers.L)
    t.update({f"mtp.0.ffn.experts.0.w1.{s}": v for s, v in (fp4(I, H) if expert_dtype == "fp4" else fp8(I, H)).items()})
    for L in range(2):
        p = f"layers.{L}"
        t[f"{p}.attn_norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        t[f"{p}.ffn_norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        t[f"{p}.ffn.gate.weight"] = bf16(E, H)
        if L == 0:
            t[f"{p}.ffn.gate.tid2eid"] = torch.randint(0, E, (vocab, top_k), generator=gen, dtype=torch.int32)
        else:
            t[f"{p}.ffn.gate.bias"] = torch.zeros(E, dtype=torch.float32)
        for proj, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t.update({f"{p}.ffn.shared_experts.{proj}.{s}": v for s, v in fp8(n, k).items()})
            for e in range(E):
                made = fp4(n, k) if expert_dtype == "fp4" else fp8(n, k)
                t.update({f"{p}.ffn.experts.{e}.{proj}.{s}": v for s, v in made.items()})
    out.mkdir(parents=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=vocab, hidden_size=H,
               moe_intermediate_size=I, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=top_k,
               num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"], swiglu_limit=10.0, scoring_func="sqrtsoftplus",
               topk_method="noaux_tc",
               routed_scaling_factor=1.5, norm_topk_prob=True, num_nextn_predict_layers=1, hidden_act="silu",
               expert_dtype=expert_dtype, torch_dtype="bfloat16",
               quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def make_kimi_k3_checkpoint(out: Path, *, scheme: str = "bf16", E: int = 8, H: int = 128, L: int = 64, I: int = 32,
                            top_k: int = 2, linear_beta: float | None = 4.0, seed: int = 0) -> Path:
    """A tiny Kimi-K3 checkpoint (``kimi_k3`` wrapping a ``kimi_linear`` text config; transformers has no class
    for it): the keys of vLLM 0.33.0's KimiK3Config / KimiLinearConfig (vllm/transformers_utils/configs/
    kimi_k3.py, kimi_linear.py) and the MoE tensor names its loader maps (vllm/model_executor/models/kimi_k3:
    ``block_sparse_moe.experts.N.w1/w2/w3``), at the published checkpoint's structure
    (moeconvert/fullsize.py): two MoE layers whose experts see an ``L``-wide latent of the ``H``-wide hidden
    state, two shared experts, SITU with ``activation_situ_beta`` 1 and ``linear_beta``. ``scheme`` ``mxfp4``:
    the same weights as compressed-tensors' ``MXFP4PackedCompressor`` writes them (``mxfp4-pack-quantized``,
    through moeconvert.example's llm-compressor-equivalent path)."""
    import json
    import tempfile

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    vocab, p0 = 128, "language_model.model."
    t = {p0 + "embed_tokens.weight": w(vocab, H), p0 + "norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "language_model.lm_head.weight": w(vocab, H)}
    for i in range(2):
        p = f"{p0}layers.{i}."
        t.update({p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                  p + "block_sparse_moe.gate.weight": w(E, H),
                  p + "block_sparse_moe.gate.e_score_correction_bias": torch.zeros(E, dtype=torch.float32)})
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            t.update({q + "w1.weight": w(I, L), q + "w3.weight": w(I, L), q + "w2.weight": w(L, I)})
        q = p + "block_sparse_moe.shared_experts."
        t.update({q + "gate_proj.weight": w(2 * I, H), q + "up_proj.weight": w(2 * I, H),
                  q + "down_proj.weight": w(H, 2 * I)})
    text = {"model_type": "kimi_linear", "torch_dtype": "bfloat16", "vocab_size": vocab, "hidden_size": H,
            "routed_expert_hidden_size": L, "moe_intermediate_size": I, "num_experts": E,
            "num_experts_per_token": top_k, "num_shared_experts": 2, "num_hidden_layers": 2,
            "first_k_dense_replace": 0, "moe_layer_freq": 1, "hidden_act": "situ", "activation_situ_beta": 1.0,
            "activation_situ_linear_beta": linear_beta, "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True, "tie_word_embeddings": False}
    cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}
    if scheme == "bf16":
        out.mkdir(parents=True)
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
        return out
    from moeconvert.example import _write_pack_quantized

    with tempfile.TemporaryDirectory() as tmp:
        save_file(t, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(cfg, indent=1))
        out.mkdir(parents=True)
        _write_pack_quantized(Path(tmp), out, 4, -1, True, {p0 + "embed_tokens"}, "5GB", fp4=scheme)
    return out


def vllm_situ_and_mul(version: str) -> Callable[[torch.Tensor, float, float | None], torch.Tensor]:
    """vLLM ``version``'s own ``SituAndMul.forward_native`` (vllm/model_executor/layers/activation.py), run on
    the CPU as written there: ``f(x [..., 2I], beta, linear_beta) -> [..., I]`` (or skip, saying why)."""
    import types

    read = vllm_reader(version)
    rel = "model_executor/layers/activation.py"
    cls = top_level(read(rel))["SituAndMul"]
    forward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward_native")
    fn = exec_nodes([forward], f"vllm/{rel}", {"torch": torch})["forward_native"]
    return lambda x, beta, linear_beta=None: fn(types.SimpleNamespace(beta=float(beta), linear_beta=linear_beta), x)


def vllm_swiglustep_and_mul(version: str) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """vLLM ``version``'s own ``SwigluStepAndMul.forward_native`` (vllm/model_executor/layers/activation.py), run
    on the CPU as written there: ``f(x [..., 2I], limit) -> [..., I]`` (or skip, saying why)."""
    import types

    read = vllm_reader(version)
    rel = "model_executor/layers/activation.py"
    cls = top_level(read(rel))["SwigluStepAndMul"]
    forward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward_native")
    fn = exec_nodes([forward], f"vllm/{rel}", {"torch": torch, "F": torch.nn.functional})["forward_native"]
    return lambda x, limit: fn(types.SimpleNamespace(limit=float(limit)), x)


def vllm_supports_activation(version: str, rel: str, cls_name: str, activation: str) -> bool:
    """vLLM ``version``'s ``cls_name._supports_activation`` (in ``model_executor/layers/fused_moe/<rel>``) for
    ``activation``, run from its source with the version's own ``MoEActivation`` and ``apply_moe_activation``
    tables (fused_moe/activation.py)."""
    import enum

    read = vllm_reader(version)
    act_rel = "model_executor/layers/fused_moe/activation.py"
    found = top_level(read(act_rel))
    ns = exec_nodes([found[n] for n in ("MoEActivation", "_APPLY_MOE_ACTIVATIONS", "apply_moe_activation_supported")],
                    f"vllm/{act_rel}", {"Enum": enum.Enum})
    classes = top_level(read(f"model_executor/layers/fused_moe/{rel}"))
    cls, method = classes[cls_name], None
    while method is None:  # the class's own, else its first base's in the same file that defines one
        method = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_supports_activation"),
                      None)
        if method is None:
            cls = next(classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes)
    method.decorator_list = []
    fn = exec_nodes([method], f"vllm/{rel}", ns)["_supports_activation"]
    return bool(fn(ns["MoEActivation"](activation)))


def eval_c_activation(expr: str, a: float, b: float) -> float:
    """A humming ``binary_split`` activation expression (the C subset vLLM and runtime/humming.py write: float
    literals ``1.5f``, ``tanhf`` / ``expf`` / ``fminf`` / ``fmaxf``, or a ``[](float a, float b) {...}(a, b)``
    lambda of ``const float`` lines and a ``return``) evaluated in Python doubles at ``a`` (gate), ``b`` (up)."""
    import math
    import re

    def py(s: str) -> str:
        s = re.sub(r"(\d+\.\d*(?:[eE][-+]?\d+)?)f\b", r"\1", s)
        for c, p in (("tanhf", "math.tanh"), ("expf", "math.exp"), ("fminf", "min"), ("fmaxf", "max")):
            s = re.sub(rf"\b{c}\b", p, s)
        return s

    ns = {"math": math, "a": a, "b": b}
    lam = re.fullmatch(r"\s*\[\]\(float a, float b\)\s*\{(.*)\}\(a, b\)\s*", expr, re.S)
    if lam is None:
        return eval(py(expr), ns)  # noqa: S307 - our own and vLLM's expression text
    for stmt in filter(None, (x.strip() for x in lam[1].split(";"))):
        if stmt.startswith("return "):
            return eval(py(stmt[len("return "):]), ns)  # noqa: S307
        name, value = re.fullmatch(r"const float (\w+) = (.*)", stmt, re.S).groups()
        ns[name] = eval(py(value), ns)  # noqa: S307
    raise ValueError(f"no return in {expr!r}")


def vllm_humming_activation(version: str, activation: str, situ_beta: float | None = None,
                            situ_linear_beta: float | None = None) -> str:
    """vLLM ``version``'s humming ``activation_impl`` for ``activation`` (its ``get_humming_activation``,
    quantization/utils/humming/activation.py, run from source with its own ``MoEActivation`` and
    ``ApplyMoEActivationConfig``)."""
    import dataclasses
    import enum

    read = vllm_reader(version)
    act_rel = "model_executor/layers/fused_moe/activation.py"
    found = top_level(read(act_rel))
    ns = exec_nodes([found["MoEActivation"], found["ApplyMoEActivationConfig"]], f"vllm/{act_rel}",
                    {"Enum": enum.Enum, "dataclass": dataclasses.dataclass, "torch": torch})
    rel = "model_executor/layers/quantization/utils/humming/activation.py"
    nodes = [n for n in ast.parse(read(rel)).body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    ns = exec_nodes(nodes, f"vllm/{rel}", {**ns, "replace": dataclasses.replace})
    config = ns["ApplyMoEActivationConfig"](activation_situ_beta=situ_beta, activation_situ_linear_beta=situ_linear_beta)
    return ns["get_humming_activation"](ns["MoEActivation"](activation), config)["activation_impl"]


def make_step3p5_checkpoint(out: Path, *, E: int = 8, H: int = 64, I: int = 32, seed: int = 0, **config) -> Path:
    """A tiny Step-3.5 (``step3p5``) checkpoint of three decoder layers: layer 0 dense, layers 1 and 2 MoE, layer
    2's routed experts clamped (``swiglu_limits`` 7.0 there: vLLM's swiglustep). Its config.json is transformers'
    own ``Step3p7TextConfig`` (model_type step3p5) plus the fields vLLM's Step3p5 model reads that the class keeps
    as they are (use_moe_router_bias, need_fp32_gate, moe_router_activation, norm_expert_weight:
    vllm/model_executor/models/step3p5.py FusedMoEBlock). transformers has no causal LM of this type whose
    save_pretrained writes it, so the tensors carry the names vLLM's Step3p5Model.load_weights maps: the routed
    experts as three 3-D tensors ``model.layers.L.moe.{gate,up,down}_proj.weight`` (``[E, I, H]``, ``[E, I, H]``,
    ``[E, H, I]``), ``moe.gate.weight``, ``moe.router_bias``, the shared expert ``share_expert.{gate,up,down}_proj``
    beside ``moe``, the dense layer's ``mlp.{gate,up,down}_proj``; attention and norms as its decoder layer holds
    them. ``config`` overrides the config's keywords."""
    from safetensors.torch import save_file
    from transformers import Step3p7TextConfig

    kw = dict(hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, intermediate_size=96, moe_intermediate_size=I, share_expert_dim=32, n_routed_experts=E,
              num_experts_per_tok=2, mlp_layer_types=["dense", "sparse", "sparse"], swiglu_limits=[0.0, 0.0, 7.0],
              swiglu_limits_shared=[0.0, 0.0, 0.0], torch_dtype="bfloat16")
    cfg = Step3p7TextConfig(**{**kw, **config}).to_dict()
    cfg.update(architectures=["Step3p5ForCausalLM"], use_moe_router_bias=True, need_fp32_gate=True,
               moe_router_activation="sigmoid", norm_expert_weight=True)
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}

    def w(name: str, *shape: int) -> None:
        t[name] = (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    w("model.embed_tokens.weight", 128, H)
    w("lm_head.weight", 128, H)
    t["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    for i in range(3):
        p = f"model.layers.{i}"
        for n, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
            w(f"{p}.self_attn.{n}.weight", rows, H)
        w(f"{p}.self_attn.o_proj.weight", H, 64)
        for n in ("self_attn.q_norm", "self_attn.k_norm"):
            t[f"{p}.{n}.weight"] = torch.ones(16, dtype=torch.bfloat16)
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{n}.weight"] = torch.ones(H, dtype=torch.bfloat16)
        if i == 0:
            w(f"{p}.mlp.gate_proj.weight", 96, H), w(f"{p}.mlp.up_proj.weight", 96, H), w(f"{p}.mlp.down_proj.weight", H, 96)
            continue
        w(f"{p}.moe.gate_proj.weight", E, I, H), w(f"{p}.moe.up_proj.weight", E, I, H)
        w(f"{p}.moe.down_proj.weight", E, H, I)
        t[f"{p}.moe.gate.weight"] = (torch.randn(E, H, generator=gen) * 0.05)
        t[f"{p}.moe.router_bias"] = torch.zeros(E)
        w(f"{p}.share_expert.gate_proj.weight", 32, H), w(f"{p}.share_expert.up_proj.weight", 32, H)
        w(f"{p}.share_expert.down_proj.weight", H, 32)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def split_step3p5_experts(src: Path, dst: Path) -> Path:
    """``src`` (:func:`make_step3p5_checkpoint`) with each layer's three 3-D ``moe.{gate,up,down}_proj.weight``
    split into one ``moe.experts.E.{gate,up,down}_proj.weight`` per expert: the per-expert form vLLM's Step3p5
    loader reads for quantized checkpoints (llm-compressor's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    out = {}
    for k, t in load_file(src / "model.safetensors").items():
        block, _, proj = k.removesuffix(".weight").rpartition(".")
        if block.endswith(".moe") and proj in ("gate_proj", "up_proj", "down_proj"):
            out.update({f"{block}.experts.{e}.{proj}.weight": t[e].contiguous() for e in range(t.shape[0])})
        else:
            out[k] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
