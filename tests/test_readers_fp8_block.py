"""FP8 checkpoints with 128x128 block scales (moeconvert/readers/fp8_block.py): dequantized as transformers'
own ``Fp8Dequantize`` (and DeepSeek's ``fp8_cast_bf16``) does, then quantized to MXFP4 as vLLM quantizes
bf16 experts online. The checkpoint is DeepSeek-V3's format, made by transformers' ``Fp8Quantize``
(``moeconvert.example``).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moeconvert.canonical import Partition
from moeconvert.decode import decode_chunk
from moeconvert.modelmap import map_model
from moeconvert.mxfp4 import quantize_mxfp4
from moeconvert.readers.fp8_block import dequantize_fp8_block
from moeconvert.schemes import FloatScheme
from moeconvert.sources import open_source

from helpers import assert_refused, cli, damaged_copy, same_bits, st_tensors

E = 4


@pytest.fixture
def fp8(example_ckpt):
    return example_ckpt("deepseek-v3", "fp8-block", num_experts=E)


def transformers_dequantized(tensors: dict, module: str) -> torch.Tensor:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    quantizer = type("Quantizer", (), {"quantization_config": FineGrainedFP8Config(weight_block_size=(128, 128))})()
    return Fp8Dequantize(quantizer)._dequantize_one(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"],
                                                    torch.bfloat16)


def test_experts_dequantize_as_transformers_does(fp8):
    source = open_source(str(fp8))
    tensors = load_file(fp8 / "model.safetensors")
    layer = map_model(source).layers[0]
    assert layer.scheme == FloatScheme("bfloat16")
    block = decode_chunk(source, layer, Partition(), 0, E)
    for e in range(E):
        ref = {p: transformers_dequantized(tensors, f"{layer.prefix}.{e}.{p}") for p in ("gate_proj", "up_proj", "down_proj")}
        assert same_bits(block.w13[e], torch.cat([ref["gate_proj"], ref["up_proj"]]))
        assert same_bits(block.w2[e], ref["down_proj"])


def test_partial_blocks_take_the_scale_of_the_block_they_are_in():
    """Sizes that are not multiples of 128 (the last blocks partial, as in DeepSeek's own dequantization)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 130, 200
    w = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, generator=gen) + 0.5
    out = dequantize_fp8_block(w, s)
    for i, j in ((0, 0), (127, 127), (128, 0), (129, 199), (5, 150)):
        assert same_bits(out[i, j], (w[i, j].float() * s[i // 128, j // 128]).to(torch.bfloat16)), (i, j)


def test_quantize_to_mxfp4_is_vllms_online_quantization_of_the_dequantized_experts(fp8, tmp_path):
    out = tmp_path / "out"
    cli("quantize", fp8, out, "--format", "mxfp4", "--backend", "plain", expect=0)
    written, tensors = st_tensors(out), load_file(fp8 / "model.safetensors")
    prefix = "model.layers.1.mlp.experts"
    w13 = torch.stack([torch.cat([transformers_dequantized(tensors, f"{prefix}.{e}.{p}") for p in ("gate_proj", "up_proj")])
                       for e in range(E)])
    packed, scales = quantize_mxfp4(w13)
    assert same_bits(written[f"{prefix}.w13_weight"], packed)
    assert same_bits(written[f"{prefix}.w13_weight_scale"].view(torch.uint8), scales)


EXPERT = "model.layers.2.mlp.experts.1"


def _copy(fp8, tmp_path, replace=None, config=None):
    return damaged_copy(fp8, tmp_path, replace=replace, quantization_config=config)


def _nan_scale(t):
    s = t[f"{EXPERT}.up_proj.weight_scale_inv"].clone()
    s[0, 1] = float("inf")
    return {f"{EXPERT}.up_proj.weight_scale_inv": s}


REFUSALS = [
    (dict(replace=_nan_scale), ["FP8 block scales must be finite", f"{EXPERT}.up_proj.weight_scale_inv"]),
    (dict(config=lambda q: q.update(weight_block_size=[64, 64])),
     ["only 128x128 block scales", "quantization_config.weight_block_size", "[64, 64]"]),
    # experts vLLM leaves unquantized (exact name in ignored_layers) must then be float weights
    (dict(config=lambda q: q.update(ignored_layers=["model.layers.1.mlp.experts"])),
     ["model.layers.1.mlp.experts.0.gate_proj.weight", "expected BF16, F16 or F32", "F8_E4M3"]),
    (dict(config=lambda q: q.update(activation_scheme="static")),
     ["block-wise FP8 takes dynamic activations only", "quantization_config.activation_scheme", "static"]),
    (dict(replace=lambda t: {n: t[n][:, :1].contiguous() for n in t if n.endswith("proj.weight_scale_inv")
                             and ".experts." in n and n.endswith("gate_proj.weight_scale_inv")}),
     ["unexpected shape", "gate_proj.weight_scale_inv", "[1, 2]"]),
    (dict(replace=lambda t: {f"{EXPERT}.down_proj.weight": t[f"{EXPERT}.down_proj.weight"].bfloat16()}),
     ["expert tensors disagree across experts", f"{EXPERT}.down_proj.weight"]),
]


@pytest.mark.parametrize("damage,phrases", REFUSALS, ids=["inf-scale", "block-64", "ignored", "static", "scale-shape", "weight-dtype"])
def test_bad_fp8_checkpoints_are_refused_in_one_line(damage, phrases, fp8, tmp_path):
    assert_refused(_copy(fp8, tmp_path, **damage), tmp_path / "out", *phrases)


def test_inspect_names_the_format_and_scheme(fp8):
    report = json.loads(cli("inspect", fp8, "--json", expect=0).out)
    assert report["format"] == "fp8"
    assert {(x["format"], x["scheme"]) for x in report["moe_layers"]} == {("fp8", "bfloat16")}
