"""What ``moeconvert.runtime.load`` refuses, each with one clear line (MoeConvertError), and the dispatch's
explicit choices: an override that cannot run is an error, a preferred kernel that cannot run is a
fallback said once."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from moeconvert.errors import MoeConvertError
from moeconvert.example import make_example
from moeconvert.runtime import KernelFallbackWarning, dispatch, load

from helpers import cli

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("refusals")
    src = make_example(base / "src", "qwen3-moe", "w4a16", group_size=32, num_experts=4)
    made = {}
    for name, args in {"plain": ("--backend", "plain"), "marlin": ("--backend", "marlin"),
                       "tp2": ("--backend", "marlin", "--tp-size", 2, "--tp-rank", 1),
                       "triton-fast": ("--backend", "triton-fast")}.items():
        cli("repack", src, base / name, *args, expect=0)
        made[name] = base / name
    return made


@pytest.fixture
def copy(outputs, tmp_path):
    def make(name="plain"):
        dst = tmp_path / name
        shutil.copytree(outputs[name], dst)
        return dst
    return make


def edit_manifest(folder, fn):
    p = folder / "moeconvert.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def refused(match, *args, **kw):
    with pytest.raises(MoeConvertError, match=match) as exc:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KernelFallbackWarning)
            load(*args, **kw)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_missing_manifest(copy):
    out = copy()
    (out / "moeconvert.json").unlink()
    refused(r"incomplete or not a moeconvert output: no moeconvert\.json", out, device="cpu")
    refused("no such output folder", out / "nope", device="cpu")


def test_truncated_shard(copy):
    out = copy()
    shard = out / SHARD
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    msg = refused("truncated shard", out, device="cpu")
    assert SHARD in msg and f"{size} bytes" in msg and f"{size - 100} bytes" in msg


def test_missing_shard(copy):
    out = copy()
    (out / SHARD).unlink()
    refused("shard listed in the manifest is missing", out, device="cpu")


def test_checksum_mismatch_with_verify(copy):
    out = copy()
    manifest = json.loads((out / "moeconvert.json").read_text())
    name = manifest["moe_layers"][0]["tensors"]["w13_weight"]["name"]
    from moeconvert.format import read_header

    info = read_header(out / SHARD)[name]
    with open(out / SHARD, "r+b") as f:
        f.seek(info.start + 5)
        b = f.read(1)
        f.seek(info.start + 5)
        f.write(bytes([b[0] ^ 0x10]))
    msg = refused("checksum mismatch", out, device="cpu", verify=True)
    assert name in msg and SHARD in msg
    load(out, device="cpu")  # without verify=True nothing hashes: the load is just a copy


def test_future_layout_version(copy):
    out = copy("marlin")
    edit_manifest(out, lambda m: m["layout"].update(version=m["layout"]["version"] + 1))
    msg = refused("layout version is newer than this moeconvert knows", out, device="cpu")
    assert "layout marlin" in msg and "expected 1, found 2" in msg


def test_unknown_layout_and_format_version(copy):
    out = copy()
    edit_manifest(out, lambda m: m["layout"].update(name="nonesuch"))
    refused("unknown backend layout", out, device="cpu")
    out2 = copy("marlin")
    edit_manifest(out2, lambda m: m.update(format_version=99))
    refused("unsupported output format version", out2, device="cpu")


def test_layout_made_for_another_kernel_library_version(copy):
    out = copy("marlin")
    edit_manifest(out, lambda m: m["layout"].update(made_for={"vllm": "0.30.0"}))
    msg = refused("made for other kernel library versions", out, device="cpu")
    assert "0.33.0" in msg and "0.30.0" in msg
    edit_manifest(out, lambda m: m["layout"].update(made_for={"vllm": ["0.33.0", "0.35.0"]}))  # one not checked
    assert "0.35.0" in refused("made for other kernel library versions", out, device="cpu")


def test_a_manifest_naming_one_vllm_version_as_a_string_still_loads(copy):
    """Folders written before made_for listed versions name one (``"vllm": "0.33.0"``): same layout version, same
    bytes, so it loads; the list written today names every version the layout was checked against."""
    out = copy("marlin")
    assert json.loads((out / "moeconvert.json").read_text())["layout"]["made_for"] == {"vllm": ["0.33.0", "0.34.0"]}
    edit_manifest(out, lambda m: m["layout"].update(made_for={"vllm": "0.33.0"}))
    assert load(out, device="cpu").moe_layers


def test_a_triton_fast_folder_written_before_the_plugin_served_it_still_loads(copy):
    """triton-fast's ``made_for`` names the vLLM versions the plugin serves it on, not a library its bytes were
    made for: a folder of the same layout version written before (no ``vllm`` key) loads; versions the layout
    does not list, or another library, are refused as for every layout."""
    out = copy("triton-fast")
    assert json.loads((out / "moeconvert.json").read_text())["layout"]["made_for"] == {"vllm": ["0.33.0", "0.34.0"]}
    edit_manifest(out, lambda m: m["layout"].update(made_for={}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        assert load(out, device="cpu").moe_layers
    edit_manifest(out, lambda m: m["layout"].update(made_for={"vllm": ["0.35.0"]}))
    assert "0.35.0" in refused("made for other kernel library versions", out, device="cpu")
    edit_manifest(out, lambda m: m["layout"].update(made_for={"triton": "3.6.0"}))
    refused("made for other kernel library versions", out, device="cpu")


def test_layout_made_for_another_tp_size(outputs):
    msg = refused(r"cut for tp_size 2, not 1", outputs["tp2"], device="cpu", tp_size=1)
    assert "--tp-size 1" in msg
    refused(r"cut for tp_rank 1, not 0", outputs["tp2"], device="cpu", tp_rank=0)
    refused(r"cut for ep_size 1, not 2", outputs["marlin"], device="cpu", ep_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        model = load(outputs["tp2"], device="cpu", tp_size=2, tp_rank=1)
    assert model.partition["tp_rank"] == 1


def test_header_disagreeing_with_manifest(copy):
    out = copy()

    def shrink(m):
        e = m["moe_layers"][0]["tensors"]["w2_weight"]
        e["shape"] = [e["shape"][0] - 1, *e["shape"][1:]]
    edit_manifest(out, shrink)
    refused("shard header disagrees with the manifest", out, device="cpu")


def test_no_cuda(outputs):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    refused("torch sees none", outputs["plain"], device="cuda")


@pytest.mark.parametrize("argument,value", [
    ("tp_size", "2"), ("tp_size", 0), ("tp_size", -1), ("tp_size", 1.0), ("tp_size", True), ("tp_rank", -1),
    ("tp_rank", "0"), ("ep_size", 0), ("ep_rank", -2), ("threads", 0), ("buffer_mb", -1.0), ("buffer_mb", float("nan")),
    ("verify", "yes"), ("progress", 1), ("reader", 3), ("kernel", ""), ("revision", 7),
    ("layers", 3), ("layers", [-1]), ("device", 5), ("device", "cdua"), ("path_or_repo", None),
])
def test_each_bad_argument_of_load_is_one_line_naming_it(outputs, argument, value):
    """Checked before anything is read, each in one line naming the argument and what it must be: a string or
    0 TP size is not "a folder cut for another TP size" (``tune`` is tune_wanted's: tests/test_kernel_tune.py)."""
    kw = {"path_or_repo": outputs["plain"], "device": "cpu", argument: value}
    line = refused(rf"^load\(\) argument {argument} \(expected .*, found .*\)$", kw.pop("path_or_repo"), **kw)
    assert repr(value)[:20] in line, line


@pytest.mark.parametrize("size,rank", [("tp_size", "tp_rank"), ("ep_size", "ep_rank")])
def test_a_rank_at_or_above_its_size_is_refused_naming_both(outputs, size, rank):
    refused(rf"^load\(\) argument {rank} \(expected below {size} 2, found 2\)$", outputs["plain"], device="cpu",
            **{size: 2, rank: 2})


def test_unknown_layer(outputs):
    refused("no such MoE layer", outputs["plain"], device="cpu", layers=[7])


# ---------------------------------------------------------------------------------------------------
# dispatch


def test_override_that_cannot_run_is_an_error(outputs, monkeypatch):
    refused("unknown kernel", outputs["marlin"], device="cpu", kernel="cutlass")
    refused("does not read the 'plain' layout", outputs["plain"], device="cpu", kernel="vllm-marlin")
    monkeypatch.setenv("MOECONVERT_KERNEL", "vllm-marlin")
    monkeypatch.delenv("MOECONVERT_VLLM_MOE_LIB", raising=False)
    refused("kernel vllm-marlin was asked for but cannot run: it needs a CUDA device", outputs["marlin"],
            device="cpu")


def test_fallback_is_said_once_with_the_reason(outputs):
    dispatch._SAID.clear()
    with pytest.warns(KernelFallbackWarning) as record:
        model = load(outputs["marlin"], device="cpu")
    assert len(record) == 1  # two layers, one reason: said once
    text = str(record[0].message)
    assert "'marlin' layout (wna16)" in text and "vllm-marlin: it needs a CUDA device" in text
    for layer in model:
        assert layer.kernel == "reference" and "CUDA" in layer.kernel_note
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        load(outputs["marlin"], device="cpu")  # not said again


def test_triton_layout_on_cpu_falls_back_without_the_interpreter(tmp_path, monkeypatch):
    # moeconvert.kernels runs it on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/test_kernels.py)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src = make_example(tmp_path / "src", "qwen3-moe", "w4a16", num_experts=4)
    cli("repack", src, tmp_path / "out", "--backend", "triton", expect=0)
    dispatch._SAID.clear()
    with pytest.warns(KernelFallbackWarning, match="triton: Triton kernels need a CUDA device"):
        layer = next(iter(load(tmp_path / "out", device="cpu")))
    assert layer.kernel == "reference"
    with pytest.raises(MoeConvertError, match="kernel triton was asked for but cannot run"):
        load(tmp_path / "out", device="cpu", kernel="triton")
