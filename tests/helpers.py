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
    "minimax_m2": dict(_TINY, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                       bos_token_id=1, eos_token_id=2),
    "glm_moe_dsa": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_head_dim=16,
                        index_n_heads=2),
    "qwen3_next": dict(_TINY, num_hidden_layers=2, moe_intermediate_size=32, intermediate_size=64, num_experts=8,
                       num_experts_per_tok=2, shared_expert_intermediate_size=32, norm_topk_prob=True,
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
}


def make_family_checkpoint(out: Path, model_type: str, *, fused: bool = False, seed: int = 0) -> Path:
    """A tiny random checkpoint of ``model_type`` written by transformers: ``save_pretrained``'s own files,
    or with ``fused`` the model's tensors as it holds them (3-D experts: how published Qwen3.5 checkpoints
    store them, since save_pretrained splits them per expert) with save_pretrained's config.json."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **FAMILY_CONFIGS[model_type])
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
