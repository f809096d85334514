"""The runtime's ``humming`` kernel (runtime/humming.py) on ``--backend humming`` folders.

CPU: the dispatch picks ``humming`` when it says it can run, and otherwise runs the reference with each
reason in the fallback warning; the humming schemas and LayerConfigs the runtime and the vLLM plugin build
from a folder's manifest (``moeconvert.layouts.humming.humming_configs``) equal, field by field, the ones
humming's own Python makes when called as vLLM 0.33.0 calls it on the source checkpoint (its
``convert_humming`` deciding the weight dtype from the source codes, then ``prepare_layer_config``).
Only the GPU probes are answered for an SM90 GPU (``_gpu_sm``, and humming's device probe for its config).

GPU (``-m gpu``, an SM90 GPU with humming-kernels 0.1.19): the kernel against the reference at several M.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moeconvert.errors import MoeConvertError
from moeconvert.example import make_example
from moeconvert.layouts import humming as hl
from moeconvert.runtime import KernelFallbackWarning, dispatch, load
from moeconvert.runtime import humming as rh

from helpers import cli, kernel_and_reference, rel

ALL = tuple(range(8))
FOLDERS = {  # name: example kwargs (qwen3-moe, 8 experts, H 256)
    "int4-g128": dict(scheme="w4a16", group_size=128),
    "int4-g32": dict(scheme="w4a16", group_size=32, intermediate_size=96),  # w13 N 192 -> 256, w2 K 96 -> 128
    "int8-g128": dict(scheme="w8a16"),
    # no expert has a 0 code: both sublayers sign-magnitude (float{b}e0m{b-1})
    "int4-g128-no-zero": dict(scheme="w4a16", experts_without_zero_code=ALL),
    "int4-g32-no-zero": dict(scheme="w4a16", group_size=32, intermediate_size=96, experts_without_zero_code=ALL),
    "int8-g128-no-zero": dict(scheme="w8a16", experts_without_zero_code=ALL),
    "int4-asym": dict(scheme="w4a16", symmetric=False),
    "int4-channel": dict(scheme="w4a16", group_size=-1),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(name, *cut) -> (source, converted --backend humming folder), each built once."""
    made: dict = {}

    def make(name: str, *cut: str):
        key = (name, cut)
        if key not in made:
            base = tmp_path_factory.mktemp(name)
            kw = dict(FOLDERS[name])
            src = make_example(base / "src", "qwen3-moe", kw.pop("scheme"), num_experts=8, **kw)
            cli("repack", src, base / "out", "--backend", "humming", *cut, expect=0)
            made[key] = (src, base / "out")
        return made[key]

    return make


@pytest.fixture
def fresh(monkeypatch):
    """Every fallback reason warned again (the dispatch says each once per process)."""
    monkeypatch.setattr(dispatch, "_SAID", set())


def _humming_installed():
    humming = pytest.importorskip("humming", reason="humming-kernels is not installed (moeconvert[humming])")
    if humming.__version__ != "0.1.19":
        pytest.skip(f"humming-kernels {humming.__version__} is installed, the folders are made for 0.1.19")
    return humming


def _an_sm_gpu(monkeypatch, sm: int = 90):
    """The one stand-in: the device probe answers as an SM ``sm`` GPU would."""
    monkeypatch.setattr(rh, "_gpu_sm", lambda device: sm)


# ---------------------------------------------------------------------------------------------------
# the dispatch


def test_the_humming_layout_names_the_humming_kernel():
    assert hl.HummingLayout.runtime_kernels == ("humming",)
    assert ("humming", "wna16") in dispatch.reads("humming")
    assert "humming" in dispatch.kernel_names()


@pytest.mark.parametrize("name", ["int4-g32", "int8-g128-no-zero"])
def test_dispatch_picks_humming_when_it_can_run(folder, monkeypatch, fresh, name):
    _humming_installed()
    _an_sm_gpu(monkeypatch)
    _, out = folder(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)  # no fallback, no warning
        model = load(out, device="cpu")
    assert [layer.kernel for layer in model] == ["humming"] * len(model.moe_layers)
    assert all(layer.kernel_note is None for layer in model)
    assert next(iter(model)).describe()["kernel"] == "humming"
    # forced, it is taken too
    assert next(iter(load(out, device="cpu", kernel="humming"))).kernel == "humming"


def _hide_humming(monkeypatch):
    for mod in [m for m in sys.modules if m == "humming" or m.startswith("humming.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "humming", None)  # import humming fails, find_spec finds nothing


def _another_humming(monkeypatch):
    humming = _humming_installed()
    monkeypatch.setattr(humming, "__version__", "0.1.20")


REASONS = {  # case: (folder, set-up, the reason's text)
    "not-installed": ("int4-g128", lambda mp: (_an_sm_gpu(mp), _hide_humming(mp)),
                      "humming: humming-kernels is not installed: pip install 'moeconvert[humming]' "
                      "(humming-kernels==0.1.19, the version the folder was made for)"),
    "another-version": ("int4-g128", lambda mp: (_an_sm_gpu(mp), _another_humming(mp)),
                        "humming: the installed humming-kernels is 0.1.20, the folder was made for humming-kernels "
                        "0.1.19, whose weight layout it holds: pip install humming-kernels==0.1.19"),
    "no-cuda": ("int4-g128", lambda mp: _humming_installed(),
                "humming: it needs a CUDA device (device is cpu)"),
    "sm80": ("int4-g128", lambda mp: (_humming_installed(), _an_sm_gpu(mp, 80)),
             "humming: the folder holds humming's SM90 bytes (H100 / H200; humming lays weights out per GPU "
             "architecture) and this GPU is SM80: convert with --backend marlin for it"),
    "asymmetric": ("int4-asym", lambda mp: (_humming_installed(), _an_sm_gpu(mp)),
                   "humming: vLLM 0.33.0 never runs humming for asymmetric compressed-tensors experts (it serves "
                   "them with Marlin), so this humming folder has no vLLM state to match; the humming kernel runs "
                   "what vLLM runs"),
    "channelwise": ("int4-channel", lambda mp: (_humming_installed(), _an_sm_gpu(mp)),
                    "humming: vLLM 0.33.0 never runs humming for channelwise compressed-tensors experts"),
}


@pytest.mark.parametrize("case", list(REASONS))
def test_falls_back_to_the_reference_saying_why(folder, monkeypatch, fresh, case):
    name, set_up, reason = REASONS[case]
    _, out = folder(name)
    set_up(monkeypatch)
    with pytest.warns(KernelFallbackWarning) as warned:
        model = load(out, device="cpu")
    said = [str(w.message) for w in warned if issubclass(w.category, KernelFallbackWarning)]
    assert len(said) == 1 and "'humming' layout (wna16) on cpu: running the PyTorch reference" in said[0]
    assert reason in said[0] and "\n" not in said[0]
    for layer in model:
        assert layer.kernel == "reference" and reason in layer.kernel_note
    # forced, the same reason is an error, in one line
    with pytest.raises(MoeConvertError, match="kernel humming was asked for but cannot run") as e:
        load(out, device="cpu", kernel="humming")
    assert reason.removeprefix("humming: ") in str(e.value) and "\n" not in str(e.value)


def test_the_reference_still_computes_the_folder_on_the_cpu(folder, fresh):
    """The fallback is the reference over the folder's bytes: the plain layout's output, exactly."""
    src, out = folder("int4-g32-no-zero")
    plain = src.parent / "plain"
    if not plain.exists():
        cli("repack", src, plain, "--backend", "plain", expect=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        ours, base = load(out, device="cpu"), load(plain, device="cpu")
    x = (torch.randn(9, 256, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    for a, b in zip(ours, base):
        w, ids = b.route(b.router_logits(x))
        assert a.kernel == "reference" and torch.equal(a(x, w, ids), b(x, w, ids))


# ---------------------------------------------------------------------------------------------------
# the routing layout the indexed GEMMs read


def test_align_lays_routes_out_as_moe_align_block_size():
    """Each expert's routes (token * k + slot) in order, padded to the block with M*k, runs in expert order;
    routes to other ranks' experts (-1) dropped; the padded count in a one-element tensor."""
    ids = torch.tensor([[0, 3], [1, 2], [7, 0], [3, 3], [5, 6]])
    sorted_ids, expert_ids, npad = rh.align(ids, 8, 4)
    n = 10
    runs = {0: [0, 5], 1: [2], 2: [3], 3: [1, 6, 7], 5: [8], 6: [9], 7: [4]}
    want = [r for e in sorted(runs) for r in runs[e] + [n] * (-len(runs[e]) % 4)]
    assert npad.tolist() == [len(want)] and npad.dtype == torch.int32
    assert sorted_ids[:len(want)].tolist() == want and set(sorted_ids[len(want):].tolist()) == {n}
    blocks = [e for e in sorted(runs) for _ in range(-(-len(runs[e]) // 4))]
    assert expert_ids[:len(blocks)].tolist() == blocks
    assert sorted_ids.numel() >= n + 8 * 3 and expert_ids.numel() * 4 >= sorted_ids.numel()
    s, e, p = rh.align(torch.tensor([[0, -1], [1, 2], [-1, 0]]), 3, 2)
    assert p.tolist() == [6] and s[:6].tolist() == [0, 5, 2, 6, 3, 6] and e[:3].tolist() == [0, 1, 2]


def test_activation_expressions():
    assert rh.activation_impl("silu", None) == "a / (1.f + expf(-a)) * b"
    oai = rh.activation_impl("swigluoai", {"alpha": 1.5, "limit": 5})
    assert "(1.5f)" in oai and "(5.0f)" in oai and rh.activation_impl("gelu", None) is None


def test_clamped_silu_expression_is_the_references():
    # DeepSeek-V4's swiglu_limit: humming's C expression, read as Python, against runtime/reference.py's function
    import math
    import re

    from moeconvert.runtime.reference import activation_fn

    expr = rh.activation_impl("silu", {"limit": 10.0})
    py = re.sub(r"\((-?[0-9.]+)f\)", r"(\1)", expr).replace("1.f", "1.0")
    f = eval("lambda a, b: " + py, {"fminf": min, "fmaxf": max, "expf": math.exp})
    act = activation_fn("silu", {"limit": 10.0})
    for a, b in ((-3.0, 2.0), (12.0, 0.5), (4.0, 15.0), (20.0, -30.0)):
        assert f(a, b) == pytest.approx(float(act(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))))
    # gate clamped above, up on both sides (vLLM's _swiglu_limit_torch)
    assert f(20.0, -30.0) == pytest.approx(10 / (1 + math.exp(-10)) * -10)
    assert rh.activation_impl("silu", {"limit": 0}) == rh.activation_impl("silu", None)


# ---------------------------------------------------------------------------------------------------
# the shared LayerConfig against humming's own, called as vLLM calls it


@pytest.fixture
def humming_on_a_cpu(monkeypatch):
    """humming's config and schema code on this CPU: its device probe answers as an SM90 GPU, its two CUDA
    bit-packing ops are the same LSB-first packing in torch (tests/test_layout_humming.py checks humming's
    schema code over it), and its ``with torch.cuda.device(...)`` selects nothing."""
    humming = _humming_installed()
    import humming.device
    import humming.ops
    import humming.transform

    from moeconvert.packing import pack_int32, unpack_int32

    class SM90:
        sm_version, sm_major, sm_minor, is_ppu = 90, 9, 0, False

    monkeypatch.setattr(humming.device.current_device, "_value", SM90())
    monkeypatch.setattr(humming.transform, "DeviceInfo", lambda device=None: SM90())
    monkeypatch.setattr(humming.ops, "pack_weight", lambda x, b: pack_int32(x, b), raising=False)
    monkeypatch.setattr(humming.ops, "unpack_weight",
                        lambda x, b: unpack_int32(x, b, x.shape[-1] * 32 // b).to(torch.int32), raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda device=None: contextlib.nullcontext())
    return humming


def _source_sublayers(src: Path, layer: int, num_experts: int) -> dict[str, dict[str, torch.Tensor]]:
    """One layer's compressed-tensors tensors stacked over its experts, per sublayer, as vLLM's FusedMoE
    parameters hold them before its humming conversion (w13: gate rows, then up rows)."""
    from safetensors import safe_open

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            tensors.update({k: s.get_tensor(k) for k in s.keys() if f"layers.{layer}.mlp.experts." in k})
    p = f"model.layers.{layer}.mlp.experts"

    def stack(proj, name):
        return torch.stack([tensors[f"{p}.{e}.{proj}.{name}"] for e in range(num_experts)])

    out = {}
    for sub, projs in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
        out[sub] = {name: torch.cat([stack(proj, name) for proj in projs], 1)
                    for name in ("weight_packed", "weight_scale")}
        shape = stack(projs[0], "weight_shape")
        out[sub]["weight_shape"] = shape * torch.tensor([len(projs), 1])
    return out


@pytest.mark.parametrize("name", ["int4-g128", "int4-g32", "int8-g128", "int4-g128-no-zero", "int8-g128-no-zero"])
def test_shared_layer_config_equals_hummings_own_as_vllm_calls_it(folder, humming_on_a_cpu, name):
    from humming.schema import BaseWeightSchema, HummingInputSchema
    from humming.transform import prepare_layer_config

    src, out = folder(name)
    manifest = json.loads((out / "moeconvert.json").read_text())
    quant = json.loads((src / "config.json").read_text())["quantization_config"]
    group = next(iter(quant["config_groups"].values()))
    # the compressed-tensors weight args, as vLLM's WNA16 method hands them to humming's schema
    ct = {"quant_method": "compressed-tensors", "format": group["format"], **group["weights"]}
    dtype = getattr(torch, manifest["dtype"])
    for entry in manifest["moe_layers"]:
        E, H, I = entry["num_experts"], entry["hidden_size"], entry["intermediate_size"]
        scheme = entry["scheme"]
        ours = hl.humming_configs(entry["layout_metadata"], group_size=scheme["group_size"],
                                  symmetric=scheme["symmetric"], hidden_size=H, intermediate_size=I, num_experts=E,
                                  has_bias=False, dtype=dtype)
        for sub, tensors in _source_sublayers(src, entry["layer"], E).items():
            n, k = (2 * I, H) if sub == "w13" else (H, I)
            # vLLM's _process_single_sublayer: humming's convert_humming over the whole sublayer (it decides the
            # weight dtype from the codes), the 16-bit input schema, then prepare_layer_config
            weight_schema, _ = BaseWeightSchema.from_config(dict(ct)).convert_humming(
                tensors=tensors, shape_n_stacks=[I, I] if sub == "w13" else [H], shape_k_stacks=[k],
                param_dtype=dtype, num_experts=E)
            theirs = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=weight_schema,
                                          input_schema=HummingInputSchema(), num_experts=E, pad_n_to_multiple=256,
                                          pad_k_to_multiple=128, has_bias=False, torch_dtype=dtype, device=None)
            assert ours[sub].weight_schema == weight_schema, sub
            fields = [f.name for f in dataclasses.fields(theirs)]
            assert {f: getattr(ours[sub].config, f) for f in fields} == {f: getattr(theirs, f) for f in fields}, sub
            assert ours[sub].config.to_str() == theirs.to_str()
            no_zero = "no-zero" in name
            assert str(theirs.b_dtype) == (hl.sign_magnitude_dtype if no_zero else hl.unsigned_dtype)(scheme["bits"])


def test_a_folder_config_humming_would_make_otherwise_is_refused_in_one_line(folder, humming_on_a_cpu):
    _, out = folder("int4-g32")
    entry = json.loads((out / "moeconvert.json").read_text())["moe_layers"][0]
    meta = json.loads(json.dumps(entry["layout_metadata"]))
    meta["w2"]["pad_shape_k"] = 0
    with pytest.raises(MoeConvertError) as e:
        hl.humming_configs(meta, group_size=32, symmetric=True, hidden_size=256, intermediate_size=96, num_experts=8,
                           has_bias=False, dtype=torch.bfloat16)
    assert str(e.value) == ("w2: humming's LayerConfig for this layer differs from the folder's (pad_shape_k 32 here, "
                            "0 in the folder)")
    meta = json.loads(json.dumps(entry["layout_metadata"]))
    meta["w13"]["b_dtype"] = None
    with pytest.raises(MoeConvertError, match="layout_metadata.w13.b_dtype is null"):
        hl.humming_configs(meta, group_size=32, symmetric=True, hidden_size=256, intermediate_size=96, num_experts=8,
                           has_bias=False, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# GPU: humming's kernels against the reference


GPU_CASES = {  # name: (folder, partition arguments)
    "int4-g128": ("int4-g128", ()),
    "int4-g32": ("int4-g32", ()),
    "int8-g128": ("int8-g128", ()),
    "int4-g128-no-zero": ("int4-g128-no-zero", ()),
    "int4-g32-no-zero": ("int4-g32-no-zero", ()),
    "int8-g128-no-zero": ("int8-g128-no-zero", ()),
    # an EP rank: routes to the other rank's experts add nothing
    "int4-g128-ep1of2": ("int4-g128", ("--ep-size", "2", "--ep-rank", "1")),
}


def _require_humming_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _humming_installed()
    sm = rh._gpu_sm(torch.device("cuda", torch.cuda.current_device()))
    if sm != 90:
        pytest.skip(f"the humming folders are laid out for SM90; this GPU is SM{sm}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_humming_dispatch_matches_the_reference(folder, case, M):
    _require_humming_gpu()
    name, cut = GPU_CASES[case]
    _, out = folder(name, *cut)
    model = load(out, device="cuda")
    dt = torch.bfloat16  # the examples' model dtype: humming's scales and LayerConfig are in it
    for layer in model:
        assert layer.kernel == "humming", layer.kernel_note
        want_dtype = (hl.sign_magnitude_dtype if "no-zero" in name else hl.unsigned_dtype)(layer.entry.scheme.bits)
        assert {layer.entry.metadata[s]["b_dtype"] for s in hl.SUBLAYERS} == {want_dtype}  # the case it says
        x, got, want = kernel_and_reference(layer, M, dt)
        err = rel(got, want)
        print(f"\n{case} {layer.prefix} M={M}: humming vs reference rel err {err:.2e}")
        assert got.shape == x.shape and got.dtype == dt and torch.isfinite(got).all()
        assert err < 2e-2
        w, ids = layer.route(layer.router_logits(x))  # the routing kernel_and_reference drew
        again = layer(x, w, ids)  # the layer's configs, tuning and locks are kept and reused
        assert rel(again, got) < 1e-3


# ---------------------------------------------------------------------------------------------------
# MXFP4 humming folders (``quantize --format mxfp4 --backend humming``): the same kernel, e2m1 weights


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """(source, its humming MXFP4 folder): qwen3-moe bf16, 8 experts, H 256, I 80 (padded to 128 as vLLM pads
    it for HUMMING; humming adds no padding of its own then)."""
    base = tmp_path_factory.mktemp("mxfp4")
    src = make_example(base / "src", "qwen3-moe", "bf16", num_experts=8, hidden_size=256, intermediate_size=80)
    cli("quantize", src, base / "out", "--format", "mxfp4", "--backend", "humming", expect=0)
    return src, base / "out"


def test_the_humming_mxfp4_layout_names_the_humming_kernel():
    from moeconvert.layouts import humming_mxfp4 as hm

    assert hm.HummingMXFP4Layout.runtime_kernels == ("humming",)
    assert ("humming", "mxfp4") in dispatch.reads("humming")


MXFP4_REASONS = {
    "not-installed": (lambda mp: (_an_sm_gpu(mp), _hide_humming(mp)),
                      "humming: humming-kernels is not installed: pip install 'moeconvert[humming]' "
                      "(humming-kernels==0.1.19, the version the folder was made for)"),
    "no-cuda": (lambda mp: _humming_installed(), "humming: it needs a CUDA device (device is cpu)"),
    "sm80": (lambda mp: (_humming_installed(), _an_sm_gpu(mp, 80)),
             "humming: the folder holds humming's SM90 bytes (H100 / H200; humming lays weights out per GPU "
             "architecture) and this GPU is SM80: convert with --backend marlin for it"),
}


@pytest.mark.parametrize("case", list(MXFP4_REASONS))
def test_an_mxfp4_folder_falls_back_to_the_reference_saying_why(mxfp4_folder, monkeypatch, fresh, case):
    set_up, reason = MXFP4_REASONS[case]
    _, out = mxfp4_folder
    set_up(monkeypatch)
    with pytest.warns(KernelFallbackWarning) as warned:
        model = load(out, device="cpu")
    said = [str(w.message) for w in warned if issubclass(w.category, KernelFallbackWarning)]
    assert len(said) == 1 and "'humming' layout (mxfp4) on cpu: running the PyTorch reference" in said[0], said
    assert reason in said[0] and "\n" not in said[0]
    for layer in model:
        assert layer.kernel == "reference" and reason in layer.kernel_note


def test_the_reference_computes_an_mxfp4_folder_as_the_plain_layouts(mxfp4_folder, fresh, tmp_path):
    """The fallback reads the humming bytes back to the quantization the plain layout holds unswizzled (I
    padded to 96 there, 128 here: zero rows and columns, which add nothing)."""
    src, out = mxfp4_folder
    cli("quantize", src, tmp_path / "plain", "--format", "mxfp4", "--backend", "plain", expect=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        ours, base = load(out, device="cpu"), load(tmp_path / "plain", device="cpu")
    x = (torch.randn(9, 256, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    for a, b in zip(ours, base):
        w, ids = b.route(b.router_logits(x))
        got, want = a(x, w, ids), b(x, w, ids)
        assert a.kernel == "reference" and rel(got, want) < 1e-2, rel(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_humming_dispatch_runs_an_mxfp4_folder_as_the_reference(mxfp4_folder, M):
    _require_humming_gpu()
    _, out = mxfp4_folder
    model = load(out, device="cuda")
    for layer in model:
        assert layer.kernel == "humming", layer.kernel_note
        assert {layer.entry.metadata[s]["b_dtype"] for s in ("w13", "w2")} == {"float4e2m1"}
        x, got, want = kernel_and_reference(layer, M, torch.bfloat16)
        err = rel(got, want)
        print(f"\nmxfp4 {layer.prefix} M={M}: humming vs reference rel err {err:.2e}")
        assert got.shape == x.shape and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert err < 2e-2


# ---------------------------------------------------------------------------------------------------
# NVFP4 humming folders (``repack`` of a compressed-tensors ``nvfp4-pack-quantized`` checkpoint)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the OCP e2m1 magnitudes; the top bit of a nibble is the sign


@pytest.fixture(scope="module")
def nvfp4_folder(example_ckpt, tmp_path_factory):
    """(source, its humming NVFP4 folder): qwen3-moe NVFP4 (8 experts, H 256), I 80 (humming pads w13's N to
    256 and w2's K to 128; vLLM pads nothing for this path); the source is the plugin tests' own."""
    src = example_ckpt("qwen3-moe", scheme="nvfp4", intermediate_size=80)
    out = tmp_path_factory.mktemp("nvfp4") / "out"
    cli("repack", src, out, "--backend", "humming", expect=0)
    return src, out


def _source_expert(t: dict, name: str) -> torch.Tensor:
    """One projection of the source, dequantized here from compressed-tensors' own fields: ``weight_packed``
    (two e2m1 codes a byte, low nibble first), ``weight_scale`` (e4m3, one per 16 along K) and
    ``weight_global_scale`` (a divisor): ``e2m1 * scale / global``, in float32."""
    packed = t[f"{name}.weight_packed"]
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(packed.shape[0], -1).long()
    value = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = t[f"{name}.weight_scale"].float().repeat_interleave(16, 1)
    return value * scale / t[f"{name}.weight_global_scale"].float()


def test_the_reference_computes_an_nvfp4_folder_as_the_source_dequantized(nvfp4_folder, fresh):
    """On the CPU the runtime runs its reference over the folder's bytes; its output is the MoE computed
    here, in float32, from the source checkpoint's own fields (SiLU-and-mul, the routing weights)."""
    from helpers import st_tensors

    assert ("humming", "nvfp4") in dispatch.reads("humming")
    src, out = nvfp4_folder
    source = st_tensors(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        model = load(out, device="cpu")
    x = (torch.randn(9, 256, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    layers = list(model)
    assert len(layers) == 2
    for layer in layers:
        assert layer.kernel == "reference" and layer.entry.layout.name == "humming"
        w, ids = layer.route(layer.router_logits(x))
        got = layer(x, w, ids).float()
        want = torch.zeros(9, 256)
        experts = {int(e): [_source_expert(source, f"{layer.prefix}.{int(e)}.{p}")
                            for p in ("gate_proj", "up_proj", "down_proj")] for e in ids.unique()}
        for m in range(9):
            for slot in range(ids.shape[1]):
                gate, up, down = experts[int(ids[m, slot])]
                h = torch.nn.functional.silu(gate @ x[m].float()) * (up @ x[m].float())
                want[m] += float(w[m, slot]) * (down @ h)
        assert rel(got, want) < 1e-2, rel(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_humming_dispatch_runs_an_nvfp4_folder_as_the_reference(nvfp4_folder, M):
    """humming's grouped GEMM on the folder's e2m1 words, e4m3 scales and fp32 secondary scales."""
    _require_humming_gpu()
    _, out = nvfp4_folder
    model = load(out, device="cuda")
    for layer in model:
        assert layer.kernel == "humming", layer.kernel_note
        assert {layer.entry.metadata[s]["bs_dtype"] for s in ("w13", "w2")} == {"float8e4m3"}
        x, got, want = kernel_and_reference(layer, M, torch.bfloat16)
        err = rel(got, want)
        print(f"\nnvfp4 {layer.prefix} M={M}: humming vs reference rel err {err:.2e}")
        assert got.shape == x.shape and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert err < 2e-2


def test_swiglustep_expression_is_the_one_vllm_gives_humming(vllm_version):
    """Step-3.5's swiglustep as humming's input processing runs it: ours and vLLM's SWIGLUSTEP expression
    (``get_humming_activation``) take the runtime reference's values (evaluated in doubles), both clamps biting."""
    from moeconvert.runtime.reference import activation_fn

    from helpers import eval_c_activation, vllm_humming_activation

    ours = rh.activation_impl("swiglustep", {"limit": 7.0})
    theirs = vllm_humming_activation(vllm_version, "swiglustep")
    ref = activation_fn("swiglustep", {"limit": 7.0})
    for a, b in ((-9.0, 3.0), (-0.4, 7.5), (0.3, -12.0), (2.5, 0.5), (11.0, -6.0)):
        want = float(ref(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))
        assert eval_c_activation(ours, a, b) == pytest.approx(want, rel=1e-12, abs=1e-15), (a, b)
        assert eval_c_activation(theirs, a, b) == pytest.approx(want, rel=1e-12, abs=1e-15), (a, b)


@pytest.mark.parametrize("linear_beta", [None, 4.0])
def test_situ_expression_is_the_one_vllm_gives_humming(linear_beta, vllm_version):
    """Kimi-K3's SITU as humming's input processing runs it: our expression and the one vLLM's
    ``get_humming_activation`` writes for SITU take the same values (evaluated in doubles), which are the
    runtime reference's."""
    from moeconvert.runtime.reference import activation_fn

    from helpers import eval_c_activation, vllm_humming_activation

    params = {"beta": 0.75} | ({} if linear_beta is None else {"linear_beta": linear_beta})
    ours = rh.activation_impl("situ", params)
    theirs = vllm_humming_activation(vllm_version, "situ", 0.75, linear_beta)
    ref = activation_fn("situ", params)
    for a, b in ((-9.0, 3.0), (-0.4, 7.5), (0.3, -12.0), (2.5, 0.5), (11.0, -6.0)):
        want = float(ref(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))
        assert eval_c_activation(ours, a, b) == pytest.approx(want, rel=1e-12, abs=1e-15), (a, b)
        assert eval_c_activation(theirs, a, b) == pytest.approx(want, rel=1e-12, abs=1e-15), (a, b)
