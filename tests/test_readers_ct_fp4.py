"""compressed-tensors ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized`` experts read into the canonical
MXFP4 / NVFP4 blocks (moeconvert/readers/ct_fp4.py), against compressed-tensors itself: its
``MXFP4PackedCompressor`` / ``NVFP4PackedCompressor`` made the checkpoints (``moeconvert.example``) and
their ``decompress`` is the oracle of what the stored values mean.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from moeconvert.canonical import Partition
from moeconvert.decode import decode_chunk
from moeconvert.modelmap import map_model
from moeconvert.mxfp4 import dequantize_mxfp4, dequantize_nvfp4
from moeconvert.schemes import MXFP4Scheme, NVFP4Scheme
from moeconvert.sources import open_source

from helpers import AUTOROUND, assert_refused, cli, damaged_copy, resave, same_bits, st_tensors

pytest.importorskip("compressed_tensors")
E, H, I = 4, 256, 128
SCHEMES = {"mxfp4": ("MXFP4", MXFP4Scheme()), "nvfp4": ("NVFP4", NVFP4Scheme())}


@pytest.fixture(params=list(SCHEMES))
def fp4(request, example_ckpt):
    return request.param, example_ckpt("qwen3-moe", request.param, num_layers=2, num_experts=E)


def ct_decompressed(ckpt, scheme: str, module: str) -> torch.Tensor:
    """compressed-tensors' own dequantization of one Linear of the checkpoint."""
    from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    tensors = load_file(ckpt / "model.safetensors")
    state = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
    compressor = MXFP4PackedCompressor if scheme == "mxfp4" else NVFP4PackedCompressor
    return compressor.decompress(state, preset_name_to_scheme(SCHEMES[scheme][0], ["Linear"]))["weight"]


def our_dequantized(block, e: int, which: str) -> torch.Tensor:
    """The canonical block's value of expert ``e``'s w13 or w2, in fp32."""
    packed, scales = getattr(block, which)[e], getattr(block, which + "_scale")[e]
    if isinstance(block.scheme, MXFP4Scheme):
        return dequantize_mxfp4(packed, scales)
    glob = getattr(block, which + "_global")[e]
    return dequantize_nvfp4(packed, scales, (glob.repeat_interleave(packed.shape[0] // 2) if which == "w13"
                                             else glob.expand(packed.shape[0])).unsqueeze(-1))


def test_the_block_is_what_compressed_tensors_decompresses(fp4):
    """Codes and scales as stored (nibble order, e8m0 bytes), and the dequantized values compressed-tensors
    gets: equal for MXFP4 (powers of two), within bf16 rounding for NVFP4 (compressed-tensors divides the
    scale by the global scale, the block multiplies by its reciprocal, as vLLM does)."""
    name, ckpt = fp4
    source = open_source(str(ckpt))
    layer = map_model(source).layers[0]
    assert layer.scheme == SCHEMES[name][1]
    block = decode_chunk(source, layer, Partition(), 0, E)
    if name == "nvfp4":  # the example gives gate and up one global scale, as llm-compressor does
        assert torch.equal(block.w13_global[:, 0], block.w13_global[:, 1])
    for e in range(E):
        theirs = {proj: ct_decompressed(ckpt, name, f"{layer.prefix}.{e}.{proj}").float()
                  for proj in ("gate_proj", "up_proj", "down_proj")}
        for which, ref in (("w13", torch.cat([theirs["gate_proj"], theirs["up_proj"]])), ("w2", theirs["down_proj"])):
            ours = our_dequantized(block, e, which)
            if name == "mxfp4":
                assert same_bits(ours.bfloat16(), ref.bfloat16()), (e, which)
            else:
                assert torch.allclose(ours, ref, rtol=2 ** -7, atol=0), (e, which)
                assert bool((ours != 0).any())


def test_a_tp_rank_holds_its_rows_and_k_columns(fp4):
    """TP 2, rank 1: gate and up rows [I/2, I), down's K columns [I/2, I) with their scale groups, global
    scales whole: the values of compressed-tensors' weights there."""
    name, ckpt = fp4
    source = open_source(str(ckpt))
    layer = map_model(source).layers[1]
    whole = decode_chunk(source, layer, Partition(), 0, E)
    rank = decode_chunk(source, layer, Partition(tp_size=2, tp_rank=1), 1, 3)
    h = I // 2
    for i, e in enumerate((1, 2)):
        w13 = our_dequantized(whole, e, "w13")
        assert torch.equal(our_dequantized(rank, i, "w13"), torch.cat([w13[h:I], w13[I + h:]]))
        assert torch.equal(our_dequantized(rank, i, "w2"), our_dequantized(whole, e, "w2")[:, h:])


def vllm_marlin_of(name: str, ckpt, prefix: str, version: str) -> dict[str, torch.Tensor]:
    """What vLLM ``version`` holds for one layer of the checkpoint: the tensors its loader puts in place
    (w13 = [gate; up] per expert, global scales per shard) through the compressed-tensors FP4 methods'
    Marlin paths, run on the CPU (tests/test_layout_marlin_*fp4.py say how)."""
    import types

    import test_layout_marlin_mxfp4
    import test_layout_marlin_nvfp4

    tensors = load_file(ckpt / "model.safetensors")
    E = 1 + max(int(n[len(prefix) + 1:].split(".")[0]) for n in tensors if n.startswith(prefix + "."))
    stack = lambda proj, suffix: torch.stack([tensors[f"{prefix}.{e}.{proj}.{suffix}"] for e in range(E)])
    I, H = stack("gate_proj", "weight_packed").shape[1], stack("down_proj", "weight_packed").shape[1]
    w13 = torch.cat([stack("gate_proj", "weight_packed"), stack("up_proj", "weight_packed")], 1)
    s13 = torch.cat([stack("gate_proj", "weight_scale"), stack("up_proj", "weight_scale")], 1)
    w2, s2 = stack("down_proj", "weight_packed"), stack("down_proj", "weight_scale")
    if name == "nvfp4":
        ref = test_layout_marlin_nvfp4.vllm_reference(version)
        g13 = torch.cat([stack("gate_proj", "weight_global_scale"), stack("up_proj", "weight_global_scale")], 1)
        stub = types.SimpleNamespace(num_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                                     params_dtype=torch.bfloat16)
        return dict(zip(("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                         "w2_weight_scale_2"), ref.prepare_nvfp4_moe_layer_for_marlin(
            stub, w13=w13, w13_scale=s13, w13_scale_2=1.0 / g13[:, 0].contiguous(), w2=w2, w2_scale=s2,
            w2_scale_2=1.0 / stack("down_proj", "weight_global_scale").flatten(), is_act_and_mul=True)))
    ref = test_layout_marlin_mxfp4.vllm_reference(version)
    stub = types.SimpleNamespace(
        moe_config=types.SimpleNamespace(num_local_experts=E, hidden_dim=H, intermediate_size_per_partition=I),
        params_dtype=torch.bfloat16, w13_weight=w13, w2_weight=w2, w13_weight_scale=s13, w2_weight_scale=s2)
    ref.prepare_moe_fp4_layer_for_marlin(stub)
    return {n: getattr(stub, n) for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")}


def assert_marlin_folder_is_vllms(name: str, ckpt, tmp_path, version: str, verify: bool = False) -> None:
    out = tmp_path / "out"
    cli("repack", ckpt, out, "--backend", "marlin", expect=0)
    if verify:  # decodes with the layer facts the manifest recorded
        cli("verify", out, "--against", ckpt, expect=0)
    written = st_tensors(out)
    for prefix in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        ours = {n.removeprefix(prefix + "."): t for n, t in written.items() if n.startswith(prefix + ".")}
        theirs = vllm_marlin_of(name, ckpt, prefix, version)
        assert set(ours) == set(theirs)
        for n in theirs:
            assert same_bits(ours[n], theirs[n]), (prefix, n)


def test_the_marlin_folder_is_what_vllm_holds_for_the_checkpoint(fp4, tmp_path, vllm_version):
    name, ckpt = fp4
    assert_marlin_folder_is_vllms(name, ckpt, tmp_path, vllm_version)


#: llm-compressor's own checkpoints (tests/data/llm-compressor/make.py): its MXFP4A16, NVFP4A16 and NVFP4 (W4A4)
#: presets, the experts linearized by llm-compressor's own ``linearize_moe``
LLM_COMPRESSOR = {"mxfp4a16": "mxfp4", "nvfp4a16": "nvfp4", "nvfp4": "nvfp4"}


@pytest.mark.parametrize("name", list(LLM_COMPRESSOR))
def test_llm_compressor_checkpoints_are_read_and_repacked_as_vllm_holds_them(name, tmp_path, vllm_version):
    """What llm-compressor 0.14.0.1 writes: its config says so, every expert is quantized per expert, inspect
    reads each layer's scheme, and the marlin folder is byte for byte what vLLM holds after processing it."""
    ckpt = AUTOROUND.parent / "llm-compressor" / name
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    scheme = LLM_COMPRESSOR[name]
    assert qc["config_groups"]["group_0"]["format"] == f"{scheme}-pack-quantized"
    assert (qc["config_groups"]["group_0"]["input_activations"] is not None) == (name == "nvfp4")
    assert "model.layers.0.mlp.gate" in qc["ignore"]
    report = json.loads(cli("inspect", ckpt, "--json", expect=0).out)
    assert [(x["format"], x["scheme"]) for x in report["moe_layers"]] == [(f"{scheme}-pack-quantized", scheme)] * 2
    if scheme == "mxfp4":
        # H = 128: vLLM's compressed-tensors MXFP4 method repacks it for Marlin unpadded (no MXFP4 round-up,
        # which the oracle follows: w13 as Marlin tiles of K = H = 128, [E, H / 16, 2I * 16 / 8] words); the
        # layout pads H to 256, so it refuses rather than write other bytes than vLLM holds
        theirs = vllm_marlin_of("mxfp4", ckpt, "model.layers.0.mlp.experts", vllm_version)
        assert list(theirs["w13_weight"].shape) == [4, 128 // 16, 2 * 128 * 16 // 8]
        code, _, err = cli("repack", ckpt, tmp_path / "out", "--backend", "marlin")
        assert code == 2 and err.count("\n") == 1 and "vLLM 0.33.0 and 0.34.0 repack them for Marlin unpadded" in err
        assert not (tmp_path / "out").exists()
        return
    assert_marlin_folder_is_vllms(scheme, ckpt, tmp_path, vllm_version, verify=True)


def test_nvfp4_scales_below_224_are_rescaled_as_vllm_does_over_the_whole_layer(example_ckpt, tmp_path, vllm_version):
    """Layer 1's scales quartered (its global scales too, so the values stay): vLLM then multiplies that
    layer's scales by 4 (``_nvfp4_compute_scale_factor`` over all its experts), layer 0's by 1."""
    src = tmp_path / "src"
    shutil.copytree(example_ckpt("qwen3-moe", "nvfp4", num_layers=2, num_experts=E), src)
    t = load_file(src / "model.safetensors")
    quarter = {n: (v.float() / 4).to(torch.float8_e4m3fn) for n, v in t.items()
               if n.startswith("model.layers.1.mlp.experts.") and n.endswith(".weight_scale")}
    quarter.update({n: v * 4 for n, v in t.items()
                    if n.startswith("model.layers.1.mlp.experts.") and n.endswith(".weight_global_scale")})
    resave(src, replace=quarter)
    assert_marlin_folder_is_vllms("nvfp4", src, tmp_path, vllm_version, verify=True)
    meta = json.loads((tmp_path / "out" / "moeconvert.json").read_text())["moe_layers"]
    assert [m["layout_metadata"]["w13"]["scale_factor"] for m in meta] == [1, 4]


def test_the_runtime_runs_a_marlin_nvfp4_folder_as_the_checkpoint_computes(example_ckpt, tmp_path):
    """``moeconvert.runtime.load`` of the folder (the PyTorch reference on CPU) against the MoE computed from
    compressed-tensors' own dequantization of the checkpoint (in fp32; its weights are bf16)."""
    from moeconvert.runtime import load

    ckpt = example_ckpt("qwen3-moe", "nvfp4", num_layers=2, num_experts=E)
    out = tmp_path / "out"
    cli("repack", ckpt, out, "--backend", "marlin", expect=0)
    with pytest.warns(Warning, match="PyTorch reference"):
        layer = load(out, device="cpu").moe_layers["model.layers.0.mlp.experts"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=gen).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [2, 1]])
    weights = torch.rand(5, 2, generator=gen)
    ref = torch.zeros(5, H)
    for t in range(5):
        for j in range(2):
            w = {p: ct_decompressed(ckpt, "nvfp4", f"model.layers.0.mlp.experts.{int(ids[t, j])}.{p}").float()
                 for p in ("gate_proj", "up_proj", "down_proj")}
            xt = x[t].float()
            a = torch.nn.functional.silu(w["gate_proj"] @ xt) * (w["up_proj"] @ xt)
            ref[t] += weights[t, j] * (w["down_proj"] @ a)
    got = layer(x, weights, ids).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def _damaged(ckpt, tmp_path, edit_tensors=None, edit_config=None):
    group = (lambda qc: edit_config(qc["config_groups"]["group_0"])) if edit_config else None
    return damaged_copy(ckpt, tmp_path, replace=edit_tensors, quantization_config=group)


EXPERT = "model.layers.1.mlp.experts.2"


def _set(name, fn):
    return lambda t: {name: fn(t[name].clone())}


def _byte(value):
    def edit(t):
        t.view(torch.uint8)[3, 1] = value
        return t
    return edit


REFUSALS = [
    ("mxfp4", dict(edit_tensors=_set(f"{EXPERT}.up_proj.weight_scale", _byte(255))),
     ["NaN MXFP4 scale", f"{EXPERT}.up_proj.weight_scale"]),
    ("nvfp4", dict(edit_tensors=_set(f"{EXPERT}.down_proj.weight_scale", _byte(0x7F))),
     ["NaN NVFP4 scale", f"{EXPERT}.down_proj.weight_scale"]),
    ("nvfp4", dict(edit_tensors=_set(f"{EXPERT}.down_proj.weight_scale", _byte(0xB0))),
     ["negative NVFP4 scale", f"{EXPERT}.down_proj.weight_scale"]),
    ("nvfp4", dict(edit_tensors=_set(f"{EXPERT}.gate_proj.weight_global_scale", lambda t: t * 0)),
     ["global scale must be finite and positive", f"{EXPERT}.gate_proj.weight_global_scale"]),
    ("nvfp4", dict(edit_tensors=_set(f"{EXPERT}.up_proj.weight_global_scale", lambda t: t * float("inf"))),
     ["global scale must be finite and positive", f"{EXPERT}.up_proj.weight_global_scale", "found inf"]),
    ("nvfp4", dict(edit_tensors=lambda t: {n: v.bfloat16() for n, v in t.items() if n.endswith("proj.weight_scale")}),
     ["unexpected dtype", "weight_scale", "F8_E4M3", "BF16"]),
    ("mxfp4", dict(edit_tensors=_set(f"{EXPERT}.down_proj.weight_scale", lambda t: t[:, :2].contiguous())),
     ["expert tensors disagree across experts", f"{EXPERT}.down_proj.weight_scale"]),
    ("mxfp4", dict(edit_config=lambda g: g["weights"].update(group_size=16)),
     ["not an mxfp4-pack-quantized weight scheme", "group_size = 16", "config_groups.group_0.weights"]),
    ("nvfp4", dict(edit_config=lambda g: g.update(input_activations={"num_bits": 8, "type": "float"})),
     ["NVFP4 input activations or none", "config_groups.group_0.input_activations"]),
]


@pytest.mark.parametrize("scheme,damage,phrases", REFUSALS, ids=[p[0] for _, _, p in REFUSALS])
def test_bad_fp4_checkpoints_are_refused_in_one_line(scheme, damage, phrases, example_ckpt, tmp_path):
    src = _damaged(example_ckpt("qwen3-moe", scheme, num_layers=2, num_experts=E), tmp_path, **damage)
    assert_refused(src, tmp_path / "out", *phrases, backend="marlin")


def test_inspect_names_the_format_and_scheme(fp4):
    name, ckpt = fp4
    report = json.loads(cli("inspect", ckpt, "--json", expect=0).out)
    assert report["format"] == f"compressed-tensors ({name}-pack-quantized)"
    assert {(x["format"], x["scheme"]) for x in report["moe_layers"]} == {(f"{name}-pack-quantized", name)}
