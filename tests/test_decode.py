"""Decoding compressed-tensors experts to the canonical block gives exactly the integers, zero points
and scales compressed-tensors' own decompressor gives, and its dequantized weights."""

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig

from moeconvert.canonical import Partition
from moeconvert.decode import decode_chunk
from moeconvert.example import make_example
from moeconvert.modelmap import map_model
from moeconvert.sources import open_source


@pytest.mark.parametrize("family,scheme,group_size,symmetric", [
    ("qwen3-moe", "w4a16", 128, True), ("qwen3-moe", "w4a16", 32, False), ("mixtral", "w4a16", -1, False),
    ("deepseek-v3", "w8a16", 64, True), ("qwen2-moe", "w8a16", -1, False),
])
def test_canonical_equals_compressed_tensors(tmp_path, family, scheme, group_size, symmetric):
    src_dir = make_example(tmp_path / "ckpt", family, scheme, group_size=group_size, symmetric=symmetric,
                           num_experts=4)
    source = open_source(str(src_dir))
    model = map_model(source)
    ct_scheme = QuantizationConfig.model_validate(
        json.loads((src_dir / "config.json").read_text())["quantization_config"]).config_groups["group_0"]
    bits = ct_scheme.weights.num_bits
    offset = 1 << (bits - 1)
    for layer in model.layers:
        block = decode_chunk(source, layer, Partition(), 0, layer.num_experts)
        I = layer.intermediate_size
        for e in range(layer.num_experts):
            for role, (codes, scale, zero, rows) in {
                "gate": (block.w13, block.w13_scale, block.w13_zero, slice(0, I)),
                "up": (block.w13, block.w13_scale, block.w13_zero, slice(I, 2 * I)),
                "down": (block.w2, block.w2_scale, block.w2_zero, slice(None)),
            }.items():
                names = layer.experts[e][role]
                state = {k: source.read(n) for k, n in names.items()}
                shape = torch.Size(state["weight_shape"].tolist())
                theirs_q = unpack_from_int32(state["weight_packed"], bits, shape)
                assert torch.equal(codes[e, rows].to(torch.int16) - offset, theirs_q.to(torch.int16))
                assert torch.equal(scale[e, rows], state["weight_scale"])
                theirs = PackedQuantizationCompressor.decompress(dict(state), ct_scheme)
                if symmetric:
                    assert zero is None
                    ours = (codes[e, rows].float() - offset)
                else:
                    zp = unpack_from_int32(state["weight_zero_point"], bits,
                                           (shape[0], state["weight_scale"].shape[1]), packed_dim=0)
                    assert torch.equal(zero[e, rows].to(torch.int16) - offset, zp.to(torch.int16))
                    g = shape[1] // zero.shape[2]
                    ours = codes[e, rows].float() - zero[e, rows].float().repeat_interleave(g, 1)
                g = shape[1] // scale.shape[2]
                ours = ours * scale[e, rows].float().repeat_interleave(g, 1)
                assert torch.equal(ours.to(theirs["weight"].dtype), theirs["weight"]), (layer.prefix, e, role)
