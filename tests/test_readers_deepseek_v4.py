"""DeepSeek-V4's own checkpoints (moeconvert/readers/deepseek_v4.py) read into the canonical blocks, against
vLLM's own expert loader (its ``RoutedExperts._load_w13`` / ``_load_w2``, lifted from each vLLM version's
source and run on CPU tensors) and the model's own weights mapper; and the family through inspect, repack
to Marlin MXFP4, verify and the runtime on CPU, against experts dequantized here from the e2m1 / e8m0
definitions (OCP MX) with DeepSeek-V4's clamped SwiGLU written out.

The fixture (helpers.make_deepseek_v4_checkpoint) is built from the published DeepSeek-V4-Flash / Flash-Base
config fields and tensor names, as vLLM's DeepSeek-V4 loader (vllm/models/deepseek_v4) maps them.
"""

from __future__ import annotations

import ast
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from moeconvert.canonical import Partition
from moeconvert.decode import decode_chunk
from moeconvert.modelmap import map_model
from moeconvert.schemes import FloatScheme, MXFP4Scheme
from moeconvert.sources import open_source

from helpers import (cli, damaged_copy, exec_nodes, lift, make_deepseek_v4_checkpoint, resave, top_level,
                     vllm_reader)

E, H, I = 4, 128, 64
#: e2m1 code -> value (OCP MX v1.0, FP4 E2M1: sign bit 3, then 2 exponent bits and 1 mantissa bit)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4")
    return {d: make_deepseek_v4_checkpoint(root / d, expert_dtype=d, E=E, H=H, I=I) for d in ("fp4", "fp8")}


def _vllm_loader(version: str):
    """vLLM ``version``'s RoutedExperts loading methods, as a class of their own (the parts of ``self`` they
    read given as attributes)."""
    read = vllm_reader(version)
    rel = "model_executor/layers/fused_moe/routed_experts.py"
    cls = top_level(read(rel))["RoutedExperts"]
    wanted = {"_get_hidden_dim", "_narrow_expert_data_for_padding", "_load_w13", "_load_w2"}
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted, f"vllm/{rel} RoutedExperts no longer defines {sorted(wanted)}"
    ns = {"torch": torch, "cdiv": lambda a, b: -(-a // b)}
    if "copy_weight_" in read(rel):  # 0.34.0: its copy helper, a plain copy_ off integrated GPUs (CPU here)
        lift(read, "model_executor/utils.py", ["copy_weight_"], ns)
        ns["_is_integrated_gpu"] = lambda device: False
    return exec_nodes([ast.ClassDef("Loader", [], [], body, [])], f"vllm/{rel}", ns)["Loader"]


def _vllm_scale_names(version: str) -> dict:
    """The regex renames of vLLM ``version``'s DeepSeek-V4 weights mapper for FP4 experts."""
    read = vllm_reader(version)
    ns = exec_nodes([top_level(read("models/deepseek_v4/cpu/model.py"))["_make_deepseek_v4_weights_mapper"]],
                    "vllm/models/deepseek_v4/cpu/model.py", {"re": re, "WeightsMapper": lambda **kw: kw})
    return ns["_make_deepseek_v4_weights_mapper"]("fp4")["orig_to_new_regex"]


def test_fp4_block_is_what_vllms_loader_loads(ckpts, vllm_version):
    """Codes and e8m0 bytes as vLLM's Mxfp4MoEMethod parameters hold them once its loader ran, whole and
    for each rank of TP 2: gate rows then up rows, down cut on packed columns and scale groups."""
    src = ckpts["fp4"]
    regex = _vllm_scale_names(version=vllm_version)
    name = "layers.1.ffn.experts.3.w2.scale"
    mapped = next(re.sub(p, r, name) for p, r in regex.items() if re.search(p, name))
    assert mapped == "layers.1.ffn.experts.3.w2.weight_scale"  # the MXFP4 method's weight_scale, not _inv

    Loader = _vllm_loader(vllm_version)
    t = load_file(src / "model.safetensors")
    source = open_source(str(src))
    layer = map_model(source).layers[1]
    assert layer.scheme == MXFP4Scheme() and layer.format == "deepseek-v4-fp4"
    for tp in (1, 2):
        Ip = I // tp
        loader = Loader()
        loader.moe_config = type("C", (), {"is_act_and_mul": True,
                                           "moe_parallel_config": type("P", (), {"tp_size": tp})()})()
        for r in range(tp):
            # the parameters Mxfp4MoEMethod.create_weights makes (uint8), filled as vLLM's load_weights does:
            # e8m0 scales viewed as uint8, the int8 codes copied as they are
            p = {"w13": torch.zeros(E, 2 * Ip, H // 2, dtype=torch.uint8),
                 "w13_scale": torch.zeros(E, 2 * Ip, H // 32, dtype=torch.uint8),
                 "w2": torch.zeros(E, H, Ip // 2, dtype=torch.uint8),
                 "w2_scale": torch.zeros(E, H, Ip // 32, dtype=torch.uint8)}
            for e in range(E):
                for proj in ("w1", "w3", "w2"):
                    w = t[f"{layer.prefix}.{e}.{proj}.weight"]
                    s = t[f"{layer.prefix}.{e}.{proj}.scale"].view(torch.uint8)
                    assert w.dtype == torch.int8
                    for key, loaded in (("", w), ("_scale", s)):
                        if proj == "w2":
                            loader._load_w2(p["w2" + key][e], 1, loaded, r)
                        else:
                            loader._load_w13(p["w13" + key][e], 0, proj, loaded, r)
            ours = decode_chunk(source, layer, Partition(tp_size=tp, tp_rank=r), 0, E)
            for k, v in p.items():
                got = getattr(ours, k)
                assert got.dtype == torch.uint8 and torch.equal(got, v), (tp, r, k)


def _dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` int8 (element 2j in the low nibble of byte j) x ``[N, K/32]`` e8m0 -> fp32 ``[N, K]``."""
    b = codes.view(torch.uint8).long()
    vals = torch.stack([E2M1[b & 15], E2M1[b >> 4]], -1).flatten(-2)
    return vals * torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(32, -1)


def test_fp8_experts_are_the_fp8_block_values(ckpts, tmp_path):
    """Flash-Base's FP8 experts (scales named ``scale``): each element times its 128x128 block's fp32 scale,
    rounded once to bf16; quantized to MXFP4 for Marlin and verified against the source."""
    src = ckpts["fp8"]
    source = open_source(str(src))
    layer = map_model(source).layers[0]
    assert layer.scheme == FloatScheme("bfloat16") and layer.format == "deepseek-v4-fp8"
    block = decode_chunk(source, layer, Partition(), 0, E)
    t = load_file(src / "model.safetensors")
    for e in range(E):
        def deq(proj):
            w, s = t[f"{layer.prefix}.{e}.{proj}.weight"].float(), t[f"{layer.prefix}.{e}.{proj}.scale"]
            n, k = w.shape
            return (w * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(torch.bfloat16)
        assert torch.equal(block.w13[e], torch.cat([deq("w1"), deq("w3")]))
        assert torch.equal(block.w2[e], deq("w2"))
    out = tmp_path / "mx"
    cli("quantize", str(src), str(out), "--format", "mxfp4", "--backend", "marlin", expect=0)
    cli("verify", str(out), "--against", str(src), expect=0)


def test_deepseek_v4_through_every_path(ckpts, tmp_path):
    """inspect, repack to Marlin MXFP4, verify, and the runtime on CPU: each layer's experts (hash-routed
    layer 0, score-routed layer 1, both routed by the caller) against SwiGLU experts clamped at
    swiglu_limit, computed here from the source's codes and scales."""
    from moeconvert.runtime import load

    src = ckpts["fp4"]
    report = json.loads(cli("inspect", str(src), "--json", expect=0).out)
    assert report["family"] == "deepseek-v4"
    assert [x["prefix"] for x in report["moe_layers"]] == ["layers.0.ffn.experts", "layers.1.ffn.experts"]
    out = tmp_path / "marlin"
    cli("repack", str(src), str(out), "--backend", "marlin", expect=0)
    cli("verify", str(out), "--against", str(src), expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())["moe_layers"]
    assert manifest[0]["activation_params"] == {"limit": 10.0}
    assert "layers.0.ffn.gate.tid2eid" in manifest[0]["router"] and "layers.1.ffn.gate.bias" in manifest[1]["router"]
    model = load(out, device="cpu")
    t = load_file(src / "model.safetensors")
    torch.manual_seed(1)
    M, k = 5, 2
    x = (torch.randn(M, H) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, k)
    for prefix in ("layers.0.ffn.experts", "layers.1.ffn.experts"):
        want, unclamped = torch.zeros(M, H), torch.zeros(M, H)
        for m in range(M):
            for j in range(k):
                ex = f"{prefix}.{int(ids[m, j])}"
                w = {p: _dequantize_fp4(t[f"{ex}.{p}.weight"], t[f"{ex}.{p}.scale"]) for p in ("w1", "w2", "w3")}
                gate, up = w["w1"] @ x[m].float(), w["w3"] @ x[m].float()
                h = torch.nn.functional.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)
                want[m] += weights[m, j] * (w["w2"] @ h)
                unclamped[m] += weights[m, j] * (w["w2"] @ (torch.nn.functional.silu(gate) * up))
        got = model.moe_layers[prefix](x, weights, ids).float()
        assert (unclamped - want).abs().max() / want.abs().max() > 0.1  # the clamp matters for this input
        assert (got - want).abs().max() / want.abs().max() < 0.03, prefix


def _nan_scale(t: dict) -> dict:
    name = "layers.1.ffn.experts.2.w3.scale"
    s = t[name].view(torch.uint8).clone()
    s[0, 0] = 255  # e8m0's NaN
    return {name: s.view(torch.float8_e8m0fnu)}


@pytest.mark.parametrize("edit,needle", [
    ("expert_dtype", "config.json: expert_dtype: unsupported DeepSeek-V4 expert_dtype"),
    ("nan", "NaN MXFP4 scale (e8m0 byte 255)"),
    ("drop", "missing expert tensor"),
])
def test_bad_deepseek_v4_input_refused_in_one_line(ckpts, tmp_path, edit, needle):
    bad = damaged_copy(ckpts["fp4"], tmp_path, replace=_nan_scale if edit == "nan" else None)
    if edit == "expert_dtype":
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, "expert_dtype": "fp6"}))
    if edit == "drop":
        resave(bad, drop=["layers.1.ffn.experts.2.w3.scale"])
    out = tmp_path / "out"
    r = cli("repack", str(bad), str(out), "--backend", "marlin", expect=2)
    # (the warning that config.json is copied as it is may come first: the plugin does not serve this family)
    errors = [line for line in r.err.splitlines() if line.startswith("moeconvert: error: ")]
    assert len(errors) == 1 and needle in errors[0], r.err
    assert not out.exists() or not any(out.iterdir())


def test_triton_fast_kernel_refuses_the_clamped_silu(ckpts, tmp_path):
    """fused_moe_fast's SiLU has no clamp: the runtime never runs it on a layer with swiglu_limit (the layer
    falls back to the reference, which clamps, and says why)."""
    from moeconvert.runtime import KernelFallbackWarning, load
    from moeconvert.runtime import moeconvert_triton as mt

    out = tmp_path / "tf"
    cli("repack", str(ckpts["fp4"]), str(out), "--backend", "triton-fast", expect=0)
    with pytest.warns(KernelFallbackWarning):
        layer = load(out, device="cpu").moe_layers["layers.1.ffn.experts"]
    assert mt._unavailable(layer, torch.device("cuda")) == \
        "moeconvert's triton-fast kernel has no clamped SiLU (DeepSeek-V4's swiglu_limit)"
