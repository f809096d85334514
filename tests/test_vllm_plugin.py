"""The vLLM plugin: a folder written for vLLM, and vLLM's own MoE layer loading it as it is.

The first tests need no vLLM: the config.json a Marlin folder gets, and that the rest of moeconvert
still reads that folder. The others run vLLM 0.33.0's Python (its CPU platform) in a child process,
``MOECONVERT_VLLM_PYTHON`` (made by ``scripts/setup-vllm-cpu.sh``): vLLM's ``FusedMoEFactory`` builds
each layer with the quantization config vLLM's registry makes from the folder's config.json, the
tensors go through vLLM's own ``load_weights``, and after ``process_weights_after_loading`` every
parameter must hold the file's bytes in the storage it was given, with vLLM's Marlin kernel built over it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import AUTOROUND, VLLM_CPU_ENV, cli
from moeconvert.verify import verify_output

_REPO_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm-cpu"  # what scripts/setup.sh makes
VLLM_PYTHON = os.environ.get("MOECONVERT_VLLM_PYTHON") or (
    str(_REPO_VENV / "bin" / "python") if (_REPO_VENV / ".complete").exists() else None)
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="needs a Python with vLLM 0.33.0: MOECONVERT_VLLM_PYTHON, "
                                "or .venv-vllm-cpu made by scripts/setup.sh (left out with MOECONVERT_SKIP_VLLM=1)")
CHILD = Path(__file__).with_name("vllm_plugin_child.py")

SCHEMES = {  # name: (example arguments, the conversion)
    "w4a16-g128": (dict(scheme="w4a16"), ["repack", "--backend", "marlin"]),
    "w4a16-g128-asym": (dict(scheme="w4a16", symmetric=False), ["repack", "--backend", "marlin"]),
    "w4a16-channel": (dict(scheme="w4a16", group_size=-1), ["repack", "--backend", "marlin"]),
    "w8a16-g128": (dict(scheme="w8a16"), ["repack", "--backend", "marlin"]),
    "bf16-mxfp4": (dict(scheme="bf16", hidden_size=320, intermediate_size=96),
                   ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    "triton-w4a16-g128": (dict(scheme="w4a16"), ["repack", "--backend", "triton"]),
    "triton-w4a16-g128-asym": (dict(scheme="w4a16", symmetric=False), ["repack", "--backend", "triton"]),
    "triton-w8a16-g128": (dict(scheme="w8a16"), ["repack", "--backend", "triton"]),
    # moeconvert's own layout, served with its own Triton kernel as vLLM modular experts
    "fast-w4a16-g128": (dict(scheme="w4a16"), ["repack", "--backend", "triton-fast"]),
    "fast-w4a16-g32-asym": (dict(scheme="w4a16", group_size=32, symmetric=False), ["repack", "--backend", "triton-fast"]),
    "fast-w4a16-channel": (dict(scheme="w4a16", group_size=-1), ["repack", "--backend", "triton-fast"]),
    "fast-w8a16-g64-asym": (dict(scheme="w8a16", group_size=64, symmetric=False), ["repack", "--backend", "triton-fast"]),
    "fast-bf16-mxfp4": (dict(scheme="bf16", hidden_size=320, intermediate_size=96),
                        ["quantize", "--format", "mxfp4", "--backend", "triton-fast"]),
}
# what vLLM must build for each: (our method, vLLM's experts class)
BUILT = {"marlin-wna16": ("MarlinWNA16Method", "MarlinExperts"), "marlin-mxfp4": ("MarlinMXFP4Method", "MarlinExperts"),
         "triton-wna16": ("TritonWNA16Method", "TritonWNA16Experts"),
         "fast-wna16": ("TritonFastMethod", "MoeconvertFastExperts"),
         "fast-mxfp4": ("TritonFastMethod", "MoeconvertFastExperts")}
#: moeconvert's Triton kernel runs on vLLM's CPU platform only under Triton's interpreter
INTERPRET = {"TRITON_INTERPRET": "1"}


def _built(scheme: str) -> tuple[str, str]:
    layout = scheme.split("-")[0] if scheme.startswith(("triton-", "fast-")) else "marlin"
    return BUILT[f"{layout}-{'mxfp4' if scheme.endswith('mxfp4') else 'wna16'}"]


@pytest.fixture(scope="module")
def folders(example_ckpt, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-folders")
    made = {}
    for name, (kw, verb) in SCHEMES.items():
        src = example_ckpt("qwen3-moe", **kw)
        out = base / name
        cli(verb[0], src, out, *verb[1:], expect=0)
        made[name] = (src, out)
    return made


def test_a_marlin_folder_names_the_plugin_and_keeps_the_sources_config(folders):
    src, out = folders["w4a16-g128"]
    source_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert qc == {"quant_method": "moeconvert", "format_version": 2, "layout": {"name": "marlin", "version": 1},
                  "made_for": {"vllm": ["0.33.0", "0.34.0"]}, "dtype": "bfloat16",
                  "partition": {"tp_size": 1, "tp_rank": 0, "ep_size": 1, "ep_rank": 0},
                  "source_quantization_config": source_cfg.pop("quantization_config")}
    assert cfg == source_cfg  # nothing else changes
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert manifest["copied_files"]["config.json"]["sha256"] == hashlib.sha256((out / "config.json").read_bytes()).hexdigest()
    assert cli("verify", out, "--against", src).code == 0


def test_other_layouts_copy_config_json_as_it_is(example_ckpt, tmp_path):
    src = example_ckpt("qwen3-moe", scheme="w4a16")
    cli("repack", src, tmp_path / "out", "--backend", "emulation", expect=0)
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_the_runtime_still_reads_a_folder_written_for_vllm(example_ckpt, tmp_path):
    """Qwen2-MoE's shared expert is pack-quantized: the runtime finds its scheme through the plugin's
    ``source_quantization_config``."""
    from moeconvert.runtime import load

    src = example_ckpt("qwen2-moe", scheme="w4a16")
    cli("repack", src, tmp_path / "out", "--backend", "marlin", expect=0)
    model = load(tmp_path / "out", device="cpu", verify=True)
    layer = next(iter(model.moe_layers.values()))
    shared = layer.shared  # dequantized on first use, with the scheme the source config gives
    assert shared is not None and shared.w_gate.dtype == torch.float32


def _child(folder: Path, *args, env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, **VLLM_CPU_ENV, **(env or {})}
    p = subprocess.run([VLLM_PYTHON, str(CHILD), str(folder), *args], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _gpu_child(folder: Path, *args) -> dict:
    """The child on vLLM's CUDA platform (the GPU tests): no VLLM_TARGET_DEVICE, vLLM finds the GPU."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    p = subprocess.run([VLLM_PYTHON, str(CHILD), str(folder), *args], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    return got


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _jobs(tmp_path_factory, jobs: list, *mode: str, env: dict[str, str] | None = None) -> list:
    """One vLLM child process over a list of jobs (a process start costs as much as a job)."""
    path = tmp_path_factory.mktemp("vllm-jobs") / "jobs.json"
    path.write_text(json.dumps(jobs))
    got = _child(path, *mode, env=env)
    assert isinstance(got, list) and len(got) == len(jobs), got
    return got


@pytest.fixture(scope="module")
def layer_checks(folders, tmp_path_factory):
    """Every scheme's folder, its MoE layers built, loaded and processed, in one child (the triton-fast
    folders need Triton's interpreter to build their kernel on the CPU; nothing runs a kernel here)."""
    if not VLLM_PYTHON:
        pytest.skip("needs a Python with vLLM 0.33.0 (MOECONVERT_VLLM_PYTHON or .venv-vllm-cpu)")
    names = sorted(SCHEMES)
    return dict(zip(names, _jobs(tmp_path_factory, [str(folders[n][1]) for n in names], "--layers-jobs",
                                 env=INTERPRET)))


@needs_vllm
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_vllms_moe_layer_holds_the_files_bytes_after_processing(layer_checks, folders, scheme):
    _, out = folders[scheme]
    got = layer_checks[scheme]
    assert "error" not in got, got["error"]
    manifest = json.loads((out / "moeconvert.json").read_text())
    files = _file_tensors(out)
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for m in manifest["moe_layers"]:
        layer = got["layers"][m["prefix"]]
        method, experts_class = _built(scheme)
        assert layer["method"] == method and layer["experts_class"] == experts_class
        assert layer["scale_is_param"]  # the kernel reads the parameter itself, not a copy
        assert layer["loaded"] == sorted(f"routed_experts.{s}" for s in m["tensors"])
        assert set(layer["params"]) == {f"routed_experts.{s}" for s in m["tensors"]}
        for suffix, entry in m["tensors"].items():
            param = layer["params"][f"routed_experts.{suffix}"]
            want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
            assert param["sha256"] == want and not param["moved"], suffix
            assert param["shape"] == entry["shape"]


WHOLE = ["w4a16-g128", "bf16-mxfp4", "triton-w4a16-g128-asym", "fast-w4a16-g32-asym"]


@pytest.fixture(scope="module")
def whole_model_checks(folders, gpt_oss_folders, tmp_path_factory):
    """Every whole-model load of this module in one child: WHOLE with vLLM's default loader, each gpt-oss
    folder with ``--load-format moeconvert``, and the gpt-oss Marlin folder with the default loader."""
    if not VLLM_PYTHON:
        pytest.skip("needs a Python with vLLM 0.33.0 (MOECONVERT_VLLM_PYTHON or .venv-vllm-cpu)")
    jobs = {("whole", n): [str(folders[n][1]), "auto"] for n in WHOLE}
    jobs |= {("gpt-oss", n): [str(gpt_oss_folders[n][1]), "moeconvert"] for n in sorted(GPT_OSS)}
    jobs[("gpt-oss-auto", "marlin")] = [str(gpt_oss_folders["marlin"][1]), "auto"]
    return dict(zip(jobs, _jobs(tmp_path_factory, list(jobs.values()), "--whole-models", env=INTERPRET)))


@needs_vllm
@pytest.mark.parametrize("scheme", WHOLE)
def test_vllm_loads_the_whole_model_from_the_folder(whole_model_checks, folders, scheme):
    """What ``vllm serve`` does up to its first forward, on the CPU platform: vLLM's ModelConfig picks the
    plugin's method from config.json, vLLM's default loader builds the model and feeds it every tensor of
    the folder (the name mapping included), then processes every module."""
    _, out = folders[scheme]
    got = whole_model_checks[("whole", scheme)]
    assert "error" not in got, got["error"]
    assert got["quantization"] == "moeconvert"
    files = _file_tensors(out)
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for m in manifest["moe_layers"]:
        layer = got["layers"][m["prefix"]]
        assert layer["experts_class"] == _built(scheme)[1] and layer["scale_is_param"]
        assert layer["loaded"] == sorted(f"routed_experts.{s}" for s in m["tensors"])
        for suffix, entry in m["tensors"].items():
            want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
            assert layer["params"][f"routed_experts.{suffix}"]["sha256"] == want, suffix


@needs_vllm
def test_the_whole_model_loads_on_a_cpu_with_amx_tiles(folders):
    """On a CPU with AMX tiles vLLM's CPU platform would pack the router's weight for a kernel the wheel
    does not ship (``torch.ops._C.convert_weight_packed``): the child pins torch's GEMM, and this runs it
    with torch reporting AMX tiles, as such a CPU makes it do."""
    _, out = folders["w4a16-g128"]
    got = _child(out, "--whole-model", env={"MOECONVERT_TEST_CPU_CAPABILITIES": "amx_tile"})
    assert "error" not in got, got["error"]
    assert got["quantization"] == "moeconvert" and got["layers"]


# triton-fast folders whose forward runs on vLLM's CPU platform: every WNA16 format and MXFP4 (SiLU); gpt-oss's
# (swigluoai, expert biases) is ``gpt-oss`` below
FAST_CPU = sorted(name for name in SCHEMES if name.startswith("fast-")) + ["gpt-oss"]


@pytest.fixture(scope="module")
def vllm_interpreter() -> None:
    """Skip, saying why, where the vLLM Python's Triton interpreter cannot run the kernel: Triton 3.6's (vLLM
    0.33.0's pin) turns one-element arrays into loop bounds with int(), which NumPy 2.4 refuses (Triton 3.9
    squeezes them first); ``scripts/setup-vllm-cpu.sh`` installs numpy < 2.4 for this."""
    p = subprocess.run([VLLM_PYTHON, "-c", "import numpy, triton; print(numpy.__version__, triton.__version__)"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    numpy_v, triton_v = (tuple(int(x) for x in v.split(".")[:2]) for v in p.stdout.split())
    if numpy_v >= (2, 4) and triton_v < (3, 7):
        pytest.skip(f"the vLLM Python has Triton {p.stdout.split()[1]} with NumPy {p.stdout.split()[0]}: Triton's "
                    "interpreter there cannot convert one-element arrays with NumPy >= 2.4; make the environment "
                    "again with scripts/setup-vllm-cpu.sh (numpy < 2.4)")


@needs_vllm
@pytest.mark.parametrize("name", FAST_CPU)
def test_vllms_moe_layer_runs_moeconverts_kernel_on_a_triton_fast_folder(vllm_interpreter, folders, gpt_oss_folders,
                                                                         name):
    """vLLM's CPU platform, ``TRITON_INTERPRET=1``: each MoE layer built by the plugin's ``TritonFastMethod``,
    loaded through vLLM's ``load_weights``, run through the ``FusedMoEKernel`` it builds (vLLM's prepare /
    finalize around ``MoeconvertFastExperts``) on 1 and 5 routed tokens, against ``reference_moe`` on the
    source checkpoint's own weights (decoded from the source, not from the folder). The layers hold the
    folders' bf16 tensors; the tokens are float16, since Triton's interpreter gets bf16 dots wrong
    (DESIGN.md, "Testing"). The same check on CUDA in bf16: the GPU tests below."""
    src, out = gpt_oss_folders["fast"] if name == "gpt-oss" else folders[name]
    got = _child(out, "--cpu-forward", str(src), env=INTERPRET)
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for prefix, layer in got["layers"].items():
        assert layer["experts_class"] == "MoeconvertFastExperts"
        assert sorted(layer["tokens"]) == ["1", "5"]
        for M, r in layer["tokens"].items():
            assert r["x_dtype"] == "torch.float16" and r["finite"] and r["want_norm"] > 0, (prefix, M)
            assert r["rel"] < 2e-2, (prefix, M, r["rel"])


@needs_vllm
def test_a_triton_fast_folder_is_refused_in_one_line_where_the_kernel_cannot_run(folders):
    """vLLM's CPU platform without Triton's interpreter: no CUDA, so moeconvert's Triton kernel cannot run;
    refused when the layer is built, before a byte is read."""
    _, out = folders["fast-w4a16-g128"]
    got = _child(out, env={"TRITON_INTERPRET": ""})
    assert "error" in got and got["layers"] == {}, got
    assert "\n" not in got["error"], got["error"]
    assert got["error"].startswith("ValueError: moeconvert: model.layers.0.mlp.experts: moeconvert's Triton kernel "
                                   "needs a CUDA GPU (vLLM runs on its cpu platform"), got["error"]
    # off GPUs no other method's folder runs either (the old line sent the user to Marlin, CUDA only too)
    assert got["error"].endswith("serve on a CUDA GPU (vLLM runs on its cpu platform)"), got["error"]


@needs_vllm
def test_deepseek_v3_loads_through_each_parameters_own_loader(example_ckpt, tmp_path):
    """DeepSeek-V2/V3 and Kimi-K2's vLLM loader looks the (mapped) name up and calls the parameter's
    ``weight_loader(param, tensor)`` itself."""
    src = example_ckpt("deepseek-v3", scheme="w4a16")
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "marlin", expect=0)
    got = _child(out, "--direct")
    assert "error" not in got, got["error"]
    files = _file_tensors(out)
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for m in manifest["moe_layers"]:
        for suffix, entry in m["tensors"].items():
            param = got["layers"][m["prefix"]]["params"][f"routed_experts.{suffix}"]
            want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
            assert param["sha256"] == want and not param["moved"]


@needs_vllm
def test_a_vllm_started_for_another_tp_size_is_refused_before_loading(folders):
    _, out = folders["w4a16-g128"]
    got = _child(out, "--tp-size", "2")
    assert ("this vLLM builds the layer for TP 2 rank 0, EP 1 rank 0; this folder holds the full (TP 1) tensors, a "
            "marlin TP rank of 2 is not a slice of them (a TP rank of 2 cannot hold this layer") in got["error"]
    assert got["error"].endswith("a TP rank of 2 cannot hold it in this layout at all"), got["error"]
    assert got["layers"] == {}


@needs_vllm
def test_another_vllm_version_is_refused_naming_it(folders):
    _, out = folders["w4a16-g128"]
    got = _child(out, "--pretend-vllm", "0.35.0")
    assert "this vLLM is 0.35.0; the moeconvert plugin serves its folders on vLLM 0.33.0, 0.34.0 only" in got["error"]
    assert "\n" not in got["error"]


def _made_for_one_version(folder: Path, dest: Path) -> Path:
    """A copy of ``folder`` as written before made_for listed versions: ``"vllm": "0.33.0"`` in config.json and
    in the manifest."""
    old = _edited_copy(folder, dest, lambda qc: qc.update(made_for={"vllm": "0.33.0"}))
    manifest = json.loads((old / "moeconvert.json").read_text())
    manifest["layout"]["made_for"] = {"vllm": "0.33.0"}
    (old / "moeconvert.json").write_text(json.dumps(manifest, indent=1))
    return old


@needs_vllm
def test_a_folder_made_before_version_lists_is_still_served(folders, tmp_path):
    """A folder written when made_for named one version (``"vllm": "0.33.0"``, in config.json and the manifest)
    has the bytes of the same layout version: it is served on every version the layout lists now."""
    _, out = folders["w4a16-g128"]
    old = _made_for_one_version(out, tmp_path / "old")
    manifest = json.loads((old / "moeconvert.json").read_text())
    got = _child(old)
    assert "error" not in got, got.get("error")
    assert set(got["layers"]) == {m["prefix"] for m in manifest["moe_layers"]}


@needs_vllm
def test_a_vllm_the_folders_layout_does_not_list_is_refused_naming_those_it_lists(folders, tmp_path):
    """The plugin serves a folder on the vLLM versions its layout lists (made_for): here the child takes 0.34.0
    out of the Marlin layout's list, as for a layout whose oracles have not passed against 0.34.0, and serves a
    folder made for 0.33.0 alone (a folder listing 0.34.0 would be refused for that, by the manifest check)."""
    _, out = folders["w4a16-g128"]
    old = _made_for_one_version(out, tmp_path / "old")
    got = _child(old, "--pretend-vllm", "0.34.0", "--layout-lists", "0.33.0")
    assert ("this vLLM is 0.34.0; this folder's layout (marlin version 1, wna16) is served on vLLM 0.33.0 only, the "
            "versions whose processing its bytes were checked against: pip install vllm==0.33.0") in got["error"]
    assert got["layers"] == {}


@needs_vllm
def test_a_tensor_that_never_arrives_is_refused_after_loading(folders):
    """vLLM does not check that a quantized model got all its weights; the method does."""
    _, out = folders["w4a16-g128"]
    got = _child(out, "--skip", "w2_weight_scale")
    assert "model.layers.0.mlp.experts: w2_weight_scale never loaded" in got["error"]


GPT_OSS = {  # name: (the source: bf16, or gpt-oss's own MXFP4 form; the conversion; vLLM's experts class)
    "marlin": ("bf16", ["quantize", "--format", "mxfp4", "--backend", "marlin"], "MarlinMXFP4Method", "MarlinExperts"),
    "triton": ("mxfp4", ["quantize", "--backend", "triton"], "TritonMXFP4Method", "OAITritonMxfp4ExpertsMonolithic"),
    "fast": ("mxfp4", ["quantize", "--backend", "triton-fast"], "TritonFastMethod", "MoeconvertFastExperts"),
}


@pytest.fixture(scope="module")
def gpt_oss_folders(example_ckpt, tmp_path_factory):
    """gpt-oss (experts with biases, swigluoai) in Marlin MXFP4 from a bf16 checkpoint, and in triton_kernels'
    MXFP4 from gpt-oss's own MXFP4 form (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``, as OpenAI
    publishes it), relaid out without quantizing again."""
    from helpers import to_gptoss_mxfp4

    base = tmp_path_factory.mktemp("gpt-oss-folders")
    bf16 = example_ckpt("gpt-oss", intermediate_size=256)
    mxfp4 = base / "src-mxfp4"
    to_gptoss_mxfp4(bf16, mxfp4)
    made = {}
    for name, (source, verb, _, _) in GPT_OSS.items():
        src = mxfp4 if source == "mxfp4" else bf16
        cli(verb[0], src, base / name, *verb[1:], expect=0)
        made[name] = (src, base / name)
    return made


@pytest.mark.parametrize("name", sorted(GPT_OSS))
def test_a_gpt_oss_folder_tells_vllm_its_load_format(gpt_oss_folders, name):
    """config.json names ``--load-format moeconvert``; an MXFP4 source's own quantization_config is kept."""
    src, out = gpt_oss_folders[name]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "moeconvert" and qc["load_format"] == "moeconvert"
    assert qc["source_quantization_config"] == json.loads((src / "config.json").read_text()).get("quantization_config")
    assert verify_output(out, against=str(src)).ok


@needs_vllm
@pytest.mark.parametrize("name", sorted(GPT_OSS))
def test_vllm_serves_a_gpt_oss_folder_with_the_moeconvert_load_format(whole_model_checks, gpt_oss_folders, name):
    """``vllm serve OUT --load-format moeconvert`` up to its first forward, on the CPU platform (TP 1): the
    plugin's loader reads each MoE layer's experts into the method's parameters and vLLM's GptOssModel loads
    the rest; every expert parameter then holds the file's bytes (the w2 bias included: TP 1 is rank 0),
    vLLM's kernel is built over the parameters themselves, with gpt-oss's activation as vLLM's own gpt-oss
    method passes it (quantization/mxfp4.py: alpha 1.702, beta 1, limit 7). triton_kernels' and Marlin's
    kernels need CUDA: the forward runs in the GPU tests below."""
    _, out = gpt_oss_folders[name]
    _, _, method, experts_class = GPT_OSS[name]
    got = whole_model_checks[("gpt-oss", name)]
    assert "error" not in got, got["error"]
    assert got["quantization"] == "moeconvert"
    files = _file_tensors(out)
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"]) and len(got["layers"]) == 2
    for m in manifest["moe_layers"]:
        layer = got["layers"][m["prefix"]]
        assert layer["method"] == method and layer["experts_class"] == experts_class
        assert layer["scale_is_param"] and layer["weights_are_params"]
        assert layer["activation"] == ["swigluoai", 1.702, 1.0, 7.0]
        assert layer["loaded"] == sorted(f"routed_experts.{s}" for s in m["tensors"]) and "w2_bias" in m["tensors"]
        for suffix, entry in m["tensors"].items():
            want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
            assert layer["params"][f"routed_experts.{suffix}"]["sha256"] == want, suffix


@needs_vllm
def test_a_gpt_oss_folder_is_refused_with_any_other_loader_in_one_line(whole_model_checks):
    """vLLM's default loader would hand the stacked experts to GptOssModel.load_weights, which slices and
    transposes every tensor named w13_weight / w2_weight itself: refused when the first layer is built."""
    got = whole_model_checks[("gpt-oss-auto", "marlin")]
    assert got["layers"] == {} and "\n" not in got["error"], got["error"]
    assert got["error"].startswith("ValueError: moeconvert: model.layers.0.mlp.experts: a gpt-oss folder is served "
                                   "with --load-format moeconvert only"), got["error"]
    assert got["error"].endswith("serve with --load-format moeconvert (this vLLM loads with 'auto')"), got["error"]


# ---------------------------------------------------------------------------------------------------
# folders from the other source formats: their routed experts in the plugin's methods, every other layer
# under the quantization config vLLM itself builds for the source

# vLLM's CPU platform has no MXFP4 linear kernel either: both configs refuse the attention layer alike
_MXFP4_CT_LINEAR = {"model.layers.0.self_attn.o_proj": "ValueError: Failed to find a kernel that can implement the "
                                                       "MXFP4 linear layer. Reasons:",
                    "model.layers.0.mlp.gate": "UnquantizedLinearMethod"}

#: name -> (source, backend, our method, vLLM's experts class, vLLM's config of the source, {a layer that is not a
#: routed expert: its method}). The fixtures quantize the experts only where the producer lets them: vLLM's GPTQ /
#: AWQ configs read that from the safetensors headers.
SOURCES = {
    "gptq": ("gptq", "marlin", "MarlinWNA16Method", "MarlinExperts", "AutoGPTQConfig",
             {"model.layers.0.self_attn.o_proj": "UnquantizedLinearMethod"}),
    "gptq-triton": ("gptq", "triton", "TritonWNA16Method", "TritonWNA16Experts", "AutoGPTQConfig",
                    {"model.layers.0.self_attn.o_proj": "UnquantizedLinearMethod"}),
    "awq": ("awq", "marlin", "MarlinWNA16Method", "MarlinExperts", "AutoAWQConfig",
            {"model.layers.0.self_attn.o_proj": "UnquantizedLinearMethod"}),
    "awq-triton": ("awq", "triton", "TritonWNA16Method", "TritonWNA16Experts", "AutoAWQConfig",
                   {"model.layers.0.self_attn.o_proj": "UnquantizedLinearMethod"}),
    # vLLM's CPU platform has no NVFP4 linear kernel: both configs refuse the attention layer alike
    "nvfp4": ("nvfp4", "marlin", "MarlinNVFP4Method", "MarlinExperts", "CompressedTensorsConfig",
              {"model.layers.0.self_attn.o_proj": "ValueError: Failed to find a kernel that can implement the NVFP4 "
                                                  "linear layer. Reasons:",
               "model.layers.0.mlp.gate": "UnquantizedLinearMethod"}),
    "mxfp4": ("mxfp4", "marlin", "MarlinMXFP4Method", "MarlinExperts", "CompressedTensorsConfig", _MXFP4_CT_LINEAR),
    "fp8-block": ("fp8-block", "marlin", "MarlinMXFP4Method", "MarlinExperts", "Fp8Config",
                  {"model.layers.0.self_attn.o_proj": "Fp8LinearMethod",
                   "model.layers.1.mlp.shared_experts.down_proj": "Fp8LinearMethod"}),
    # vLLM's humming experts (the child answers as an SM90 GPU: tests/vllm_plugin_child.py ``_humming_on_a_cpu``)
    "gptq-humming": ("gptq", "humming", "HummingWNA16Method", "HummingIndexedExperts", "AutoGPTQConfig",
                     {"model.layers.0.self_attn.o_proj": "UnquantizedLinearMethod"}),
    "mxfp4-humming": ("mxfp4", "humming", "HummingMXFP4Method", "HummingIndexedExperts", "CompressedTensorsConfig",
                      _MXFP4_CT_LINEAR),
    # AutoRound's own checkpoints (tests/data/autoround): its routers left unquantized by its config's rules
    # (GPTQ ``dynamic``, AWQ ``modules_to_not_convert``), and in the GPTQ one layer 1's experts at 8 bits
    "autoround-gptq": ("autoround-gptq", "marlin", "MarlinWNA16Method", "MarlinExperts", "AutoGPTQConfig",
                       {"model.layers.1.mlp.gate": "UnquantizedLinearMethod",
                        "model.layers.1.self_attn.o_proj": "AutoGPTQLinearMethod"}),
    "autoround-awq": ("autoround-awq", "marlin", "MarlinWNA16Method", "MarlinExperts", "AutoAWQConfig",
                      {"model.layers.1.mlp.gate": "UnquantizedLinearMethod",
                       "model.layers.1.self_attn.o_proj": "AutoAWQMarlinLinearMethod"}),
    # AutoRound's own format, which vLLM serves as ``inc`` (on the CPU platform its MoE layers unquantized: the
    # plugin's own methods serve the folder's)
    "autoround-own": ("autoround-own", "marlin", "MarlinWNA16Method", "MarlinExperts", "INCConfig",
                      {"model.layers.1.mlp.gate": "UnquantizedLinearMethod",
                       "model.layers.1.self_attn.o_proj": "INCLinearMethod"}),
    # GPTQModel's (layer 1's experts at 8 bits by its ``dynamic``) and llm-compressor's NVFP4 (W4A4, calibrated)
    "gptqmodel": ("gptqmodel", "marlin", "MarlinWNA16Method", "MarlinExperts", "AutoGPTQConfig",
                  {"model.layers.1.mlp.gate": "UnquantizedLinearMethod",
                   "model.layers.1.self_attn.o_proj": "AutoGPTQLinearMethod"}),
    "llm-compressor-nvfp4": ("llm-compressor-nvfp4", "marlin", "MarlinNVFP4Method", "MarlinExperts",
                             "CompressedTensorsConfig",
                             {"model.layers.1.self_attn.o_proj": "ValueError: Failed to find a kernel that can "
                                                                 "implement the NVFP4 linear layer. Reasons:",
                              "model.layers.1.mlp.gate": "UnquantizedLinearMethod"}),
}
HUMMING_SOURCES = sorted(n for n in SOURCES if SOURCES[n][1] == "humming")
MARLIN_SOURCES = sorted(n for n in SOURCES if SOURCES[n][1] == "marlin")


@pytest.fixture(scope="module")
def source_folders(example_ckpt, tmp_path_factory):
    """A folder from each source format in each layout of SOURCES (FP8 block: quantized to MXFP4), the sources
    as the reader tests build them (GPTQ / AWQ by helpers.make_int_checkpoint from one bf16 example)."""
    from helpers import make_int_checkpoint

    base = tmp_path_factory.mktemp("source-folders")
    bf16 = example_ckpt("qwen3-moe", num_layers=1, num_experts=4, hidden_size=256, intermediate_size=128)
    sources = {"gptq": make_int_checkpoint(bf16, base / "gptq-src", "gptq", bits=4, group_size=32),
               "awq": make_int_checkpoint(bf16, base / "awq-src", "awq", bits=4, group_size=64),
               "nvfp4": example_ckpt("qwen3-moe", "nvfp4", num_layers=2, num_experts=4),
               "mxfp4": example_ckpt("qwen3-moe", "mxfp4", num_layers=1, num_experts=4, intermediate_size=128),
               "fp8-block": example_ckpt("deepseek-v3", "fp8-block", num_experts=4),
               "autoround-gptq": AUTOROUND / "gptq-w4g32-w8-layer1", "autoround-awq": AUTOROUND / "awq-w4g32",
               "autoround-own": AUTOROUND / "auto-round-w4g32", "gptqmodel": AUTOROUND.parent / "gptqmodel" / "w4g32-dynamic",
               "llm-compressor-nvfp4": AUTOROUND.parent / "llm-compressor" / "nvfp4"}
    made = {}
    for name, (source, backend, *_) in SOURCES.items():
        src = sources[source]
        verb = ["quantize", "--format", "mxfp4"] if source == "fp8-block" else ["repack"]
        cli(verb[0], src, base / name, *verb[1:], "--backend", backend, expect=0)
        made[name] = (src, base / name)
    return made, sources


@pytest.fixture(scope="module")
def source_checks(source_folders, tmp_path_factory):
    """Every source format's folder through vLLM on the CPU: one child process (``--sources``) for all but the
    humming folders, one more (``--humming --sources``) for those."""
    if not VLLM_PYTHON:
        pytest.skip("needs a Python with vLLM 0.33.0 (MOECONVERT_VLLM_PYTHON or .venv-vllm-cpu)")
    folders = source_folders[0]
    got = {}
    for names, mode in (([n for n in folders if n not in HUMMING_SOURCES], ["--sources"]),
                        (HUMMING_SOURCES, ["--humming", "--sources"])):
        jobs = tmp_path_factory.mktemp("source-jobs") / "jobs.json"
        jobs.write_text(json.dumps([[str(folders[n][1]), str(folders[n][0]), sorted(SOURCES[n][5])] for n in names]))
        res = _child(jobs, *mode)
        # a dict: the child failed before its first folder (e.g. humming-kernels not importable there)
        got.update(zip(names, [res] * len(names) if isinstance(res, dict) else res))
    return got


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_folder_from_each_source_format_names_the_plugin_and_keeps_the_sources_config(source_folders, name):
    src, out = source_folders[0][name]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "moeconvert" and qc["layout"]["name"] == SOURCES[name][1]
    assert qc["source_quantization_config"] == json.loads((src / "config.json").read_text())["quantization_config"]


@needs_vllm
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_vllm_serves_a_folder_from_each_source_format(source_checks, source_folders, name):
    """vLLM's CPU platform: each MoE layer built by the plugin's method holds the file's bytes after
    processing (NVFP4: its global scales are the Marlin kernel's g1 / g2 alphas, 16-bit activations, and the
    bytes are those vLLM's own NVFP4 method holds after processing the source for Marlin), and
    every other layer gets, from the plugin's config, the method vLLM's own config of the source gives it (the
    config vLLM's ModelConfig picks for the source, updated from the source folder as vLLM updates it)."""
    got = source_checks[name]
    if name in HUMMING_SOURCES and "No module named 'humming'" in got.get("error", ""):
        pytest.skip("humming-kernels is not importable in vLLM's test Python (scripts/setup-vllm-cpu.sh installs it)")
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    _, _, method, experts_class, config, linear = SOURCES[name]
    _, out = source_folders[0][name]
    manifest = json.loads((out / "moeconvert.json").read_text())
    files = _file_tensors(out)
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for m in manifest["moe_layers"]:
        layer = got["layers"][m["prefix"]]
        assert (layer["method"], layer["experts_class"]) == (method, experts_class)
        assert layer["scale_is_param"] and layer["a16"]
        assert layer["loaded"] == sorted(f"routed_experts.{s}" for s in m["tensors"])
        assert set(layer["params"]) == {f"routed_experts.{s}" for s in m["tensors"]}
        for suffix, entry in m["tensors"].items():
            param = layer["params"][f"routed_experts.{suffix}"]
            want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
            assert param["sha256"] == want and not param["moved"] and param["shape"] == entry["shape"], suffix
        if m["scheme"]["kind"] == "nvfp4":
            assert layer["weight_dtype"] == "nvfp4" and layer["global_scales_are_params"] == [True, True]
            assert {"w13_weight_scale_2", "w2_weight_scale_2"} <= set(m["tensors"])
            # vLLM's own compressed-tensors NVFP4 method on the source, processed for Marlin (on the CPU, its
            # CUDA repack stood in by its own Python reference): the very bytes the plugin's parameters hold
            theirs = got["source"][m["prefix"]]
            assert (theirs["method"], theirs["backend"]) == ("CompressedTensorsW4A4Nvfp4MoEMethod", "MARLIN")
            for suffix in m["tensors"]:
                assert theirs["params"][suffix] == layer["params"][f"routed_experts.{suffix}"]["sha256"], suffix
    assert got["inner"][0] == got["theirs"][0] == config and got["inner"][1] == got["theirs"][1]
    for prefix, want in linear.items():
        ours, theirs = got["linear"][prefix]
        assert ours == theirs and ours.startswith(want), (prefix, ours, theirs)


def test_a_compressed_tensors_mxfp4_source_in_triton_keeps_its_config_and_says_why(source_folders, tmp_path):
    """The triton MXFP4 layout from a compressed-tensors MXFP4 source: the plugin does not serve it for a SiLU
    model (as from bf16 below), so config.json stays the source's and one warning line says why."""
    src = source_folders[1]["mxfp4"]
    run = cli("repack", src, tmp_path / "out", "--backend", "triton", expect=0)
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    lines = [w for w in run.err.splitlines() if "config.json: copied as it is" in w]
    assert len(lines) == 1 and "TritonMXFP4Method (triton_kernels' matmul_ogs) runs the swigluoai activation only, " \
        "these experts' is silu" in lines[0], run.err


def test_a_folder_the_plugin_would_refuse_keeps_the_sources_config_and_says_why(example_ckpt, tmp_path):
    """triton_kernels' MXFP4 experts in vLLM run swigluoai only (its TRITON backend's fused epilogue): a SiLU
    model (Qwen3-MoE) in that layout is written, but config.json stays the source's and a warning says why."""
    src = example_ckpt("qwen3-moe", intermediate_size=256)
    run = cli("quantize", src, tmp_path / "out", "--format", "mxfp4", "--backend", "triton", expect=0)
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    line = next(w for w in run.err.splitlines() if "config.json: copied as it is" in w)
    assert ("moeconvert's vLLM plugin does not serve this folder: its triton mxfp4 experts are TritonMXFP4Method's, "
            "and TritonMXFP4Method (triton_kernels' matmul_ogs) runs the swigluoai activation only, these experts' is "
            "silu") in line, run.err


# -- the model families the plugin is proven on ----------------------------------------------------

#: family -> (how its tiny checkpoint is made: example_ckpt's family and scheme, or a transformers model_type,
#: the conversion). DeepSeek-V2's from bf16: vLLM's CPU build has no WNA16 kernel for its quantized attention
FAMILY_FOLDERS = {
    "mixtral": (("example", "mixtral", "w4a16"), ["repack", "--backend", "marlin"]),
    "qwen2-moe": (("example", "qwen2-moe", "w4a16"), ["repack", "--backend", "marlin"]),
    "deepseek-v2": (("example", "deepseek-v2", "bf16"), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    "glm4-moe": (("example", "glm4-moe", "w4a16"), ["repack", "--backend", "marlin"]),
    # block_sparse_moe.experts.N.w1/w2/w3, as vLLM's MiniMaxM2 loader maps them
    "minimax-m2": (("transformers", "minimax_m2", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # fused and transposed in the checkpoint; the folder's w13_weight / w2_weight go through vLLM's Llama4
    # loader by its expert mapping; vLLM's Llama4MoE sets apply_router_weight_on_input on its layer itself
    "llama4": (("transformers", "llama4_text", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # vLLM's own Qwen3_5MoeForCausalLM (its module imports torchvision: tests/vllm_stubs says why the child may
    # stand it in), the experts per expert as save_pretrained writes them
    "qwen3.5-moe": (("transformers", "qwen3_5_moe_text", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    "qwen3-next": (("transformers", "qwen3_next", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    "glm4-moe-lite": (("transformers", "glm4_moe_lite", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # moe_statics.e_score_correction_bias goes to the gate (vLLM's Ernie4_5_MoeModel.load_weights)
    "ernie4.5-moe": (("transformers", "ernie4_5_moe", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    "hunyuan-v1-moe": (("transformers", "hunyuan_v1_moe", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    "mimo-v2": (("transformers", "mimo_v2_flash", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # three 3-D expert tensors per layer (helpers.make_step3p5_checkpoint: no transformers causal LM writes it);
    # vLLM's FusedMoEBlock gives layer 2 (swiglu_limits 7.0) the swiglustep activation, layer 1 silu
    "step3p5": (("step3p5", None, None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # the routed experts only: vLLM's FusedMoE holds E of them (its router, E + zero_expert_num scores); the zero
    # experts' term is vLLM's own (ZeroExpertRouter)
    "longcat-flash": (("transformers", "longcat_flash", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # GLM-5: vLLM's GlmMoeDsaForCausalLM (DeepSeek-V2's classes, with the sparse attention's indexer); the child
    # stands in for the sparse attention backend vLLM's CPU platform refuses (_sparse_attention_builds_on_the_cpu)
    "glm-moe-dsa": (("transformers", "glm_moe_dsa", None), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # DeepSeek-V4's own MXFP4 experts, repacked for Marlin (what the plugin serves them as), loaded with
    # --load-format moeconvert (its loader maps per-expert names only); every layer clamps at swiglu_limit.
    # moe_intermediate_size 128: vLLM's FP8 block linear layers (its shared expert) need N a multiple of 128
    "deepseek-v4": (("deepseek-v4", None, None), ["repack", "--backend", "marlin"]),
}
#: the class vLLM builds where it is not one of the family's (vLLM's registry maps HunYuanMoEV1ForCausalLM to its
#: transformers backend)
VLLM_BACKEND = {"hunyuan-v1-moe": "TransformersMoEForCausalLM"}
#: the module path vLLM's model class gives a checkpoint's layer prefix, where it is another (vLLM's
#: DeepseekV4ForCausalLM.hf_to_vllm_mapper: the published checkpoint's layers.L is its model.layers.L)
VLLM_MODULE_PREFIX = {"deepseek-v4": "model."}
#: families the plugin is proven on by the tests above (the whole model, or the loader's own weight_loader calls)
PROVEN_ABOVE = {"qwen3-moe": test_vllm_loads_the_whole_model_from_the_folder,
                "deepseek-v3": test_deepseek_v3_loads_through_each_parameters_own_loader,
                "gpt-oss": test_vllm_serves_a_gpt_oss_folder_with_the_moeconvert_load_format}


def test_the_table_says_proven_of_exactly_the_families_proven_here():
    from moeconvert.format.families import FAMILIES

    assert {f.name for f in FAMILIES if f.plugin_proven} == set(FAMILY_FOLDERS) | set(PROVEN_ABOVE)


@needs_vllm
def test_vllm_loads_each_proven_familys_whole_model(example_ckpt, tmp_path):
    """One vLLM process: for each family, vLLM's own model class (its registry's, from config.json) builds
    the whole model and loads the folder through its own ``load_weights``; every MoE layer must then hold the
    file's bytes, with the router weight where the manifest says it goes. A family the table does not say
    the plugin is proven on is refused at start-up."""
    from helpers import make_deepseek_v4_checkpoint, make_family_checkpoint, make_step3p5_checkpoint
    from moeconvert.integrations.vllm.scope import load_format

    jobs = []
    for family, ((kind, name, scheme), verb) in FAMILY_FOLDERS.items():
        src = example_ckpt(name, scheme=scheme) if kind == "example" else \
            make_step3p5_checkpoint(tmp_path / f"{family}-src") if kind == "step3p5" else \
            make_deepseek_v4_checkpoint(tmp_path / f"{family}-src", I=128) if kind == "deepseek-v4" else \
            make_family_checkpoint(tmp_path / f"{family}-src", name)
        cli(verb[0], src, tmp_path / family, *verb[1:], expect=0)
        jobs.append([str(tmp_path / family), load_format(family) or "auto"])
    unproven = [str(tmp_path / "mixtral"), "auto", "mixtral"]  # the table saying it is not proven on mixtral
    (tmp_path / "jobs.json").write_text(json.dumps(jobs + [unproven]))
    *results, refused = _child(tmp_path / "jobs.json", "--whole-models")
    from moeconvert.format.families import BY_NAME

    for family, got in zip(FAMILY_FOLDERS, results):
        assert "error" not in got, (family, got["error"])
        assert got["quantization"] == "moeconvert", family
        # vLLM's own model class, never its transformers fallback standing in for one it could not import
        assert got["model_class"] in ((VLLM_BACKEND[family],) if family in VLLM_BACKEND else BY_NAME[family].vllm_classes), \
            (family, got["model_class"])
        out = tmp_path / family
        files = _file_tensors(out)
        manifest = json.loads((out / "moeconvert.json").read_text())
        assert manifest["family"] == family
        module = VLLM_MODULE_PREFIX.get(family, "")
        assert sorted(got["layers"]) == sorted(module + m["prefix"] for m in manifest["moe_layers"]), family
        for m in manifest["moe_layers"]:
            layer = got["layers"][module + m["prefix"]]
            assert layer["loaded"] == sorted(f"routed_experts.{s}" for s in m["tensors"]), (family, m["prefix"])
            assert layer["router_weight_on_input"] == m.get("apply_router_weight_on_input", False), family
            # vLLM's model gives each layer the activation the manifest declares for it (Step-3.5: per layer)
            assert layer["activation"][0] == m["activation"], (family, m["prefix"], layer["activation"])
            # SiLU's clamp where the manifest declares one (DeepSeek-V4's swiglu_limit), none where it does not
            # (Step-3.5's swiglustep holds its 7.0 in the activation itself)
            if m["activation"] == "silu":
                want_limit = (m.get("activation_params") or {}).get("limit")
                assert layer["clamp_limit"] == want_limit, (family, m["prefix"], layer["clamp_limit"])
            for suffix, entry in m["tensors"].items():
                want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
                assert layer["params"][f"routed_experts.{suffix}"]["sha256"] == want, (family, suffix)
    # vLLM refuses the config at start-up (its config validation wraps the plugin's one line)
    assert "moeconvert: the vLLM plugin has not been proven on mixtral models (it is on qwen2-moe, " in refused["error"], refused["error"]
    assert not refused["layers"]


def test_a_family_the_plugin_is_not_proven_on_keeps_the_sources_config_and_says_why(tmp_path):
    """Ling 2.0 (bailing_moe_v2) converts to a layout the plugin serves, but the plugin is not proven on the
    family (vLLM builds its config from the checkpoint's remote code): the folder keeps the source's
    config.json (vLLM then never picks the plugin for it) and one warning says why."""
    from helpers import make_bailing_checkpoint

    src = make_bailing_checkpoint(tmp_path / "src")
    run = cli("quantize", src, tmp_path / "out", "--format", "mxfp4", "--backend", "marlin", expect=0)
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    line = next(w for w in run.err.splitlines() if "config.json: copied as it is" in w)
    assert "the vLLM plugin has not been proven on bailing-moe models (vLLM builds its config from the " \
           "checkpoint's own remote code" in line, run.err


def test_the_plugin_is_a_vllm_entry_point():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "moeconvert"]
    assert len(eps) == 1 and eps[0].value == "moeconvert.integrations.vllm:register"


def gpu_vllm(test):
    """A GPU test that runs vLLM (``MOECONVERT_VLLM_PYTHON`` with vLLM's CUDA build on a GPU machine)."""
    for mark in (pytest.mark.gpu, needs_vllm, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def source_gpu_checks(source_folders, tmp_path_factory):
    """The GPU forward of every source format's marlin folder, in one vLLM process."""
    names, folders = MARLIN_SOURCES, source_folders[0]
    path = tmp_path_factory.mktemp("source-gpu-jobs") / "jobs.json"
    path.write_text(json.dumps([["--forward", str(folders[n][1]), str(folders[n][0])] for n in names]))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    p = subprocess.run([VLLM_PYTHON, str(CHILD), str(path)], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(zip(names, json.loads(p.stdout.strip().splitlines()[-1])))


@gpu_vllm
@pytest.mark.parametrize("name", MARLIN_SOURCES)
def test_vllms_marlin_experts_run_a_folder_from_each_source_format(source_gpu_checks, name):
    """On the GPU: vLLM's MarlinExperts, built by the plugin's method over the folder's tensors (NVFP4: e2m1
    weights, S0E5M3 scales, the global scales as the kernel's alphas), against ``reference_moe`` on the source's
    own weights (FP8 block: dequantized, then quantized to MXFP4 as the manifest says)."""
    got = source_gpu_checks[name]
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    assert got["layers"]
    for prefix, layer in got["layers"].items():
        assert layer["experts_class"] == "MarlinExperts"
        for M, r in layer["tokens"].items():
            assert r["finite"] and r["want_norm"] > 0 and r["rel"] < 2e-2, (prefix, M, r)


FORWARD = sorted(SCHEMES)
BENCH = ["w4a16-g128", "w4a16-g128-asym", "w8a16-g128", "w4a16-channel", "bf16-mxfp4", "triton-w4a16-g128",
         "triton-w4a16-g128-asym", "triton-w8a16-g128"]


@pytest.fixture(scope="module")
def gpu_checks(folders, tmp_path_factory):
    """Every GPU check of the folders, in one vLLM process (vLLM's start-up is the slow part)."""
    jobs = [["--forward", str(folders[s][1]), str(folders[s][0])] for s in FORWARD]
    jobs += [["--bench", str(folders[s][1]), str(folders[s][0])] for s in BENCH]
    path = tmp_path_factory.mktemp("gpu-jobs") / "jobs.json"
    path.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    p = subprocess.run([VLLM_PYTHON, str(CHILD), str(path)], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    return {(mode, s): r for (mode, _, _), s, r in zip(jobs, FORWARD + BENCH, results)}


@gpu_vllm
@pytest.mark.parametrize("scheme", FORWARD)
def test_vllms_experts_run_a_converted_layer_against_the_reference(gpu_checks, folders, scheme):
    """On the GPU: vLLM's experts object, built by the plugin's method over the folder's tensors (vLLM's
    own Marlin or Triton MoE kernel), against ``reference_moe`` on the source's own weights."""
    got = gpu_checks[("--forward", scheme)]
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    manifest = json.loads((folders[scheme][1] / "moeconvert.json").read_text())
    assert got["quant_config"] == "MoeconvertConfig"
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for prefix, layer in got["layers"].items():
        assert layer["experts_class"] == _built(scheme)[1]
        for M, r in layer["tokens"].items():
            assert r["finite"] and r["want_norm"] > 0, (prefix, M)
            assert r["rel"] < 2e-2, (prefix, M, r["rel"])


@gpu_vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Marlin's and triton_kernels' MXFP4 kernels need CUDA: vLLM's "
                    "CPU platform runs neither, so gpt-oss's forward runs on a GPU only (its bytes are checked on the "
                    "CPU by test_vllm_serves_a_gpt_oss_folder_with_the_moeconvert_load_format; the triton-fast "
                    "folder's forward on the CPU, interpreted, by "
                    "test_vllms_moe_layer_runs_moeconverts_kernel_on_a_triton_fast_folder[gpt-oss])")
@pytest.mark.parametrize("name", sorted(GPT_OSS))
def test_vllms_experts_run_a_gpt_oss_layer_against_the_reference(gpt_oss_folders, name):
    """On the GPU: each gpt-oss layer built by the plugin's method (``--load-format moeconvert``), vLLM's own
    kernel (Marlin, or triton_kernels' monolithic one, which routes the logits itself) against
    ``reference_moe`` on the source's own weights with gpt-oss's swigluoai and biases; the bound the other
    folders' check uses (2e-2)."""
    src, out = gpt_oss_folders[name]
    got = _gpu_child(out, "--forward", str(src))
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    for prefix, layer in got["layers"].items():
        assert layer["experts_class"] == GPT_OSS[name][3]
        for M, r in layer["tokens"].items():
            assert r["finite"] and r["want_norm"] > 0, (prefix, M)
            assert r["rel"] < 2e-2, (prefix, M, r["rel"])


@gpu_vllm
@pytest.mark.parametrize("scheme", BENCH)
def test_the_plugin_holds_what_vllms_own_processing_makes_from_the_source(gpu_checks, scheme):
    """On the GPU, ``moeconvert bench vllm-startup``'s check: vLLM's compressed-tensors WNA16 method loads the
    source and converts it for the folder's backend (Marlin's repack, or the Triton kernel's byte view) on
    the GPU, or for a bf16 source vLLM's online MXFP4 (``--quantization mxfp4``) quantizes it; the plugin
    loads the folder. Every parameter must hold the same bytes (for MXFP4: the ``vllm`` rounding rule is
    vLLM's own) and the two layers give the same output on the same routed tokens."""
    got = gpu_checks[("--bench", scheme)]
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    assert got["vllm_source_method"] == ("online mxfp4" if scheme.endswith("mxfp4") else "compressed-tensors")
    for row in got["layers"]:
        assert row["vllm"]["experts_class"] == row["moeconvert"]["experts_class"] == _built(scheme)[1]
        assert row["same_bytes"] and all(v is True for v in row["same_bytes"].values()), row["same_bytes"]
        assert row["outputs_identical"], row["output_rel_diff"]


@gpu_vllm
def test_vllm_generates_from_the_folder_what_it_generates_from_the_source(folders):
    """vLLM's whole engine (``vllm.LLM``, Marlin MoE backend, Triton attention): greedy tokens and logprobs
    from the converted folder (the plugin) against vLLM on the source checkpoint (compressed-tensors,
    repacked at start-up). Same kernel, same bytes: the same tokens and logprobs."""
    src, out = folders["w4a16-g128"]
    theirs = _gpu_child(src, "--generate")
    ours = _gpu_child(out, "--generate")
    assert theirs["quantization"] == "compressed-tensors" and ours["quantization"] == "moeconvert"
    assert ours["tokens"] == theirs["tokens"]
    worst = max(abs(a - b) for x, y in zip(ours["logprobs"], theirs["logprobs"]) for a, b in zip(x, y))
    assert worst < 1e-3, worst


@pytest.mark.parametrize("bench", ["vllm-startup", "vllm-serve"])
def test_the_vllm_benches_refuse_in_one_line_where_they_cannot_run(folders, bench):
    """Without vLLM in this Python, or without a GPU, each says so in one line and exits 2."""
    src, out = folders["w4a16-g128"]
    try:
        import vllm  # noqa: F401
        have_vllm = True
    except ImportError:
        have_vllm = False
    if have_vllm and torch.cuda.is_available():
        pytest.skip("vLLM and a GPU are both here: the benches run (the GPU tests above)")
    run = cli("bench", bench, src, out, expect=2)
    assert len(run.err.strip().splitlines()) == 1, run.err
    want = f"bench {bench} needs vLLM" if not have_vllm else "torch sees no CUDA device"
    assert want in run.err, run.err


@needs_vllm
@pytest.mark.parametrize("bench", ["vllm-startup", "vllm-serve"])
def test_the_vllm_benches_need_a_gpu_and_say_so_in_one_line(folders, bench):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benches run (the GPU tests above)")
    src, out = folders["w4a16-g128"]
    p = subprocess.run([VLLM_PYTHON, "-m", "moeconvert", "bench", bench, str(src), str(out)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    assert p.stderr.strip().splitlines() == [
        "moeconvert: error: --device: --device cuda asked for, but torch sees no CUDA device (expected a CUDA "
        "device, found none)"], p.stderr


# --------------------------------------------------------------------------------------------------
# what `vllm serve` reads from a folder: hostile config.json values are one ValueError line each

_CONFIG_CHILD = """
import json, sys
from moeconvert.integrations.vllm.config import MoeconvertConfig

got = []
for qc, model in json.load(open(sys.argv[1])):
    try:  # what vLLM's ModelConfig does with a folder's quantization_config
        MoeconvertConfig.from_config(qc).maybe_update_config(model)
        got.append(None)
    except Exception as e:
        got.append([type(e).__name__, str(e)])
print(json.dumps(got))
"""


def _edited_copy(folder: Path, dest: Path, edit) -> Path:
    """A copy of ``folder`` whose config.json's quantization_config ``edit`` changed, with the manifest's
    checksum of config.json updated to match (as someone who edits with care would)."""
    import shutil

    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    edit(cfg["quantization_config"])
    raw = (json.dumps(cfg, indent=2) + "\n").encode()
    (dest / "config.json").write_bytes(raw)
    manifest = json.loads((dest / "moeconvert.json").read_text())
    manifest["copied_files"]["config.json"] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    (dest / "moeconvert.json").write_text(json.dumps(manifest, indent=1))
    return dest


@needs_vllm
def test_hostile_quantization_configs_are_refused_in_one_line(folders, tmp_path):
    _, out = folders["w4a16-g128"]
    good = json.loads((out / "config.json").read_text())["quantization_config"]
    assert good["source_quantization_config"]["config_groups"]  # a compressed-tensors source

    def changed(**kw):
        return {**json.loads(json.dumps(good)), **kw}

    no_groups = changed()
    del no_groups["source_quantization_config"]["config_groups"]
    group = next(iter(good["source_quantization_config"]["config_groups"]))
    bad_bits, no_targets = changed(), changed()
    bad_bits["source_quantization_config"]["config_groups"][group]["weights"]["num_bits"] = "four"
    del no_targets["source_quantization_config"]["config_groups"][group]["targets"]
    other_layout = _edited_copy(out, tmp_path / "other-layout",
                                lambda qc: qc.update(layout={"name": "triton", "version": qc["layout"]["version"]}))
    cases = {  # name: (quantization_config, the folder vLLM was given), what the line must say
        "made_for a string": ((changed(made_for="0.33.0"), out),
                              'config.json: quantization_config.made_for: expected an object of versions or lists'),
        "made_for a list": ((changed(made_for=["vllm", "0.33.0"]), out), "quantization_config.made_for: expected"),
        "source config a string": ((changed(source_quantization_config="compressed-tensors"), out),
                                   "quantization_config.source_quantization_config: expected an object"),
        "source config a list": ((changed(source_quantization_config=[]), out),
                                 "quantization_config.source_quantization_config: expected an object"),
        "format_version 1": ((changed(format_version=1), out),
                             "quantization_config.format_version: expected 2 (this moeconvert's output format), found 1"),
        "no config_groups": ((no_groups, out), "quantization_config.source_quantization_config.config_groups: "
                                               "expected the source's compressed-tensors groups"),
        # compressed-tensors' pydantic models refuse it in many lines naming neither file nor group
        "num_bits a word": ((bad_bits, out), f"config.json: quantization_config.source_quantization_config."
                                             f"config_groups.{group}.weights.num_bits: expected what compressed-tensors'"),
        "no targets": ((no_targets, out), f"quantization_config.source_quantization_config.config_groups.{group}."
                                          "targets: expected a list of module names"),
        "layout of another name": ((json.loads(other_layout.joinpath("config.json").read_text())["quantization_config"],
                                    other_layout), 'quantization_config.layout: expected {"name": "marlin"'),
        "a folder no longer there": ((good, tmp_path / "gone"), f"{tmp_path / 'gone'}: no such folder"),
        # other source formats: what vLLM's own config of the source refuses, in one line naming the key
        "a GPTQ source without bits": ((changed(source_quantization_config={"quant_method": "gptq", "group_size": 32,
                                                                            "desc_act": False, "sym": True}), out),
                                       "quantization_config.source_quantization_config: vLLM's gptq config refuses it"),
        "a quant_method vLLM does not know": ((changed(source_quantization_config={"quant_method": "gguf-ish"}), out),
                                              "quantization_config.source_quantization_config: vLLM's gguf-ish config "
                                              "refuses it (Unknown quantization method: gguf-ish"),
        "a quant_method not a string": ((changed(source_quantization_config={"quant_method": 4}), out),
                                        "quantization_config.source_quantization_config.quant_method: expected the "
                                        "source's quantization method (a string), found 4"),
    }
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([[qc, str(folder)] for (qc, folder), _ in cases.values()]))
    p = subprocess.run([VLLM_PYTHON, "-c", _CONFIG_CHILD, str(jobs)], capture_output=True, text=True,
                       env={**os.environ, **VLLM_CPU_ENV}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for (name, (_, needle)), result in zip(cases.items(), got):
        assert result is not None, f"{name}: accepted"
        kind, text = result
        assert kind == "ValueError" and "\n" not in text and needle in text, f"{name}: {kind}: {text}"
        assert text.startswith("moeconvert: ")
        if name != "a folder no longer there":
            assert "moeconvert repack SRC OUT" in text, f"{name}: {text}"  # the command that fixes it


_FORWARD_CONTEXT_CHILD = """
import json, torch
from types import SimpleNamespace
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import get_forward_context, set_forward_context
from moeconvert.integrations.vllm.harness import run_experts

class Method:  # as vLLM's humming experts, reads the forward context in apply
    is_monolithic = False
    def apply(self, layer, x, topk_weights, topk_ids, **kw):
        ctx = get_forward_context()
        return x + (0 if ctx.attn_metadata is None else ctx.attn_metadata["mark"])

layer, x = SimpleNamespace(quant_method=Method()), torch.zeros(3, 4)
w, ids = torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32)
vc = VllmConfig()
with set_current_vllm_config(vc):
    outside = run_experts(layer, x, w, ids)
    with set_forward_context({"mark": 7}, vc, num_tokens=3):
        inside = run_experts(layer, x, w, ids)
print(json.dumps([outside.tolist(), inside.tolist()]))
"""


@needs_vllm
def test_run_experts_gives_vllms_experts_a_forward_context_outside_a_forward():
    """vLLM's humming experts read the forward context (the pairs to tune for): ``bench vllm-startup`` and the
    GPU tests call experts outside a model's forward, where the H200 run failed with vLLM's 'Forward context
    is not set'; a context already set (a forward's) is kept."""
    p = subprocess.run([VLLM_PYTHON, "-c", _FORWARD_CONTEXT_CHILD], capture_output=True, text=True,
                       env={**os.environ, **VLLM_CPU_ENV}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    outside, inside = json.loads(p.stdout.strip().splitlines()[-1])
    assert outside == [[0.0] * 4] * 3 and inside == [[7.0] * 4] * 3

# ---------------------------------------------------------------------------------------------------
# humming folders: vLLM's own humming experts (what vLLM 0.33.0 picks for WNA16 on SM90)

HUMMING = {  # name: (example arguments, the weight dtype humming gives both sublayers)
    # I 96, g32: w13's N 192 -> 256 and w2's K 96 -> 128 (humming's padding of each sublayer)
    "humming-w4a16-g32": (dict(scheme="w4a16", group_size=32, intermediate_size=96), "uint4"),
    # no expert has a 0 code: humming's sign-magnitude codes
    "humming-w4a16-no-zero": (dict(scheme="w4a16", experts_without_zero_code=tuple(range(8))), "float4e0m3"),
    "humming-w8a16-no-zero": (dict(scheme="w8a16", experts_without_zero_code=tuple(range(8))), "float8e0m7"),
    # MXFP4 (quantize --format mxfp4 from bf16): I 160 -> 192 as vLLM pads it for HUMMING, then humming pads
    # w13's N 384 -> 512 and w2's K 192 -> 256 (scale 1.0 there, 0 in vLLM's own padding)
    "humming-mxfp4": (dict(scheme="bf16", intermediate_size=160), "float4e2m1"),
    # compressed-tensors NVFP4 (repack): I 80, not padded by vLLM; humming pads w13's N 160 -> 256, w2's K 80 -> 128
    "humming-nvfp4": (dict(scheme="nvfp4", intermediate_size=80), "float4e2m1"),
}
#: the plugin's method and vLLM's own compressed-tensors method for each humming folder served against its source
AGAINST_SOURCE = {name: ("HummingWNA16Method", "CompressedTensorsWNA16MoEMethod") for name in HUMMING
                  if name.startswith("humming-w")}
AGAINST_SOURCE["humming-nvfp4"] = ("HummingNVFP4Method", "CompressedTensorsW4A4Nvfp4MoEMethod")


@pytest.fixture(scope="module")
def humming_folders(example_ckpt, tmp_path_factory):
    if not VLLM_PYTHON:
        pytest.skip("needs a Python with vLLM 0.33.0 (MOECONVERT_VLLM_PYTHON or .venv-vllm-cpu)")
    p = subprocess.run([VLLM_PYTHON, "-c", "import humming; print(humming.__version__)"], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip("humming-kernels is not importable in vLLM's test Python (scripts/setup-vllm-cpu.sh installs it "
                    "with cuda-bindings): " + (p.stderr.strip().splitlines() or ["?"])[-1])
    base = tmp_path_factory.mktemp("humming-folders")
    made = {}
    for name, (kw, _) in HUMMING.items():
        src = example_ckpt("qwen3-moe", **kw)
        convert = ["quantize", "--format", "mxfp4"] if kw["scheme"] == "bf16" else ["repack"]
        cli(convert[0], src, base / name, *convert[1:], "--backend", "humming", expect=0)
        made[name] = (src, base / name)
    return made


@needs_vllm
@pytest.mark.parametrize("name", sorted(AGAINST_SOURCE))
def test_vllm_serves_a_humming_folder_as_its_own_humming_path_leaves_the_source(humming_folders, name):
    """On vLLM's CPU platform (the device's answers given as an SM90 GPU's: tests/vllm_plugin_child.py
    ``_humming_on_a_cpu``), the plugin's ``HummingWNA16Method`` (NVFP4: ``HummingNVFP4Method``) holds the
    folder's bytes in the parameters it made, and the weight / input schemas, the humming ``LayerConfig`` of
    each sublayer, vLLM's humming quant config and experts class equal, field by field, what vLLM's own
    compressed-tensors method leaves after ``convert_to_humming_moe_kernel_format`` on the source layer
    (NVFP4: ``CompressedTensorsW4A4Nvfp4MoEMethod`` with its HUMMING backend; run on the CPU up to humming's
    CUDA weight repack, which is the one step not run there); the scales and NVFP4's secondary scales, which
    humming transforms in torch, are byte for byte vLLM's."""
    src, out = humming_folders[name]
    got = _child(out, "--humming", "--against", str(src))
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    manifest = json.loads((out / "moeconvert.json").read_text())
    files = _file_tensors(out)
    b_dtype = HUMMING[name][1]
    assert sorted(got["layers"]) == sorted(got["source"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for m in manifest["moe_layers"]:
        ours, theirs = got["layers"][m["prefix"]], got["source"][m["prefix"]]
        assert (ours["method"], theirs["method"]) == AGAINST_SOURCE[name]
        assert ours["loaded"] == sorted(f"routed_experts.{s}" for s in m["tensors"])
        for suffix, entry in m["tensors"].items():
            param = ours["params"][f"routed_experts.{suffix}"]
            want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
            assert param["sha256"] == want and not param["moved"], suffix
            if not suffix.endswith("_weight"):  # scales: humming's own transform ran on the CPU for vLLM's
                assert theirs["params"][suffix] == want, suffix
        assert ours["scale_is_param"]
        h, v = ours["humming"], theirs["humming"]
        for sub in ("w13", "w2"):
            for part in ("config", "config_str", "weight_schema", "input_schema"):
                assert h[sub][part] == v[sub][part], (sub, part)
            cfg, meta = h[sub]["config"], m["layout_metadata"][sub]
            assert cfg["b_dtype"] == meta["b_dtype"] == b_dtype
            assert (int(cfg["shape_n"]), int(cfg["pad_shape_n"]), int(cfg["shape_k"]), int(cfg["pad_shape_k"])) == (
                meta["shape_n"], meta["pad_shape_n"], meta["shape_k"], meta["pad_shape_k"])
            assert (cfg["sm_version"], cfg["a_dtype"]) == ("90", "bfloat16")
        assert h["quant_config"] == v["quant_config"]
        assert h["quant_config"]["w1_config_is_layers"] and h["quant_config"]["w2_config_is_layers"]
        assert h["experts_class"] == v["experts_class"] == ours["experts_class"]
        assert ours["experts_class"].startswith("Humming")
    if name == "humming-w4a16-g32":
        assert manifest["moe_layers"][0]["layout_metadata"]["w13"]["pad_shape_n"] == 64  # the padding ran


@needs_vllm
def test_vllm_serves_a_humming_mxfp4_folder_with_its_humming_experts(humming_folders):
    """On vLLM's CPU platform answering as an SM90 GPU: the plugin's ``HummingMXFP4Method`` holds the folder's
    bytes in the parameters it made (I rounded up to 64 as vLLM rounds it for HUMMING), and the schemas and
    LayerConfigs it hands vLLM's humming experts are humming's MXFP4 ones (e2m1 weights, e8m0 scales in groups
    of 32, 16-bit activations), field for field the folder's; vLLM's quant config takes those very configs.

    Against vLLM's own ``Mxfp4MoEMethod`` with ``--moe-backend humming`` over the MXFP4 block the folder
    decodes to (its parameters filled as vLLM's loader fills them, then its own processing, run on the CPU up
    to humming's CUDA weight repack): it picks HUMMING, its weight and input schemas, each sublayer's
    ``LayerConfig``, its quant config and experts class equal the plugin's, its transformed scales equal the
    folder's byte for byte, and its padded weight words, before the repack, are the folder's words un-tiled.
    (vLLM's online MXFP4 path quantizes with a Triton kernel, which does not run here: the bytes are compared
    with it on a GPU, ``test_the_humming_folder_holds_what_vllms_own_humming_processing_makes``.)"""
    from moeconvert.layouts.humming import unrepack_weights
    from moeconvert.packing import pack_int32

    src, out = humming_folders["humming-mxfp4"]
    got = _child(out, "--humming", "--mxfp4-vllm")
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    manifest = json.loads((out / "moeconvert.json").read_text())
    files = _file_tensors(out)
    assert sorted(got["layers"]) == sorted(m["prefix"] for m in manifest["moe_layers"])
    for m in manifest["moe_layers"]:
        ours = got["layers"][m["prefix"]]
        assert ours["method"] == "HummingMXFP4Method"
        assert ours["loaded"] == sorted(f"routed_experts.{s}" for s in m["tensors"])
        assert sorted(ours["params"]) == sorted(f"routed_experts.{s}" for s in m["tensors"])
        for suffix, entry in m["tensors"].items():
            param = ours["params"][f"routed_experts.{suffix}"]
            want = hashlib.sha256(files[entry["name"]].contiguous().view(torch.uint8).numpy()).hexdigest()
            assert param["sha256"] == want and not param["moved"], suffix
        assert ours["scale_is_param"] and ours["weights_are_params"]
        h = ours["humming"]
        for sub in ("w13", "w2"):
            cfg, meta = h[sub]["config"], m["layout_metadata"][sub]
            assert (cfg["b_dtype"], cfg["bs_dtype"], cfg["a_dtype"], cfg["c_dtype"]) == \
                ("float4e2m1", "float8e8m0", "bfloat16", "bfloat16") == \
                (meta["b_dtype"], meta["bs_dtype"], meta["a_dtype"], meta["c_dtype"])
            assert (int(cfg["shape_n"]), int(cfg["pad_shape_n"]), int(cfg["shape_k"]), int(cfg["pad_shape_k"])) == (
                meta["shape_n"], meta["pad_shape_n"], meta["shape_k"], meta["pad_shape_k"])
            assert (cfg["sm_version"], cfg["weight_scale_group_size"], cfg["has_zero_point"]) == ("90", "32", "False")
            assert h[sub]["weight_schema"]["b_dtype"] == "float4e2m1"
            assert h[sub]["input_schema"]["a_dtype"] == "None"  # 16-bit: humming's default input schema
        assert (m["intermediate_size"], m["intermediate_size_padded"]) == (160, 192)
        assert (m["layout_metadata"]["w13"]["shape_n"], m["layout_metadata"]["w13"]["pad_shape_n"]) == (512, 128)
        assert (m["layout_metadata"]["w2"]["shape_k"], m["layout_metadata"]["w2"]["pad_shape_k"]) == (256, 64)
        assert h["quant_config"]["w1_config_is_layers"] and h["quant_config"]["w2_config_is_layers"]
        assert h["quant_config"]["w1"]["dtype"] == "float4e2m1"
        assert ours["experts_class"] == h["experts_class"] and ours["experts_class"].startswith("Humming")
        theirs = got["source"][m["prefix"]]
        assert (theirs["method"], theirs["backend"]) == ("Mxfp4MoEMethod", "HUMMING")
        v = theirs["humming"]
        for sub in ("w13", "w2"):
            for part in ("config", "config_str", "weight_schema", "input_schema"):
                assert h[sub][part] == v[sub][part], (sub, part)
        assert h["quant_config"] == v["quant_config"] and h["experts_class"] == v["experts_class"]
        assert sorted(theirs["params"]) == sorted(m["tensors"])
        for suffix, entry in m["tensors"].items():
            t = files[entry["name"]]
            if suffix.endswith("_weight"):  # vLLM's words before humming's CUDA repack: ours un-tiled
                meta = m["layout_metadata"][suffix.removesuffix("_weight")]
                Np, Kp = meta["shape_n"], meta["shape_k"]
                t = pack_int32(unrepack_weights(t, 4, Np, Kp).to(torch.int32), 4)
                assert theirs["shapes"][suffix] == [m["num_experts"], Np, Kp // 8], suffix
            want = hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()
            assert theirs["params"][suffix] == want, suffix


def _one_line(message: str | None) -> str:
    assert message is not None and "\n" not in message, message
    return message


@needs_vllm
@pytest.mark.parametrize("name", ["humming-w4a16-g32", "humming-mxfp4"])
def test_the_plugin_refuses_what_its_humming_folder_was_not_made_for(humming_folders, name):
    """Each in one line, when vLLM builds the layer (before any byte is read): another humming-kernels,
    another GPU, no GPU, humming activations quantized by ``VLLM_HUMMING_INPUT_QUANT_CONFIG``."""
    _, out = humming_folders[name]
    got = _child(out, "--humming", "--refusals")
    r = {k: _one_line(v) for k, v in got["refusals"].items()}
    assert "this folder holds humming-kernels 0.1.19's bytes; this Python has humming-kernels 0.1.20" in r["version"]
    assert "this folder holds humming's SM90 bytes (H100 / H200) and vLLM runs on an SM80 GPU" in r["sm80"]
    assert r["sm80"].endswith("serve a --backend marlin folder on this machine"), r["sm80"]
    assert "vLLM runs on its cpu platform" in r["no-gpu"] and "--backend" not in r["no-gpu"]
    assert "VLLM_HUMMING_INPUT_QUANT_CONFIG makes humming quantize this layer's activations to int8" in r["int8-input"]


@needs_vllm
def test_the_plugin_refuses_a_humming_folder_without_humming(humming_folders):
    _, out = humming_folders["humming-w4a16-no-zero"]
    got = _child(out, "--humming", "--hide-humming")
    assert "this Python has no humming (import humming fails): pip install --no-deps humming-kernels==0.1.19" in \
        _one_line(got.get("error"))


@needs_vllm
def test_the_plugin_refuses_humming_folders_vllm_never_runs_humming_for(humming_folders, example_ckpt, tmp_path):
    """vLLM 0.33.0's oracle finds no humming experts for an asymmetric compressed-tensors layer (it runs
    Marlin): such a folder matches nothing vLLM holds."""
    out = tmp_path / "asym"
    cli("repack", example_ckpt("qwen3-moe", scheme="w4a16", symmetric=False), out, "--backend", "humming", expect=0)
    got = _child(out, "--humming")
    assert "vLLM 0.33.0 never runs humming for asymmetric compressed-tensors experts" in _one_line(got.get("error"))


@pytest.fixture(scope="module")
def humming_gpu_checks(humming_folders, tmp_path_factory):
    """Every GPU check of the humming folders, in one vLLM process."""
    names = sorted(HUMMING)
    jobs = [[mode, str(humming_folders[n][1]), str(humming_folders[n][0])] for mode in ("--forward", "--bench")
            for n in names]
    path = tmp_path_factory.mktemp("humming-gpu-jobs") / "jobs.json"
    path.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    p = subprocess.run([VLLM_PYTHON, str(CHILD), str(path)], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    return {(mode, n): r for (mode, _, _), n, r in zip(jobs, names * 2, results)}


@gpu_vllm
@pytest.mark.parametrize("name", sorted(HUMMING))
def test_vllms_humming_experts_run_a_humming_folder_against_the_reference(humming_gpu_checks, name):
    """On an SM90 GPU: vLLM's humming experts, built by ``HummingWNA16Method`` over the folder's tensors,
    against ``reference_moe`` on the source's own weights."""
    got = humming_gpu_checks[("--forward", name)]
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    for prefix, layer in got["layers"].items():
        assert layer["experts_class"].startswith("Humming")
        for M, r in layer["tokens"].items():
            assert r["finite"] and r["want_norm"] > 0 and r["rel"] < 2e-2, (prefix, M, r)


@gpu_vllm
@pytest.mark.parametrize("name", sorted(HUMMING))
def test_the_humming_folder_holds_what_vllms_own_humming_processing_makes(humming_gpu_checks, name):
    """On an SM90 GPU, ``bench vllm-startup``'s check with ``--moe-backend humming``: vLLM's compressed-tensors
    method converts the source with humming's CUDA transform; every parameter equals the plugin's and the two
    layers give the same output."""
    got = humming_gpu_checks[("--bench", name)]
    assert "error" not in got, got["error"] + "\n" + got.get("traceback", "")
    # the warm-up round is reported apart, with the one-time costs vLLM's layer (built first) took
    assert got["warmup"]["layer"] == got["layers"][0]["layer"]
    assert {k for side in ("vllm", "moeconvert") for k in got["warmup"][side]} == {"build_s", "load_s", "process_s"}
    for row in got["layers"]:
        assert row["vllm"]["experts_class"] == row["moeconvert"]["experts_class"]
        assert row["same_bytes"] and all(v is True for v in row["same_bytes"].values()), row["same_bytes"]
        assert row["outputs_identical"], row["output_rel_diff"]
