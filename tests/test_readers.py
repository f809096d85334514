"""moeconvert.readers: one reader per checkpoint format (docs/architecture.md "Readers", docs/sources.md).

The compressed-tensors, float and gpt-oss readers are proved by the decode, layout and bad-input tests
that predate the registry; here, the registry's own refusals and the GPTQ and AWQ readers. GPTQ and AWQ
checkpoints are written from their formats' specification (helpers.make_int_checkpoint; where AutoRound
is installed, its own exporters pack the same parameters into the same blocks) and proved against
vLLM's own code, per vLLM version:

* the canonical block dequantizes, bit for bit, to what vLLM's Python dequantization of the packed
  tensors gives (``_unpack_and_dequant_int4_gptq`` / ``_awq``, its emulation backend's);
* ``repack --backend marlin`` writes, byte for byte, what vLLM's Marlin processing of the tensors its
  loader holds gives (``_process_weights_marlin`` after AutoGPTQMoEMethod's transpose;
  ``_process_awq_weights_marlin``), the CUDA repack ops stood in by vLLM's Python reference
  (helpers.vllm_marlin_reference; the GPU test below runs vLLM's compiled AWQ op against its stand-in).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeconvert.canonical import Partition
from moeconvert.decode import decode_chunk
from moeconvert.example import make_example
from moeconvert.modelmap import map_model
from moeconvert.sources import open_source

from helpers import (AUTOROUND, cli, int_loaded, make_int_checkpoint, same_bits, st_tensors, vllm_marlin_reference,
                     vllm_process_awq_marlin, vllm_process_marlin)

E, H, I = 4, 256, 128


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("readers")
    bf16 = make_example(base / "bf16", "qwen3-moe", "bf16", num_layers=1, num_experts=E, hidden_size=H,
                        intermediate_size=I)
    return {
        "ct": make_example(base / "ct", "qwen3-moe", "w4a16", num_layers=1, num_experts=E, hidden_size=H,
                           intermediate_size=I, group_size=32, symmetric=False),
        "gptq4": make_int_checkpoint(bf16, base / "gptq4", "gptq", bits=4, group_size=32),
        "gptq8": make_int_checkpoint(bf16, base / "gptq8", "gptq", bits=8, group_size=-1, g_idx=False),
        "awq": make_int_checkpoint(bf16, base / "awq", "awq", bits=4, group_size=64),
    }


def loaded(src: Path, prefix: str) -> dict[str, torch.Tensor]:
    return int_loaded(src, prefix, E)


def canonical(src: Path, part: Partition = Partition()):
    source = open_source(str(src))
    layer = map_model(source).layers[0]
    return layer, decode_chunk(source, layer, part, 0, E)


def dequant(codes, scales, zeros, offset):
    """Canonical ``[E, N, K]`` codes -> float32 weights (the canonical block's one rule)."""
    g = codes.shape[2] // scales.shape[2]
    z = zeros.float() if zeros is not None else torch.full(scales.shape, float(offset))
    return (codes.float() - z.repeat_interleave(g, 2)) * scales.float().repeat_interleave(g, 2)


# ---------------------------------------------------------------------------------------------------
# the registry


def refused(src: Path, tmp_path: Path, *phrases: str, backend: str = "marlin") -> str:
    out = tmp_path / "out"
    code, _, err = cli("repack", src, out, "--backend", backend)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moeconvert: error: "), err
    for p in phrases:
        assert p in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())
    assert not [p for p in tmp_path.iterdir() if "moeconvert-partial" in p.name]
    return lines[0]


def edited(src: Path, tmp_path: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of ``src`` with quantization_config keys set (None deletes one) and ``tensors(dict)`` applied."""
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        qc = cfg["quantization_config"]
        for k, v in config.items():
            qc.pop(k) if v is None else qc.__setitem__(k, v)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_an_unknown_quant_method_is_refused_naming_those_read(sources, tmp_path):
    line = refused(edited(sources["gptq4"], tmp_path, {"quant_method": "bitsandbytes"}), tmp_path,
                   "quantization_config.quant_method", "bitsandbytes")
    assert "expected one of auto-round, awq, compressed-tensors, fp8, gptq, mxfp4 or none" in line


def test_a_compressed_tensors_format_without_a_reader_is_refused_naming_those_read(tmp_path):
    src = make_example(tmp_path / "ct", "qwen3-moe", "w4a16", num_layers=1, num_experts=4, hidden_size=128,
                       intermediate_size=64, group_size=32)
    groups = json.loads((src / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["format"] = "int-quantized"
    line = refused(edited(src, tmp_path, {"config_groups": groups}), tmp_path,
                   "quantization_config.config_groups.group_0.format", "int-quantized")
    assert "expected one of mxfp4-pack-quantized, nvfp4-pack-quantized, pack-quantized" in line


# ---------------------------------------------------------------------------------------------------
# GPTQ and AWQ decode: vLLM's own dequantization of the packed tensors


@pytest.mark.parametrize("name", ["gptq4", "awq"])
def test_decode_dequantizes_as_vllm_does(sources, name, vllm_version):
    ref = vllm_marlin_reference(vllm_version)
    layer, block = canonical(sources[name])
    p = loaded(sources[name], layer.prefix)
    fn = ref._unpack_and_dequant_int4_gptq if name.startswith("gptq") else ref._unpack_and_dequant_int4_awq
    zeros = (None, None) if name.startswith("gptq") else (p["z13"], p["z2"])  # GPTQ: uint4b8, zeros unread
    w13 = fn(p["w13"], p["s13"], zeros[0], transpose_output=True, output_dtype=torch.float32)
    w2 = fn(p["w2"], p["s2"], zeros[1], transpose_output=True, output_dtype=torch.float32)
    s = block.scheme
    assert same_bits(dequant(block.w13, block.w13_scale, block.w13_zero, s.offset), w13)
    assert same_bits(dequant(block.w2, block.w2_scale, block.w2_zero, s.offset), w2)


def test_autoround_writes_what_the_spec_fixtures_hold(sources, tmp_path):
    """The same round-to-nearest parameters packed by AutoRound's own exporters decode to the very blocks the
    specification's fixtures decode to, and AWQ's to what AutoRound's own dequantization gives."""
    pytest.importorskip("auto_round", reason="AutoRound (pip install auto-round) packs the producer's fixtures")
    from auto_round.export.export_to_awq.utils import dequantize_gemm

    bf16 = sources["gptq4"].parent / "bf16"
    for name, method, bits, g in (("gptq4", "gptq", 4, 32), ("gptq8", "gptq", 8, -1), ("awq", "awq", 4, 64)):
        theirs = make_int_checkpoint(bf16, tmp_path / name, method, bits=bits, group_size=g, producer="autoround",
                                     g_idx=name != "gptq8")
        assert st_tensors(theirs).keys() == st_tensors(sources[name]).keys()
        (_, block), (_, spec) = canonical(theirs), canonical(sources[name])
        assert block.differences(spec) == [], name
    layer, block = canonical(tmp_path / "awq")
    t = st_tensors(tmp_path / "awq")
    for e in range(E):
        module = f"{layer.prefix}.{e}.down_proj"
        ref = dequantize_gemm(t[f"{module}.qweight"], t[f"{module}.qzeros"], t[f"{module}.scales"], 4, 64)  # [K, N]
        ours = dequant(block.w2[e:e + 1], block.w2_scale[e:e + 1], block.w2_zero[e:e + 1], 8)[0].T
        assert same_bits(ours.half(), ref), module


def _v2_zeros(t: torch.Tensor) -> torch.Tensor:
    """v1 qzeros (every 4-bit field zero - 1 = 7) as gptq_v2 stores them (every field 8)."""
    return t + 0x11111111


@pytest.mark.parametrize("name,config,tensors", [
    ("gptq4", {"checkpoint_format": "gptq_v2"}, _v2_zeros),
    # rules that match no MoE layer (routers, attention), and one that restates the base config for the experts
    ("gptq4", {"dynamic": {r"-:.*mlp\.gate$": {}, r"+:.*self_attn\..*": {"bits": 8},
                           r"+:.*\.experts": {"bits": 4, "group_size": 32}}}, None),
    ("gptq8", {"desc_act": True}, None),  # channelwise: activation ordering is a no-op, and vLLM accepts it
])
def test_accepted_variants_decode_to_the_same_block(sources, tmp_path, name, config, tensors):
    edit = None if tensors is None else (lambda t: [t.__setitem__(n, tensors(t[n])) for n in list(t)
                                                    if n.endswith("qzeros")])
    _, block = canonical(edited(sources[name], tmp_path, config, edit))
    assert block.differences(canonical(sources[name])[1]) == []


def test_scheme_and_inspect_name_the_format(sources):
    for name, fmt, scheme in (("gptq4", "gptq", "w4a16 g32 sym"), ("gptq8", "gptq", "w8a16 channel sym"),
                              ("awq", "awq", "w4a16 g64 asym")):
        report = json.loads(cli("inspect", sources[name], "--json", expect=0).out)
        assert report["format"] == fmt
        assert {(x["format"], x["scheme"]) for x in report["moe_layers"]} == {(fmt, scheme)}


def test_tp_cut_is_a_slice_of_the_whole_block(sources):
    _, whole = canonical(sources["awq"])
    _, half = canonical(sources["awq"], Partition(tp_size=2, tp_rank=1))
    rows = torch.cat([torch.arange(I // 2, I), torch.arange(I + I // 2, 2 * I)])
    assert torch.equal(half.w13, whole.w13[:, rows]) and torch.equal(half.w13_zero, whole.w13_zero[:, rows])
    assert torch.equal(half.w2, whole.w2[:, :, I // 2:]) and torch.equal(half.w2_zero, whole.w2_zero[:, :, 1:])


# ---------------------------------------------------------------------------------------------------
# repack --backend marlin: the bytes vLLM's Marlin processing holds


def marlin_out(src: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"out-{src.name}"
    if not out.exists():
        cli("repack", src, out, "--backend", "marlin", expect=0)
    return st_tensors(out)


@pytest.mark.parametrize("name,bits,g", [("gptq4", 4, 32), ("gptq8", 8, -1)])
def test_gptq_marlin_bytes_equal_vllm(sources, tmp_path_factory, name, bits, g, vllm_version):
    src = sources[name]
    ours = marlin_out(src, tmp_path_factory.getbasetemp())
    prefix = map_model(open_source(str(src))).layers[0].prefix
    p = loaded(src, prefix)
    # AutoGPTQMoEMethod.process_weights_after_loading: K-first -> N-first, then _process_weights_marlin;
    # scales live in the model dtype's params (bf16), as the loader copied them
    nfirst = lambda t: t.transpose(1, 2).contiguous()
    out = vllm_process_marlin(vllm_marlin_reference(vllm_version), bits, g, I, {
        "w13": nfirst(p["w13"]), "w2": nfirst(p["w2"]), "w13_scale": nfirst(p["s13"]).to(torch.bfloat16),
        "w2_scale": nfirst(p["s2"]).to(torch.bfloat16), "w13_zero": None, "w2_zero": None,
        "w13_bias": None, "w2_bias": None})
    assert same_bits(ours[f"{prefix}.w13_weight"], out["w13"])
    assert same_bits(ours[f"{prefix}.w2_weight"], out["w2"])
    assert same_bits(ours[f"{prefix}.w13_weight_scale"], out["s13"])
    assert same_bits(ours[f"{prefix}.w2_weight_scale"], out["s2"])
    # symmetric GPTQ: vLLM's kernel takes no zero points (uint4b8 / uint8b128), and the folder holds none
    assert f"{prefix}.w13_weight_zero_point" not in ours


def test_awq_marlin_bytes_equal_vllm(sources, tmp_path_factory, vllm_version):
    src = sources["awq"]
    ours = marlin_out(src, tmp_path_factory.getbasetemp())
    prefix = map_model(open_source(str(src))).layers[0].prefix
    p = loaded(src, prefix)
    out = vllm_process_awq_marlin(vllm_marlin_reference(vllm_version), 64, I, {
        "w13": p["w13"], "w2": p["w2"], "w13_scale": p["s13"].to(torch.bfloat16),
        "w2_scale": p["s2"].to(torch.bfloat16), "w13_zero": p["z13"], "w2_zero": p["z2"],
        "w13_bias": None, "w2_bias": None})
    for ours_name, theirs in (("w13_weight", "w13"), ("w2_weight", "w2"), ("w13_weight_scale", "s13"),
                              ("w2_weight_scale", "s2"), ("w13_weight_zero_point", "z13"),
                              ("w2_weight_zero_point", "z2")):
        assert same_bits(ours[f"{prefix}.{ours_name}"], out[theirs]), ours_name


@pytest.mark.gpu
def test_awq_repack_op_equals_its_python_stand_in(sources):
    """vLLM's compiled ``awq_marlin_moe_repack`` (its ``_C`` library, through the installed vLLM's
    ``_custom_ops``) on the AWQ words == the stand-in the oracle above uses, and the marlin layout's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        from vllm import _custom_ops as ops
        from vllm import __version__ as installed
    except ImportError as e:
        pytest.skip(f"needs vLLM with its CUDA ops installed ({e})")
    src = sources["awq"]
    prefix = map_model(open_source(str(src))).layers[0].prefix
    w13 = loaded(src, prefix)["w13"]
    theirs = ops.awq_marlin_moe_repack(w13.cuda(), w13.shape[1], w13.shape[2] * 8, 4).cpu()
    stand_in = vllm_marlin_reference(installed).ops.awq_marlin_moe_repack(w13, w13.shape[1], w13.shape[2] * 8, 4)
    assert same_bits(theirs, stand_in)


# ---------------------------------------------------------------------------------------------------
# checkpoints written by the producers themselves: AutoRound and GPTQModel (tests/data/*/make.py say how)

#: folder under tests/data -> (the packing, inspect's format, each layer's reader, each layer's (bits, group size))
DATA = AUTOROUND.parent
PRODUCER_CASES = {
    "autoround/gptq-w4g32": ("gptq", "gptq", "gptq", [(4, 32), (4, 32)]),
    "autoround/gptq-w4g32-w8-layer1": ("gptq", "gptq", "gptq", [(4, 32), (8, 32)]),
    "autoround/awq-w4g32": ("awq", "awq", "awq", [(4, 32), (4, 32)]),
    "autoround/auto-round-w4g32": ("gptq", "auto-round (auto_round:auto_gptq)", "auto-round-gptq", [(4, 32), (4, 32)]),
    "autoround/auto-round-awq-w4g32": ("awq", "auto-round (auto_round:auto_awq)", "auto-round-awq", [(4, 32), (4, 32)]),
    "gptqmodel/w4g32": ("gptq", "gptq", "gptq", [(4, 32), (4, 32)]),
    "gptqmodel/w4g32-dynamic": ("gptq", "gptq", "gptq", [(4, 32), (8, 32)]),
}


def test_the_producers_checkpoints_are_their_own():
    """What the tests below rely on, read from the files: AutoRound 0.16.1 and GPTQModel 7.7.0 wrote them,
    AutoRound's routers are left unquantized by its own config rules, and layer 1's experts in the mixed
    ones are packed at 8 bits."""
    for name in PRODUCER_CASES:
        qc = json.loads((DATA / name / "config.json").read_text())["quantization_config"]
        if name.startswith("gptqmodel/"):
            assert qc["meta"]["quantizer"] == ["gptqmodel:7.7.0"], name
            continue
        assert qc["autoround_version"] == "0.16.1", name
        assert qc.get("provider") == "auto-round" or qc["quant_method"] == "auto-round", name
    dynamic = json.loads((DATA / "gptqmodel/w4g32-dynamic/config.json").read_text())["quantization_config"]["dynamic"]
    assert dynamic == {r"+:.*layers\.1\.mlp\.experts.*": {"bits": 8}}
    gptq = json.loads((AUTOROUND / "gptq-w4g32" / "config.json").read_text())["quantization_config"]
    assert sorted(gptq["dynamic"]) == [rf"-:.*model\.layers\.{i}\.mlp\.gate.*" for i in (0, 1)]
    mixed = json.loads((AUTOROUND / "gptq-w4g32-w8-layer1" / "config.json").read_text())["quantization_config"]
    assert mixed["dynamic"][r"+:.*model\.layers\.1\.mlp\.experts.*"] == {"bits": 8, "group_size": 32, "sym": True}
    awq = json.loads((AUTOROUND / "awq-w4g32" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.gate" in awq["modules_to_not_convert"]
    own = json.loads((AUTOROUND / "auto-round-w4g32" / "config.json").read_text())["quantization_config"]
    assert (own["quant_method"], own["packing_format"]) == ("auto-round", "auto_round:auto_gptq")
    assert own["extra_config"]["model.layers.0.mlp.gate"]["bits"] == 16
    t = st_tensors(AUTOROUND / "gptq-w4g32-w8-layer1")
    assert list(t["model.layers.0.mlp.experts.3.down_proj.qweight"].shape) == [128 // 8, 128]
    assert list(t["model.layers.1.mlp.experts.3.down_proj.qweight"].shape) == [128 // 4, 128]


def test_inspect_reads_each_layer_of_the_producers_checkpoints_as_vllm_does():
    for name, (packing, fmt, reader, layers) in PRODUCER_CASES.items():
        report = json.loads(cli("inspect", DATA / name, "--json", expect=0).out)
        assert report["format"] == fmt
        sym = "sym" if packing == "gptq" else "asym"
        assert [(x["format"], x["scheme"]) for x in report["moe_layers"]] == [
            (reader, f"w{bits}a16 g{g} {sym}") for bits, g in layers], name


@pytest.mark.parametrize("name", list(PRODUCER_CASES))
def test_producers_marlin_bytes_equal_vllm(name, tmp_path_factory, vllm_version):
    """Every layer of the folder == vLLM's Marlin processing of the params its GPTQ / AWQ MoE method loads,
    at the bits and group size vLLM's config gives that layer (``dynamic``: 8 bits for the mixed one's
    layer 1), scales in the model dtype (float16 where AutoRound loaded the model on a CPU, bfloat16 where its
    model-free mode kept the source's) as vLLM's loader copies them. AutoRound's own format
    (``auto-round``) is served by vLLM's INC config with those same methods (``INCWNA16MoEScheme``)."""
    src = DATA / name
    base = tmp_path_factory.getbasetemp() / name.split("/")[0]
    base.mkdir(exist_ok=True)
    ours = marlin_out(src, base)
    ref = vllm_marlin_reference(vllm_version)
    nfirst = lambda t: t.transpose(1, 2).contiguous()
    packing, *_, layers = PRODUCER_CASES[name]
    dtype = getattr(torch, json.loads((src / "config.json").read_text())["dtype"])  # the params' dtype
    for layer, (bits, g) in zip(map_model(open_source(str(src))).layers, layers):
        p = int_loaded(src, layer.prefix, 4)
        if packing == "gptq":
            out = vllm_process_marlin(ref, bits, g, 128, {
                "w13": nfirst(p["w13"]), "w2": nfirst(p["w2"]), "w13_scale": nfirst(p["s13"]).to(dtype),
                "w2_scale": nfirst(p["s2"]).to(dtype), "w13_zero": None, "w2_zero": None, "w13_bias": None,
                "w2_bias": None})
        else:
            out = vllm_process_awq_marlin(ref, g, 128, {
                "w13": p["w13"], "w2": p["w2"], "w13_scale": p["s13"].to(dtype), "w2_scale": p["s2"].to(dtype),
                "w13_zero": p["z13"], "w2_zero": p["z2"], "w13_bias": None, "w2_bias": None})
        pairs = [("w13_weight", "w13"), ("w2_weight", "w2"), ("w13_weight_scale", "s13"), ("w2_weight_scale", "s2")]
        if packing == "awq":
            pairs += [("w13_weight_zero_point", "z13"), ("w2_weight_zero_point", "z2")]
        for ours_name, theirs in pairs:
            assert same_bits(ours[f"{layer.prefix}.{ours_name}"], out[theirs]), (layer.prefix, ours_name)


# ---------------------------------------------------------------------------------------------------
# refusals: one line, exit 2, nothing written


def _set(name_part: str, fn, every: bool = False):
    """A tensors edit: ``fn(t)`` replaces the first (sorted) tensor whose name ends with ``name_part``, or
    ``every`` one."""
    def edit(t: dict) -> None:
        names = sorted(n for n in t if n.endswith(name_part))
        for name in names if every else names[:1]:
            t[name] = fn(t[name])
    return edit


def _drop(name_part: str):
    def edit(t: dict) -> None:
        del t[sorted(n for n in t if n.endswith(name_part))[0]]
    return edit


def _permute_g_idx(t: torch.Tensor) -> torch.Tensor:
    return t[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(0))]


def _nan_last(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[-1] = float("nan")
    return t


REFUSALS = {
    # name: (source, config edit, tensors edit, phrases of the one line)
    "gptq asymmetric": ("gptq4", {"sym": False}, None, ["quantization_config.sym", "asymmetric GPTQ"]),
    "gptq act-order": ("gptq4", {"desc_act": True}, None, ["quantization_config.desc_act", "activation ordering"]),
    "gptq 3 bits": ("gptq4", {"bits": 3}, None, ["quantization_config.bits", "4 or 8"]),
    "gptq unknown checkpoint_format": ("gptq4", {"checkpoint_format": "marlin"}, None,
                                       ["quantization_config.checkpoint_format", "gptq or gptq_v2"]),
    "gptq v2 with v1 zeros": ("gptq4", {"checkpoint_format": "gptq_v2"}, None,
                              ["qzeros", "zero point out of range", "expected 8 everywhere", "found 7"]),
    "gptq dynamic leaves packed experts unquantized": ("gptq4", {"dynamic": {"-:.*experts.*": {}}}, None,
                                                       ["experts are stored quantized",
                                                        "leaves the experts unquantized"]),
    "gptq dynamic rule for one expert module": ("gptq4", {"dynamic": {r"+:.*experts\.2\.down_proj": {"bits": 8}}},
                                                None, ["experts.2.down_proj", "another config than vLLM gives",
                                                       r"found rule '+:.*experts\\.2\\.down_proj' (8 bits"]),
    "gptq dynamic regex": ("gptq4", {"dynamic": {"+:.*(experts": {}}}, None,
                           ["quantization_config.dynamic.+:.*(experts", "does not compile"]),
    "gptq dynamic rule not an object": ("gptq4", {"dynamic": {"+:.*experts": 8}}, None,
                                        ["quantization_config.dynamic.+:.*experts", "expected an object"]),
    "gptq dynamic act-order": ("gptq4", {"dynamic": {r"+:.*q_proj": {"desc_act": True}}}, None,
                               ["quantization_config.dynamic.+:.*q_proj", "activation ordering"]),
    "gptq dynamic asymmetric experts": ("gptq4", {"dynamic": {"+:.*experts": {"sym": False}}}, None,
                                        ["quantization_config.dynamic.+:.*experts", "asymmetric"]),
    "gptq g_idx permuted": ("gptq4", None, _set("experts.0.up_proj.g_idx", _permute_g_idx),
                            ["experts.0.up_proj.g_idx", "activation ordering"]),
    "gptq g_idx not groups": ("gptq4", None, _set("experts.0.up_proj.g_idx", lambda t: t * 0 + 9),
                              ["experts.0.up_proj.g_idx", "not a grouping"]),
    "gptq last expert's zero": ("gptq4", None, _set("experts.3.down_proj.qzeros", lambda t: t + 1),
                                ["experts.3.down_proj.qzeros", "zero point out of range"]),
    "gptq NaN scale": ("gptq4", None, _set("experts.3.gate_proj.scales", _nan_last),
                       ["experts.3.gate_proj.scales", "finite", "1 NaN/inf"]),
    "gptq qweight dtype": ("gptq4", None, _set("gate_proj.qweight", lambda t: t.to(torch.int16), every=True),
                           ["experts.0.gate_proj.qweight", "unexpected dtype", "expected I32, found I16"]),
    "gptq qweight truncated": ("gptq4", None, _set("experts.2.up_proj.qweight", lambda t: t[:-1].contiguous()),
                               ["experts.2.up_proj.qweight", "disagree across experts"]),
    "gptq missing qzeros": ("gptq4", None, _drop("experts.1.down_proj.qzeros"), ["missing expert tensor", "qzeros"]),
    "gptq extra tensor": ("gptq4", None, lambda t: t.__setitem__(
        sorted(n for n in t if n.endswith("experts.0.gate_proj.qweight"))[0].replace("qweight", "weight_scale"),
        torch.ones(2)), ["unexpected expert tensor", "weight_scale"]),
    "compressed-tensors NaN scale": ("ct", None, _set("experts.3.up_proj.weight_scale", _nan_last),
                                     ["experts.3.up_proj.weight_scale", "finite", "1 NaN/inf"]),
    "awq experts not converted": ("awq", {"modules_to_not_convert": ["mlp.experts"]}, None,
                                  ["experts are stored quantized", "leaves the experts unquantized"]),
    "awq gemv": ("awq", {"version": "gemv"}, None, ["quantization_config.version", "GEMM"]),
    "awq 8 bits": ("awq", {"bits": 8}, None, ["quantization_config.bits", "4 bits only"]),
    "awq no zero point": ("awq", {"zero_point": False}, None, ["quantization_config.zero_point"]),
    "awq inf scale": ("awq", None, _set("experts.2.down_proj.scales", lambda t: t * float("inf")),
                      ["experts.2.down_proj.scales", "finite"]),
    "awq up narrower than gate": ("awq", None, _set("up_proj.qweight", lambda t: t[:, :-1].contiguous(), every=True),
                                  ["experts.0.up_proj.qweight", "unexpected shape", "expected [256, 16], found [256, 15]"]),
    "gptq group_size disagrees with the scales": ("gptq4", {"group_size": 64}, None,
                                                  ["experts.0.gate_proj.qzeros", "expected [4, 16], found [8, 16]"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line_and_write_nothing(sources, tmp_path, case):
    name, config, tensors, phrases = REFUSALS[case]
    refused(edited(sources[name], tmp_path, config, tensors), tmp_path, *phrases)


def test_a_folder_moeconvert_wrote_is_refused_as_a_source(tmp_path):
    """inspect / repack / quantize read checkpoints; one of our own folders (its moeconvert.json) is named as such
    in one line, not reported as a family whose expert tensors are missing."""
    folder = tmp_path / "folder"
    cli("repack", AUTOROUND / "gptq-w4g32", folder, "--backend", "marlin", expect=0)
    code, _, err = cli("inspect", folder)
    assert code == 2 and err.count("\n") == 1 and "moeconvert.json: a folder moeconvert wrote is not a source" in err
    refused(folder, tmp_path, "moeconvert.json", "`moeconvert verify` checks it")


_ROUTERS = {f"model.layers.{i}.mlp.gate": {"bits": 16, "data_type": "fp"} for i in (0, 1)}
AUTO_ROUND_REFUSALS = {
    # name: (config edit of AutoRound's own GPTQ-packed checkpoint, phrases of the one line)
    "an extra_config entry for a MoE layer": ({"extra_config": {**_ROUTERS, "model.layers.1.mlp.experts": {"bits": 8}}},
                                              ["extra_config.model.layers.1.mlp.experts", "are not read"]),
    "an extra_config entry for one expert": ({"extra_config": {**_ROUTERS, "model.layers.0.mlp.experts.3.up_proj":
                                                               {"bits": 8}}},
                                             ["extra_config.model.layers.0.mlp.experts.3.up_proj", "are not read"]),
    "an extra_config regex matching experts": ({"extra_config": {**_ROUTERS, r".*down_proj$": {"bits": 8}}},
                                               ["extra_config..*down_proj$", "are not read"]),
    "FP8 packing": ({"packing_format": "auto_round:fp8"}, ["quantization_config.packing_format", "auto_round:fp8"]),
    "MX data type": ({"data_type": "mx_fp"}, ["quantization_config.data_type", "expected int"]),
    "asymmetric GPTQ packing": ({"sym": False}, ["quantization_config.sym", "MoeWNA16"]),
    "another packing's backend": ({"backend": "awq"}, ["quantization_config.backend", 'found "awq"']),
    "2 bits": ({"bits": 2}, ["quantization_config.bits", "4 or 8"]),
    "blocks that leave the packed experts out": ({"block_name_to_quantize": "model.visual"},
                                                 ["experts are stored quantized"]),
}


@pytest.mark.parametrize("case", list(AUTO_ROUND_REFUSALS))
def test_auto_round_refusals_are_one_line_and_write_nothing(tmp_path, case):
    config, phrases = AUTO_ROUND_REFUSALS[case]
    refused(edited(AUTOROUND / "auto-round-w4g32", tmp_path, config), tmp_path, *phrases)


def test_auto_round_entries_for_other_modules_leave_the_experts_as_they_are(tmp_path):
    """The routers' entries (AutoRound's own) and one for attention do not touch the experts: the same block."""
    src = edited(AUTOROUND / "auto-round-w4g32", tmp_path, {"extra_config": {
        **_ROUTERS, "model.layers.0.self_attn.o_proj": {"bits": 8}}, "block_name_to_quantize": ["model.layers"]})
    source = open_source(str(src))
    base = open_source(str(AUTOROUND / "auto-round-w4g32"))
    for ours, theirs in zip(map_model(source).layers, map_model(base).layers):
        assert decode_chunk(source, ours, Partition(), 0, 4).differences(
            decode_chunk(base, theirs, Partition(), 0, 4)) == []
