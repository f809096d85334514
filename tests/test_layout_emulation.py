"""The ``emulation`` layout: int4 experts dequantized to bf16, as vLLM 0.33.0's EMULATION backend holds them.

Proved by values worked out by hand (including a round-half-to-even tie and a negative zero), by a
float64 reference rounded once, by ``verify`` of a real repacked checkpoint plus an independent read of
its source with compressed-tensors' own unpacker and, where vLLM's source is at hand, by vLLM's own
``convert_to_wna16_moe_kernel_format`` (EMULATION branch, i.e. ``_process_weights_emulation_gptq``) on
the same compressed-tensors tensors.
"""

from __future__ import annotations

import functools
import json
import sys
import types
from enum import Enum

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts.emulation import EmulationLayout
from moeconvert.layouts.plain import PlainLayout
from moeconvert.schemes import FloatScheme, WNA16Scheme

from helpers import assert_lists_exactly, cli, st_tensors
from factories import wna16_block
from test_layout_triton import ct_params, lift_from_vllm, vllm_convert_wna16

LAYOUT = get_layout("emulation", "wna16")


def layer(E, H, I, dtype="bfloat16", bias=False):
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, dtype=dtype, has_bias=bias)


def bits_of(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int16).flatten().tolist()


# ---------------------------------------------------------------------------------------------------
# values by hand


def test_it_is_plain_bf16_under_another_name():
    assert isinstance(LAYOUT, EmulationLayout) and isinstance(LAYOUT, PlainLayout)
    shape = layer(2, 64, 32, bias=True)
    assert LAYOUT.plan(shape, WNA16Scheme(4, 32, False, "bfloat16")) == PlainLayout().plan(shape, FloatScheme("bfloat16"))


def test_symmetric_values_by_hand():
    H, I, g = 16, 8, 8
    block = wna16_block(1, H, I, 4, g, True)
    block.w13[0, 0] = torch.arange(16)  # q = u - 8 = -8 .. 7
    block.w13_scale[0, 0] = torch.tensor([0.5, 0.25])  # group 0: k < 8, group 1: k >= 8
    w13 = LAYOUT.encode(block, layer(1, H, I))["w13_weight"]
    assert w13.dtype == torch.bfloat16 and w13.shape == (1, 2 * I, H)
    assert w13[0, 0].tolist() == [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5,
                                  0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]


def test_the_product_is_rounded_once_to_nearest_even():
    H, I, g = 16, 8, 8
    block = wna16_block(1, H, I, 4, g, False)
    s = 1 + 2**-7  # exactly representable in bf16
    block.w2_scale[0, 2, 0] = s
    block.w2_zero[0, 2, 0] = 3
    block.w2[0, 2, :8] = torch.tensor([6, 8, 0, 3, 4, 3, 3, 3])  # q = 3, 5, -3, 0, 1, ...
    w2 = LAYOUT.encode(block, layer(1, H, I))["w2_weight"][0, 2, :5]
    # 3 * s = 3.0234375 lies halfway between bf16 3.015625 and 3.03125: to even, 3.03125
    # 5 * s = 5.0390625 -> 5.03125 (below half);  -3 * s -> -3.03125;  0 * s = +0;  1 * s = s
    assert w2.tolist() == [3.03125, 5.03125, -3.03125, 0.0, s]
    assert not torch.signbit(w2[3])


def test_negative_scale_gives_negative_zero_like_the_ieee_product():
    H, I = 16, 8
    block = wna16_block(1, H, I, 4, 8, True)
    block.w13[0, 1, 0] = 8  # q = 0
    block.w13_scale[0, 1, 0] = -0.01
    w = LAYOUT.encode(block, layer(1, H, I))["w13_weight"][0, 1, 0]
    assert w.item() == 0.0 and torch.signbit(w)


def reference(block: ExpertBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (u - z) * s, exact for 4-bit codes and bf16 scales, then one rounding to bf16."""
    s = block.scheme

    def one(u, sc, z):
        K = u.shape[2]
        cols = torch.arange(K) // s.group_size
        zz = z[:, :, cols].double() if z is not None else 8.0
        return ((u.double() - zz) * sc.to(torch.bfloat16).double()[:, :, cols]).to(torch.bfloat16)

    return one(block.w13, block.w13_scale, block.w13_zero), one(block.w2, block.w2_scale, block.w2_zero)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("g", [8, 32, 128])
@pytest.mark.parametrize("E", [1, 3])
def test_equals_a_float64_reference_rounded_once(sym, g, E):
    H, I = 256, 128
    block = wna16_block(E, H, I, 4, g, sym, seed=g + E)
    t = LAYOUT.encode(block, layer(E, H, I))
    r13, r2 = reference(block)
    assert bits_of(t["w13_weight"]) == bits_of(r13)
    assert bits_of(t["w2_weight"]) == bits_of(r2)


def test_float32_scales_are_cast_like_the_loader_first():
    block = wna16_block(2, 64, 32, 4, 32, True, scale_dtype="float32", seed=4)
    block.w13_scale[0, 0, 0] = 1 + 2**-8  # the loader's copy_ rounds to bf16 1.0 (tie to even)
    block.w13[0, 0, 0] = 15  # q = 7
    t = LAYOUT.encode(block, layer(2, 64, 32))
    assert t["w13_weight"][0, 0, 0].item() == 7.0


# ---------------------------------------------------------------------------------------------------
# bias, check (decode == expected_block, the plan, chunks and refusals: tests/test_layout_contract.py)


@pytest.mark.parametrize("sym", [True, False])
def test_biases_are_the_loaders_bf16_values_and_decode_gives_the_reference(sym):
    shape = layer(3, 128, 64, bias=True)
    block = wna16_block(3, 128, 64, 4, 32, sym, seed=2)
    block.w13_bias = torch.randn(3, 128, dtype=torch.float32)
    block.w2_bias = torch.randn(3, 128, dtype=torch.float32)
    tensors = LAYOUT.encode(block, shape)
    # biases: the loader's bf16 values, untouched by the emulation
    assert torch.equal(tensors["w2_bias"], block.w2_bias.to(torch.bfloat16))
    r13, _ = reference(block)
    assert bits_of(LAYOUT.decode(tensors, shape, block.scheme).w13) == bits_of(r13)


def test_check_reports_every_violated_constraint_at_once():
    problems = LAYOUT.check(layer(1000, 100, 36, dtype="float16"), WNA16Scheme(8, 48, True, "float16"))
    assert_lists_exactly(problems, [
        "bits = 8", "hidden_size H = 100 must be divisible by group_size 48",
        "intermediate_size I = 36 (per TP partition) must be divisible by group_size 48",
        "hidden_size H = 100 must be a multiple of 8",
        "intermediate_size I (per TP partition) = 36 must be a multiple of 8", "model dtype = float16", "1000 experts"])
    (channel,) = LAYOUT.check(layer(2, 128, 64), WNA16Scheme(4, -1, True, "bfloat16"))
    assert "channelwise" in channel
    assert LAYOUT.check(layer(2, 128, 64, bias=True), WNA16Scheme(4, 32, False, "bfloat16")) == []


# ---------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.parametrize("group_size,symmetric", [(32, False), (128, True)])
def test_repack_and_verify_a_compressed_tensors_checkpoint(example_ckpt, tmp_path, group_size, symmetric):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src = example_ckpt("qwen3-moe", "w4a16", group_size=group_size, symmetric=symmetric, num_experts=4)
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "emulation", "--verify", expect=0)
    cli("verify", out, "--against", src, expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    s, o = st_tensors(src), st_tensors(out)
    lay = manifest["moe_layers"][0]
    p, I, H = lay["prefix"], lay["intermediate_size"], lay["hidden_size"]
    for e in range(lay["num_experts"]):
        # compressed-tensors' own unpacker on the source tensors, then float64 and one rounding
        q = unpack_from_int32(s[f"{p}.{e}.up_proj.weight_packed"], 4, torch.Size([I, H]), packed_dim=1).double()
        if not symmetric:
            zp = unpack_from_int32(s[f"{p}.{e}.up_proj.weight_zero_point"], 4,
                                   torch.Size([I, H // group_size]), packed_dim=0)
            q = q - zp.double().repeat_interleave(group_size, 1)
        scale = s[f"{p}.{e}.up_proj.weight_scale"].to(torch.bfloat16).double().repeat_interleave(group_size, 1)
        up = o[f"{p}.w13_weight"][e, I:]
        assert bits_of(up) == bits_of((q * scale).to(torch.bfloat16))
    assert f"{p}.w13_weight_scale" not in o and f"{p}.w13_weight_zero_point" not in o


def test_repack_refuses_int8(example_ckpt, tmp_path):
    src = example_ckpt("qwen3-moe", "w8a16", group_size=64, symmetric=True, num_experts=4)
    assert "int4 only" in cli("repack", src, tmp_path / "out", "--backend", "emulation", expect=2).err


# ---------------------------------------------------------------------------------------------------
# Oracle: each vLLM version's EMULATION branch


@functools.lru_cache(maxsize=None)
def vllm_emulation(version: str):
    ns = lift_from_vllm(version, "model_executor/layers/fused_moe/oracle/int_wna16.py",
                        ["WNA16MoEBackend", "_unpack_and_dequant_int4_gptq", "_process_weights_emulation_gptq",
                         "convert_to_wna16_moe_kernel_format"], {"torch": torch, "Enum": Enum})
    return types.SimpleNamespace(**ns)


def _stub_auto_awq(monkeypatch):
    """The EMULATION branch imports vLLM's AutoAWQConfig only to tell AWQ apart: a stand-in class does."""
    names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.quantization",
             "vllm.model_executor.layers.quantization.auto_awq"]
    for name in names:
        mod = types.ModuleType(name)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules[names[-1]].AutoAWQConfig = type("AutoAWQConfig", (), {})


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("g,H,I,E", [(32, 128, 64, 1), (128, 256, 128, 3), (16, 128, 384, 2)])
def test_bytes_equal_vllm_emulation_branch(monkeypatch, sym, g, H, I, E, vllm_version):
    ref = vllm_emulation(vllm_version)
    _stub_auto_awq(monkeypatch)
    shape, block = layer(E, H, I), wna16_block(E, H, I, 4, g, sym, seed=31 + g + E)
    ours = LAYOUT.encode(block, shape)
    p = ct_params(block, torch.bfloat16)
    out = vllm_convert_wna16(ref, ref.WNA16MoEBackend.EMULATION, p)
    w13, w2, s13, s2, z13, z2, b13, b2 = (out[k] for k in ("w13", "w2", "s13", "s2", "z13", "z2", "b13", "b2"))
    assert z13 is None and z2 is None and b13 is None and b2 is None
    assert s13.numel() == 1 and s2.numel() == 1  # dummies no kernel reads
    for name, theirs in (("w13_weight", w13), ("w2_weight", w2)):
        assert ours[name].dtype == theirs.dtype == torch.bfloat16 and ours[name].shape == theirs.shape, name
        assert bits_of(ours[name]) == bits_of(theirs), name
