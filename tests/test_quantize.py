"""`moeconvert quantize --format mxfp4` end to end: padding, gate/up order, TP cuts, refusals, the
quality report and `verify`'s re-quantization.

Expected bytes are built here from the source tensors read with safetensors' own reader, padded by
hand and quantized with :func:`quantize_mxfp4` (whose rule is checked bit for bit against the spec's
vectors and vLLM's kernel in test_mxfp4.py); the pipeline under test is everything around it.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeconvert.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from moeconvert.verify import verify_output

from helpers import (cli, int_loaded, make_int_checkpoint, st_tensors, to_gptoss_mxfp4, vllm_marlin_reference,
                     vllm_nvfp4_dequantization)

H, I, E = 256, 80, 4  # I = 80 is padded to 96 by the plain layout's 32-multiples


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from moeconvert.example import make_example

    return make_example(tmp_path_factory.mktemp("q") / "ckpt", "qwen3-moe", "bf16", num_experts=E,
                        hidden_size=H, intermediate_size=I, num_layers=2)


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    from moeconvert.example import make_example

    return make_example(tmp_path_factory.mktemp("g") / "ckpt", "gpt-oss", "bf16", num_experts=E,
                        hidden_size=H, intermediate_size=128, num_layers=2)


def expected_plain(src: dict, prefix: str, rounding: str = "vllm", tp: int = 1, rank: int = 0, pad_to: int = 32):
    """The plain MXFP4 tensors of one layer, from per-expert source weights, padded by hand."""
    Ir = I // tp
    Ip = -(-Ir // pad_to) * pad_to
    rows = slice(rank * Ir, (rank + 1) * Ir)
    w13 = torch.zeros(E, 2 * Ip, H, dtype=torch.bfloat16)
    w2 = torch.zeros(E, H, Ip, dtype=torch.bfloat16)
    for e in range(E):
        w13[e, :Ir] = src[f"{prefix}.{e}.gate_proj.weight"][rows]
        w13[e, Ip:Ip + Ir] = src[f"{prefix}.{e}.up_proj.weight"][rows]
        w2[e, :, :Ir] = src[f"{prefix}.{e}.down_proj.weight"][:, rows]
    return quantize_mxfp4(w13, rounding), quantize_mxfp4(w2, rounding), Ip


def test_plain_bytes_padding_and_manifest(qwen, tmp_path):
    out = tmp_path / "out"
    cli("quantize", qwen, out, "--format", "mxfp4", "--backend", "plain", expect=0)
    src, got = st_tensors(qwen), st_tensors(out)
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert manifest["quantization"] == {"format": "mxfp4", "rounding": "vllm"}
    assert len(manifest["moe_layers"]) == 2
    for layer in manifest["moe_layers"]:
        prefix = layer["prefix"]
        (p13, s13), (p2, s2), Ip = expected_plain(src, prefix)
        assert (layer["intermediate_size"], layer["intermediate_size_padded"]) == (80, 96)
        assert (layer["hidden_size"], layer["hidden_size_padded"]) == (256, 256)
        assert layer["scheme"]["kind"] == "mxfp4" and layer["source_scheme"] == {"kind": "float", "dtype": "bfloat16"}
        assert torch.equal(got[f"{prefix}.w13_weight"], p13)
        assert torch.equal(got[f"{prefix}.w13_weight_scale"], s13)
        assert torch.equal(got[f"{prefix}.w2_weight"], p2)
        assert torch.equal(got[f"{prefix}.w2_weight_scale"], s2)
        # padded rows / columns are zero codes with scale byte 0 (what quantizing zeros gives)
        assert not got[f"{prefix}.w13_weight"][:, 80:96].any() and not got[f"{prefix}.w13_weight_scale"][:, 176:].any()
        assert not got[f"{prefix}.w2_weight"][:, :, 40:].any()  # K 80..95 share block 2 with real K 64..79
        # the stored quality is what dequantizing the real region gives
        real = torch.cat([src[f"{prefix}.{e}.gate_proj.weight"].float() for e in range(E)]
                         + [src[f"{prefix}.{e}.up_proj.weight"].float() for e in range(E)])
        deq = torch.cat([dequantize_mxfp4(p13[e, :80], s13[e, :80]) for e in range(E)]
                        + [dequantize_mxfp4(p13[e, 96:176], s13[e, 96:176]) for e in range(E)])
        rel = float((real.double() - deq.double()).norm() / real.double().norm())
        assert layer["quality"]["w13"]["rel_fro_error"] == pytest.approx(rel, rel=1e-6)
        assert 0.05 < rel < 0.2  # 4-bit floats on Gaussian weights
        assert layer["quality"]["w13"]["max_abs_error"] == pytest.approx(float((real - deq).abs().max()))
    # everything that is not an expert passes through byte for byte
    for name, t in src.items():
        if ".experts." not in name:
            assert torch.equal(got[name], t), name
    report = verify_output(out, against=str(qwen))
    assert report.ok and all(lr.compared and lr.quality for lr in report.layers)


def test_rounding_rules_differ_and_verify_uses_the_stored_one(qwen, tmp_path):
    a, b = tmp_path / "vllm", tmp_path / "ocp"
    cli("quantize", qwen, a, "--backend", "plain", expect=0)
    cli("quantize", qwen, b, "--backend", "plain", "--rounding", "ocp", expect=0)
    src = st_tensors(qwen)
    prefix = json.loads((b / "moeconvert.json").read_text())["moe_layers"][0]["prefix"]
    (p13, s13), _, _ = expected_plain(src, prefix, "ocp")
    got_a, got_b = st_tensors(a), st_tensors(b)
    assert torch.equal(got_b[f"{prefix}.w13_weight"], p13) and torch.equal(got_b[f"{prefix}.w13_weight_scale"], s13)
    assert not torch.equal(got_a[f"{prefix}.w13_weight_scale"], got_b[f"{prefix}.w13_weight_scale"])
    assert verify_output(b, against=str(qwen)).ok
    # the same bytes claimed as the other rule no longer verify
    m = json.loads((b / "moeconvert.json").read_text())
    m["quantization"]["rounding"] = "vllm"
    (b / "moeconvert.json").write_text(json.dumps(m))
    report = verify_output(b, against=str(qwen))
    assert not report.ok and any("w13_scale" in d for lr in report.layers for d in lr.differences)


def test_tp_rank_cut_before_padding(qwen, tmp_path):
    out = tmp_path / "tp"
    cli("quantize", qwen, out, "--backend", "plain", "--tp-size", "2", "--tp-rank", "1", expect=0)
    src, got = st_tensors(qwen), st_tensors(out)
    layer = json.loads((out / "moeconvert.json").read_text())["moe_layers"][0]
    assert (layer["intermediate_size"], layer["intermediate_size_padded"]) == (40, 64)
    (p13, s13), (p2, s2), _ = expected_plain(src, layer["prefix"], tp=2, rank=1)
    assert torch.equal(got[f"{layer['prefix']}.w13_weight"], p13)
    assert torch.equal(got[f"{layer['prefix']}.w2_weight_scale"], s2)
    assert verify_output(out, against=str(qwen)).ok


def test_quality_tampering_is_caught(qwen, tmp_path):
    out = tmp_path / "out"
    cli("quantize", qwen, out, "--backend", "plain", expect=0)
    m = json.loads((out / "moeconvert.json").read_text())
    m["moe_layers"][1]["quality"]["w2"]["rel_fro_error"] *= 0.5
    (out / "moeconvert.json").write_text(json.dumps(m))
    report = verify_output(out, against=str(qwen))
    assert not report.ok
    assert any("quality w2.rel_fro_error" in d for d in report.layers[1].differences)
    assert report.layers[0].ok


def test_non_finite_weights_are_refused_naming_layer_and_expert(qwen, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(qwen, bad)
    f = next(bad.glob("*.safetensors"))
    tensors = {}
    with safe_open(f, "pt") as h:
        meta = h.metadata()
        for k in h.keys():
            tensors[k] = h.get_tensor(k)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    tensors[name][3, 5] = float("inf")
    tensors[name][7, 1] = float("nan")
    save_file(tensors, str(f), metadata=meta)
    out = tmp_path / "out"
    err = cli("quantize", bad, out, "--backend", "plain", expect=2).err
    assert "model.layers.1.mlp.experts" in err and "expert 2: 2" in err and "non-finite" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("rounding", ["vllm", "triton_kernels"])
def test_weights_at_the_top_of_bf16_are_refused_where_the_rounding_overflows(qwen, tmp_path, rounding):
    """bf16's largest finite value gets the scale 2^127 (vllm) or 2^126 (triton_kernels) and a code whose
    product is beyond float32: written down, that weight would dequantize to inf in every kernel."""
    bad = tmp_path / "bad"
    shutil.copytree(qwen, bad)
    f = next(bad.glob("*.safetensors"))
    with safe_open(f, "pt") as h:
        meta = h.metadata()
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[name][2, 40] = torch.finfo(torch.bfloat16).max
    save_file(tensors, str(f), metadata=meta)
    out = tmp_path / "out"
    err = cli("quantize", bad, out, "--backend", "plain", "--rounding", rounding, expect=2).err
    assert len(err.strip().splitlines()) == 1
    assert "model.layers.1.mlp.experts: expert 3 (w2): 1 block(s) of 32 (max |x| 3.39e+38)" in err
    assert f"--rounding {rounding}" in err and "dequantize to inf" in err and "--rounding ocp" in err
    assert not out.exists()
    # the advice holds: ocp encodes the same weights with finite values only
    cli("quantize", bad, out, "--backend", "plain", "--rounding", "ocp", expect=0)
    with safe_open(out / "model-00001-of-00001.safetensors", "pt") as h:
        w2, s2 = h.get_tensor("model.layers.1.mlp.experts.w2_weight"), h.get_tensor("model.layers.1.mlp.experts.w2_weight_scale")
    assert bool(torch.isfinite(dequantize_mxfp4(w2, s2)).all())


def test_unknown_format_and_rounding(qwen, tmp_path):
    assert "nvfp4" in cli("quantize", qwen, tmp_path / "a", "--backend", "plain", "--format", "nvfp4", expect=2).err
    assert "rounding" in cli("quantize", qwen, tmp_path / "b", "--backend", "plain", "--rounding", "up", expect=2).err


# ---------------------------------------------------------------------------------------------------
# From GPTQ, AWQ and compressed-tensors int checkpoints: vLLM's dequantization, then the MXFP4 above

IH, II = 256, 128  # marlin's multiples (256, 128): nothing padded, so its bytes are the plain ones relaid out


@pytest.fixture(scope="module")
def ints(tmp_path_factory):
    """GPTQ int4 g32, AWQ int4 g64 and compressed-tensors int4 g32 (symmetric) of one bf16 checkpoint, and
    each one's ``quantize --backend plain`` output (the oracle tests below compare it per vLLM version)."""
    from moeconvert.example import make_example

    base = tmp_path_factory.mktemp("ints")
    kw = dict(num_layers=1, num_experts=E, hidden_size=IH, intermediate_size=II)
    bf16 = make_example(base / "bf16", "qwen3-moe", "bf16", **kw)
    srcs = {"gptq": make_int_checkpoint(bf16, base / "gptq", "gptq", bits=4, group_size=32),
            "awq": make_int_checkpoint(bf16, base / "awq", "awq", bits=4, group_size=64),
            "ct": make_example(base / "ct", "qwen3-moe", "w4a16", group_size=32, **kw)}
    outs = {}
    for case, (name, extra) in INT_CASES.items():
        outs[case] = base / f"{case}-plain"
        cli("quantize", srcs[name], outs[case], "--format", "mxfp4", "--backend", "plain", *extra, expect=0)
    return srcs, outs


#: case -> (source, extra quantize arguments): the model dtype and a TP rank's cut are the dequantization's too
INT_CASES = {"gptq": ("gptq", []), "awq": ("awq", []), "ct": ("ct", []),
             "gptq fp16": ("gptq", ["--dtype", "float16"]),
             "awq tp2 rank1": ("awq", ["--tp-size", "2", "--tp-rank", "1"])}


@pytest.mark.parametrize("case", list(INT_CASES))
def test_int_sources_quantize_vllms_own_dequantization(ints, case, vllm_version):
    """The MXFP4 bytes are the MXFP4 quantization (the rule test_mxfp4.py proves bit-exact with vLLM's online
    quantizer) of what vLLM's own Python dequantization of the loaded int4 tensors gives in the model dtype
    (``_unpack_and_dequant_int4_gptq`` / ``_awq``; compressed-tensors' packing along K is GPTQ's), cut for
    the TP rank as vLLM's loader cuts the weights."""
    srcs, outs = ints
    name, extra = INT_CASES[case]
    ref = vllm_marlin_reference(vllm_version)
    got = st_tensors(outs[case])
    manifest = json.loads((outs[case] / "moeconvert.json").read_text())
    prefix = manifest["moe_layers"][0]["prefix"]
    assert manifest["moe_layers"][0]["source_scheme"]["kind"] == "wna16"
    # symmetric GPTQ / compressed-tensors are uint4b8 to vLLM: their zero points are not read
    if name == "ct":
        p = int_loaded(srcs[name], prefix, E, ("weight_packed", "weight_scale", None), k_first=False)
    else:
        p = int_loaded(srcs[name], prefix, E, ("qweight", "scales", "qzeros" if name == "awq" else None))
    fn = ref._unpack_and_dequant_int4_awq if name == "awq" else ref._unpack_and_dequant_int4_gptq
    dtype = torch.float16 if "float16" in extra else torch.bfloat16
    tp, r = (2, 1) if "--tp-size" in extra else (1, 0)
    Ir = II // tp
    for w in ("13", "2"):
        # the loader casts the fp16 scales to the model dtype, the dequantization computes in it
        deq = fn(p[f"w{w}"], p[f"s{w}"].to(dtype), p.get(f"z{w}"), transpose_output=True, output_dtype=dtype)
        if w == "13":
            deq = torch.cat([deq[:, r * Ir:(r + 1) * Ir], deq[:, II + r * Ir:II + (r + 1) * Ir]], dim=1)
        else:
            deq = deq[:, :, r * Ir:(r + 1) * Ir]
        packed, scales = quantize_mxfp4(deq, "vllm")
        assert torch.equal(got[f"{prefix}.w{w}_weight"], packed)
        assert torch.equal(got[f"{prefix}.w{w}_weight_scale"], scales)


def test_gptq_to_marlin_verifies_and_dry_run_plans_it(ints, tmp_path):
    src = ints[0]["gptq"]
    plan = cli("quantize", src, tmp_path / "dry", "--format", "mxfp4", "--backend", "marlin", "--dry-run", expect=0)
    assert "marlin" in plan.out and "float8_e8m0fnu" in plan.out and not (tmp_path / "dry").exists()
    out = tmp_path / "out"
    run = cli("quantize", src, out, "--format", "mxfp4", "--backend", "marlin", "--verify", expect=0)
    assert "verified: identical to the source" in run.out, run.out
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert manifest["moe_layers"][0]["source_scheme"]["kind"] == "wna16"
    assert manifest["moe_layers"][0]["scheme"]["kind"] == "mxfp4"
    # the quality report measures MXFP4 against the dequantized weights (verify recomputed it above)
    assert 0.05 < manifest["moe_layers"][0]["quality"]["w13"]["rel_fro_error"] < 0.3


def _poison(name: str, suffix: str, value):
    def edit(t: dict) -> None:
        key = f"model.layers.0.mlp.experts.2.down_proj.{suffix}"
        t[key] = t[key].clone()
        t[key].view(-1)[5] = value
    return name, edit


INT_REFUSALS = {
    "gptq zero point": (*_poison("gptq", "qzeros", 0x77777777 + 1), [], ["down_proj.qzeros", "zero point"]),
    "awq NaN scale": (*_poison("awq", "scales", float("nan")), [], ["down_proj.scales", "finite"]),
    "fp16 overflow": (*_poison("gptq", "scales", 60000.0), ["--dtype", "float16"],
                      ["expert 2 (w2)", "float16's range"]),
    "TP cuts a group": ("gptq", None, ["--tp-size", "8", "--tp-rank", "0"], ["not a multiple of the source's group"]),
}


@pytest.mark.parametrize("case", list(INT_REFUSALS))
def test_corrupt_int_sources_are_refused_in_one_line_writing_nothing(ints, tmp_path, case):
    from safetensors.torch import load_file

    name, edit, extra, phrases = INT_REFUSALS[case]
    src = tmp_path / "src"
    shutil.copytree(ints[0][name], src)
    if edit:
        t = load_file(src / "model.safetensors")
        edit(t)
        save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    err = cli("quantize", src, out, "--format", "mxfp4", "--backend", "plain", *extra, expect=2).err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeconvert: error: "), err
    for p in phrases:
        assert p in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())
    assert not [p for p in tmp_path.iterdir() if "moeconvert-partial" in p.name]


# ---------------------------------------------------------------------------------------------------
# From compressed-tensors NVFP4: vLLM's own dequantization for requantization, then the MXFP4 above

#: case -> extra quantize arguments
NVFP4_CASES = {"bf16": [], "fp16": ["--dtype", "float16"], "tp2 rank1": ["--tp-size", "2", "--tp-rank", "1"]}


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    """A compressed-tensors nvfp4-pack-quantized checkpoint (H, I at marlin's multiples: nothing padded) and
    its ``quantize --backend plain`` output per case."""
    from moeconvert.example import make_example

    base = tmp_path_factory.mktemp("nvfp4")
    src = make_example(base / "src", "qwen3-moe", "nvfp4", num_layers=1, num_experts=E, hidden_size=IH,
                       intermediate_size=II)
    outs = {}
    for case, extra in NVFP4_CASES.items():
        outs[case] = base / case
        cli("quantize", src, outs[case], "--format", "mxfp4", "--backend", "plain", *extra, expect=0)
    return src, outs


@pytest.mark.parametrize("case", list(NVFP4_CASES))
def test_nvfp4_source_quantizes_vllms_own_dequantization(nvfp4, case, vllm_version):
    """The MXFP4 bytes are the MXFP4 quantization of what vLLM's own dequantization of the loaded NVFP4
    tensors gives in the model dtype (``dequantize_nvfp4_moe_weights``, what its compressed-tensors NVFP4
    MoE method hands its online MXFP4 method), for the TP rank's cut of the loaded tensors."""
    src, outs = nvfp4
    extra = NVFP4_CASES[case]
    got = st_tensors(outs[case])
    manifest = json.loads((outs[case] / "moeconvert.json").read_text())
    layer = manifest["moe_layers"][0]
    prefix = layer["prefix"]
    assert layer["source_scheme"]["kind"] == "nvfp4" and layer["scheme"]["kind"] == "mxfp4"
    t = st_tensors(src)
    tp, r = (2, 1) if "--tp-size" in extra else (1, 0)
    Ir = II // tp
    rows = slice(r * Ir, (r + 1) * Ir)

    def per(proj, suffix, cut=lambda x: x):
        return torch.stack([cut(t[f"{prefix}.{e}.{proj}.{suffix}"]) for e in range(E)])

    # what vLLM's loader holds on this rank: gate and up rows cut, down's packed columns and scale groups cut,
    # the per-tensor global scales whole ([E, 2] for w13, [E] for w2)
    w13 = torch.cat([per(p, "weight_packed", lambda x: x[rows]) for p in ("gate_proj", "up_proj")], 1)
    s13 = torch.cat([per(p, "weight_scale", lambda x: x[rows]) for p in ("gate_proj", "up_proj")], 1)
    g13 = torch.cat([per(p, "weight_global_scale") for p in ("gate_proj", "up_proj")], 1)
    w2 = per("down_proj", "weight_packed", lambda x: x[:, r * Ir // 2:(r + 1) * Ir // 2])
    s2 = per("down_proj", "weight_scale", lambda x: x[:, r * Ir // 16:(r + 1) * Ir // 16])
    g2 = per("down_proj", "weight_global_scale")[:, 0]
    dtype = torch.float16 if "float16" in extra else torch.bfloat16
    deq = dict(zip(("13", "2"), vllm_nvfp4_dequantization(vllm_version)(w13, s13, g13, w2, s2, g2, dtype)))
    for w in ("13", "2"):
        assert deq[w].dtype == dtype
        packed, scales = quantize_mxfp4(deq[w], "vllm")
        assert torch.equal(got[f"{prefix}.w{w}_weight"], packed)
        assert torch.equal(got[f"{prefix}.w{w}_weight_scale"], scales)


def test_nvfp4_to_marlin_verifies_and_fp16_overflow_is_refused(nvfp4, tmp_path):
    from safetensors.torch import load_file

    src = nvfp4[0]
    out = tmp_path / "out"
    run = cli("quantize", src, out, "--format", "mxfp4", "--backend", "marlin", "--verify", expect=0)
    assert "verified: identical to the source" in run.out, run.out
    # a small global scale is valid NVFP4, but its products overflow float16 (vLLM's cast would give inf)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    t = load_file(bad / "model.safetensors")
    key = "model.layers.0.mlp.experts.3.up_proj.weight_global_scale"
    t[key] = torch.tensor([1e-3])
    save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out16"
    err = cli("quantize", bad, out, "--format", "mxfp4", "--backend", "plain", "--dtype", "float16", expect=2).err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "expert 3 (w13)" in lines[0] and "float16's range" in lines[0], err
    assert not out.exists() or not any(out.iterdir())


def test_gptoss_mxfp4_checkpoint_is_relaid_out_without_requantizing(gptoss, tmp_path):
    mx = tmp_path / "mx"
    to_gptoss_mxfp4(gptoss, mx)
    a, b = tmp_path / "from-mxfp4", tmp_path / "from-bf16"
    cli("quantize", mx, a, "--backend", "plain", expect=0)
    cli("quantize", gptoss, b, "--backend", "plain", expect=0)
    got_a, got_b, src = st_tensors(a), st_tensors(b), st_tensors(mx)
    ma = json.loads((a / "moeconvert.json").read_text())
    for layer in ma["moe_layers"]:
        prefix = layer["prefix"]
        assert "quality" not in layer and layer["source_scheme"]["kind"] == "mxfp4"
        blocks = src[f"{prefix}.gate_up_proj_blocks"].flatten(2)
        # canonical [gate; up]: gpt-oss' interleaved rows 0, 2, 4, ... then 1, 3, 5, ...
        assert torch.equal(got_a[f"{prefix}.w13_weight"], torch.cat([blocks[:, 0::2], blocks[:, 1::2]], 1))
        for suffix in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias"):
            assert torch.equal(got_a[f"{prefix}.{suffix}"], got_b[f"{prefix}.{suffix}"]), suffix
    assert verify_output(a, against=str(mx)).ok


def test_gptoss_down_bias_only_on_tp_rank_0(gptoss, tmp_path):
    r0, r1 = tmp_path / "r0", tmp_path / "r1"
    cli("quantize", gptoss, r0, "--backend", "plain", "--tp-size", "2", "--tp-rank", "0", expect=0)
    cli("quantize", gptoss, r1, "--backend", "plain", "--tp-size", "2", "--tp-rank", "1", expect=0)
    src = st_tensors(gptoss)
    prefix = json.loads((r0 / "moeconvert.json").read_text())["moe_layers"][0]["prefix"]
    assert torch.equal(st_tensors(r0)[f"{prefix}.w2_bias"], src[f"{prefix}.down_proj_bias"])
    assert not st_tensors(r1)[f"{prefix}.w2_bias"].any()
    assert verify_output(r1, against=str(gptoss)).ok


def test_emulation_keeps_gptoss_rows_interleaved(gptoss, qwen, tmp_path):
    """vLLM's MXFP4 EMULATION backend holds the plain bytes; gpt-oss rows stay in the checkpoint's
    gate/up interleave, which is quantizing the checkpoint's own [E, 2I, H] rows directly."""
    out = tmp_path / "emu"
    cli("quantize", gptoss, out, "--backend", "emulation", expect=0)
    src, got = st_tensors(gptoss), st_tensors(out)
    prefix = json.loads((out / "moeconvert.json").read_text())["moe_layers"][0]["prefix"]
    p13, s13 = quantize_mxfp4(src[f"{prefix}.gate_up_proj"].transpose(1, 2).contiguous())
    assert torch.equal(got[f"{prefix}.w13_weight"], p13) and torch.equal(got[f"{prefix}.w13_weight_scale"], s13)
    assert torch.equal(got[f"{prefix}.w13_bias"], src[f"{prefix}.gate_up_proj_bias"])
    assert verify_output(out, against=str(gptoss)).ok
    # models without the interleave: the plain bytes
    a, b = tmp_path / "qe", tmp_path / "qp"
    cli("quantize", qwen, a, "--backend", "emulation", expect=0)
    cli("quantize", qwen, b, "--backend", "plain", expect=0)
    ta, tb = st_tensors(a), st_tensors(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_cuda_writes_the_same_files(qwen, tmp_path):
    a, b = tmp_path / "cpu", tmp_path / "cuda"
    cli("quantize", qwen, a, "--backend", "plain", expect=0)
    cli("quantize", qwen, b, "--backend", "plain", "--device", "cuda", expect=0)
    ta, tb = st_tensors(a), st_tensors(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    qa = [lay["quality"] for lay in json.loads((a / "moeconvert.json").read_text())["moe_layers"]]
    qb = [lay["quality"] for lay in json.loads((b / "moeconvert.json").read_text())["moe_layers"]]
    for x, y in zip(qa, qb):
        for proj in ("w13", "w2"):
            assert x[proj]["saturated_block_fraction"] == y[proj]["saturated_block_fraction"]
            assert x[proj]["rel_fro_error"] == pytest.approx(y[proj]["rel_fro_error"], rel=1e-9)
