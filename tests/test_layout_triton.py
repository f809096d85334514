"""The ``triton`` layout: what vLLM 0.33.0's Triton WNA16 MoE kernel reads (docs/layouts/triton.md).

Proved four ways: bytes written out by hand from the spec's rules (§1.3 words, §5 nibble order),
the checkpoint's own int32 words read as bytes (packed by compressed-tensors itself), an end-to-end
repack + verify of real checkpoints and, where vLLM's source is at hand (MOECONVERT_VLLM_SRC or an
installed vllm), vLLM's own ``convert_to_wna16_moe_kernel_format`` TRITON branch run on the same
compressed-tensors tensors. What every layout owes (decode(encode(x)) == x on every config ``check``
accepts, plan == what encode writes, streaming by chunks, refusals) is tests/test_layout_contract.py.
"""

from __future__ import annotations

import functools
import inspect
import json
import types
from enum import Enum

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts.triton_wna16 import TritonWNA16Layout, pack_bytes, unpack_bytes
from moeconvert.schemes import WNA16Scheme

from helpers import assert_lists_exactly, cli, lift, st_tensors, vllm_reader
from factories import wna16_block

LAYOUT = get_layout("triton", "wna16")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SCHEMES = [(4, True), (4, False), (8, True)]


def layer(E, H, I, dtype="bfloat16", bias=False):
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, dtype=dtype, has_bias=bias)


def hex_bytes(t: torch.Tensor) -> str:
    return " ".join(f"{int(x):02x}" for x in t.flatten())


# ---------------------------------------------------------------------------------------------------
# bytes by hand (spec §1.3 table, §5)


def test_it_is_the_layout_behind_backend_triton():
    assert isinstance(LAYOUT, TritonWNA16Layout) and LAYOUT.made_for == {"vllm": ["0.33.0", "0.34.0"]}


@pytest.mark.parametrize("signed,expected", [
    # CT words 0x76543210 0xfedcba98 -> their little-endian bytes
    (list(range(-8, 8)), "10 32 54 76 98 ba dc fe"),
    # CT words 0x89abcdef 0x01234567
    (list(range(7, -9, -1)), "ef cd ab 89 67 45 23 01"),
], ids=["ascending", "descending"])
def test_int4_weight_row_is_the_ct_words_little_endian(signed, expected):
    H, I, g = 16, 8, 8
    block = wna16_block(1, H, I, 4, g, True)
    block.w13[0, 5] = torch.tensor(signed) + 8  # unsigned fields u = q + 8
    t = LAYOUT.encode(block, layer(1, H, I))
    assert t["w13_weight"].dtype == torch.uint8 and t["w13_weight"].shape == (1, 2 * I, H // 2)
    assert hex_bytes(t["w13_weight"][0, 5]) == expected


def test_int4_byte_holds_even_k_low_odd_k_high():
    H, I = 16, 8
    block = wna16_block(1, H, I, 4, 8, True)
    block.w2[0, 3] = torch.tensor([0x1, 0xA, 0x2, 0xB, 0x3, 0xC, 0x4, 0xD])  # k = 0..7 of w2 row n = 3
    t = LAYOUT.encode(block, layer(1, H, I))
    assert hex_bytes(t["w2_weight"][0, 3]) == "a1 b2 c3 d4"


def test_int8_weight_row_is_the_ct_words_little_endian():
    # CT int8 row [-128, -1, 0, 127, 1, 2, 3, 4] -> words 0xff807f00 0x84838281
    H, I = 8, 8
    block = wna16_block(1, H, I, 8, 8, True)
    block.w13[0, 0] = torch.tensor([-128, -1, 0, 127, 1, 2, 3, 4]) + 128
    t = LAYOUT.encode(block, layer(1, H, I))
    assert t["w13_weight"].shape == (1, 2 * I, H)
    assert hex_bytes(t["w13_weight"][0, 0]) == "00 7f 80 ff 81 82 83 84"


def test_zero_points_lie_along_n_two_channels_a_byte():
    # spec §1.3: zp[n] = n - 8 for N = 16 rows, G = 2 -> CT words 0x76543210, 0xfedcba98 (per group column);
    # §5: row r of the Triton tensor holds n = 2r (low nibble) and n = 2r + 1 (high nibble)
    H, I, g = 16, 8, 8  # w13: N = 2I = 16, G13 = H/g = 2
    block = wna16_block(1, H, I, 4, g, False)
    block.w13_zero[0] = (torch.arange(16).view(16, 1) + torch.tensor([0, 5]).view(1, 2)) % 16  # group 1 shifted
    t = LAYOUT.encode(block, layer(1, H, I))
    z = t["w13_weight_zero_point"]
    assert z.dtype == torch.uint8 and z.shape == (1, 8, 2)
    assert hex_bytes(z[0, :, 0]) == "10 32 54 76 98 ba dc fe"
    assert hex_bytes(z[0, :, 1]) == "65 87 a9 cb ed 0f 21 43"


def test_scales_keep_the_n_first_shape_and_cast_to_the_model_dtype_with_rne():
    H, I, g = 64, 32, 32
    block = wna16_block(2, H, I, 4, g, True, scale_dtype="float32", seed=3)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])  # bf16: 1, 1+2^-6, -1, 1+2^-7
    block.w13_scale[1, :4, 1] = ties
    t = LAYOUT.encode(block, layer(2, H, I))
    s13 = t["w13_weight_scale"]
    assert s13.dtype == torch.bfloat16 and s13.shape == (2, 2 * I, H // g)
    assert s13[1, :4, 1].tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]
    param = torch.empty(block.w2_scale.shape, dtype=torch.bfloat16)
    assert torch.equal(t["w2_weight_scale"], param.copy_(block.w2_scale))  # the loader's copy_
    # fp16 model: fp16 scales
    assert LAYOUT.encode(block, layer(2, H, I, dtype="float16"))["w2_weight_scale"].dtype == torch.float16


def test_gate_rows_come_first():
    H, I = 16, 8
    block = wna16_block(1, H, I, 4, 8, True)
    block.w13[0, :I] = 1
    block.w13[0, I:] = 2
    w = LAYOUT.encode(block, layer(1, H, I))["w13_weight"][0]
    assert (w[:I] == 0x11).all() and (w[I:] == 0x22).all()


# ---------------------------------------------------------------------------------------------------
# the checkpoint's own words (compressed-tensors' packer), read as bytes


def ct_params(block: ExpertBlock, params_dtype: torch.dtype) -> dict:
    """The params vLLM holds after loading the CT checkpoint of ``block`` (spec §2), packed by CT itself."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    s = block.scheme

    def pack(u: torch.Tensor, dim: int) -> torch.Tensor:  # one expert at a time: CT packs 2-D tensors
        q = (u.to(torch.int16) - s.offset).to(torch.int8)
        return torch.stack([helpers.pack_to_int32(q[e], s.bits, packed_dim=dim) for e in range(q.shape[0])])

    p = dict(w13=pack(block.w13, 1), w2=pack(block.w2, 1),
             w13_scale=block.w13_scale.to(params_dtype), w2_scale=block.w2_scale.to(params_dtype),
             w13_zero=None, w2_zero=None)
    if not s.symmetric:
        p.update(w13_zero=pack(block.w13_zero, 0), w2_zero=pack(block.w2_zero, 0))
    return p


@pytest.mark.parametrize("bits,sym", SCHEMES)
def test_weights_are_the_ct_words_viewed_as_bytes(bits, sym):
    block = wna16_block(3, 128, 64, bits, 32, sym, seed=bits)
    t = LAYOUT.encode(block, layer(3, 128, 64))
    p = ct_params(block, torch.bfloat16)
    assert torch.equal(t["w13_weight"], p["w13"].view(torch.uint8))
    assert torch.equal(t["w2_weight"], p["w2"].view(torch.uint8))


def test_zero_point_bytes_follow_the_ct_words_down_n():
    block = wna16_block(2, 64, 32, 4, 16, False, seed=9)
    t = LAYOUT.encode(block, layer(2, 64, 32))
    p = ct_params(block, torch.bfloat16)
    for ours, words in ((t["w13_weight_zero_point"], p["w13_zero"]), (t["w2_weight_zero_point"], p["w2_zero"])):
        E, Nw, G = words.shape
        w = words.to(torch.int64) & 0xFFFFFFFF
        for b in range(4):  # byte b of word (r, g) is row 4r + b
            assert torch.equal(ours[:, b::4, :].to(torch.int64), (w >> (8 * b)) & 0xFF)


# ---------------------------------------------------------------------------------------------------
# the scale cast, plan, check


def test_round_trip_with_a_scale_cast_gives_the_expected_block():
    shape, block = layer(2, 64, 32), wna16_block(2, 64, 32, 4, 32, False, scale_dtype="float32", seed=1)
    decoded = LAYOUT.decode(LAYOUT.encode(block, shape), shape, block.scheme)
    assert decoded.differences(block)  # the scales changed dtype ...
    assert decoded.differences(LAYOUT.expected_block(block, shape)) == []  # ... exactly as documented


def test_pack_bytes_round_trips_on_any_dim():
    x = torch.randint(0, 16, (4, 6, 10), dtype=torch.uint8)
    for dim in (0, 1, 2):
        assert torch.equal(unpack_bytes(pack_bytes(x, 4, dim), 4, dim), x)


def test_plan_names_shapes_and_dtypes():
    specs = LAYOUT.plan(layer(3, 256, 192, dtype="float16"), WNA16Scheme(4, 64, False, "bfloat16"))
    assert [(s.suffix, s.shape, s.dtype) for s in specs] == [
        ("w13_weight", (3, 384, 128), torch.uint8),
        ("w2_weight", (3, 256, 96), torch.uint8),
        ("w13_weight_scale", (3, 384, 4), torch.float16),
        ("w2_weight_scale", (3, 256, 3), torch.float16),
        ("w13_weight_zero_point", (3, 192, 4), torch.uint8),
        ("w2_weight_zero_point", (3, 128, 3), torch.uint8),
    ]
    int8 = LAYOUT.plan(layer(2, 128, 64), WNA16Scheme(8, 32, True, "bfloat16"))
    assert [(s.suffix, s.shape) for s in int8] == [
        ("w13_weight", (2, 128, 128)), ("w2_weight", (2, 128, 64)),
        ("w13_weight_scale", (2, 128, 4)), ("w2_weight_scale", (2, 128, 2)),
    ]


def test_check_reports_every_violated_constraint_at_once():
    problems = LAYOUT.check(layer(1000, 102, 38, bias=True), WNA16Scheme(8, 48, False, "bfloat16"))
    assert_lists_exactly(problems, [
        "8-bit weights with zero points",
        "hidden_size H = 102 must be divisible by group_size 48",
        "intermediate_size I = 38 (per TP partition) must be divisible by group_size 48",
        "hidden_size H = 102 must be a multiple of the pack factor 4",
        "intermediate_size I = 38 (per TP partition) must be a multiple of the pack factor 4",
        "expert biases",
        "1000 experts",
    ])


def test_check_refuses_channelwise_and_other_bit_widths():
    (channel,) = LAYOUT.check(layer(2, 128, 64), WNA16Scheme(4, -1, True, "bfloat16"))
    assert "channelwise" in channel and "strategy == 'group'" in channel
    (three,) = LAYOUT.check(layer(2, 120, 60), WNA16Scheme(3, 30, True, "bfloat16"))
    assert "bits = 3" in three
    assert LAYOUT.check(layer(992, 128, 64), WNA16Scheme(4, 32, True, "bfloat16")) == []  # 992 pads to 992
    assert LAYOUT.check(layer(2, 128, 64, dtype="float32"), WNA16Scheme(4, 32, True, "float32")) == []


def test_warns_about_the_scale_cast_only():
    assert LAYOUT.warnings(layer(2, 128, 64), WNA16Scheme(4, 32, True, "bfloat16")) == []
    (w,) = LAYOUT.warnings(layer(2, 128, 64), WNA16Scheme(4, 32, True, "float32"))
    assert "float32" in w and "bfloat16" in w


# ---------------------------------------------------------------------------------------------------
# end to end: repack a real compressed-tensors checkpoint, verify, and read the bytes back independently


@pytest.mark.parametrize("scheme,group_size,symmetric", [
    ("w4a16", 32, False), ("w4a16", 128, True), ("w8a16", 64, True),
])
def test_repack_and_verify_a_compressed_tensors_checkpoint(example_ckpt, tmp_path, scheme, group_size, symmetric):
    src = example_ckpt("qwen3-moe", scheme, group_size=group_size, symmetric=symmetric, num_experts=4)
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "triton", "--verify", expect=0)
    cli("verify", out, "--against", src, expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    s, o = st_tensors(src), st_tensors(out)
    assert manifest["moe_layers"]
    for lay in manifest["moe_layers"]:
        p, I = lay["prefix"], lay["intermediate_size"]
        for e in range(lay["num_experts"]):
            # the source's int32 words, read as bytes: gate rows then up rows
            w13 = o[f"{p}.w13_weight"][e]
            assert torch.equal(w13[:I], s[f"{p}.{e}.gate_proj.weight_packed"].view(torch.uint8))
            assert torch.equal(w13[I:], s[f"{p}.{e}.up_proj.weight_packed"].view(torch.uint8))
            assert torch.equal(o[f"{p}.w2_weight"][e], s[f"{p}.{e}.down_proj.weight_packed"].view(torch.uint8))
            s13 = o[f"{p}.w13_weight_scale"][e]
            assert torch.equal(s13[:I], s[f"{p}.{e}.gate_proj.weight_scale"].to(torch.bfloat16))
            if not symmetric:
                zp = s[f"{p}.{e}.down_proj.weight_zero_point"].to(torch.int64) & 0xFFFFFFFF  # [H/8, G2]
                z2 = o[f"{p}.w2_weight_zero_point"][e].to(torch.int64)  # [H/2, G2]
                for b in range(4):
                    assert torch.equal(z2[b::4], (zp >> (8 * b)) & 0xFF)
            else:
                assert f"{p}.w13_weight_zero_point" not in o


@pytest.mark.parametrize("scheme,group_size,symmetric,needle", [
    ("w4a16", -1, True, "channelwise"), ("w8a16", 64, False, "8-bit weights with zero points"),
])
def test_repack_refuses_what_vllm_triton_cannot_run(example_ckpt, tmp_path, scheme, group_size, symmetric, needle):
    src = example_ckpt("qwen3-moe", scheme, group_size=group_size, symmetric=symmetric, num_experts=4)
    assert needle in cli("repack", src, tmp_path / "out", "--backend", "triton", expect=2).err
    assert not (tmp_path / "out" / "moeconvert.json").exists()


# ---------------------------------------------------------------------------------------------------
# Oracle: each vLLM version's own convert_to_wna16_moe_kernel_format, TRITON branch


def lift_from_vllm(version: str, rel: str, names: list[str], ns: dict) -> dict:
    """Top-level functions/classes ``names`` of vLLM ``version``'s vllm/``rel``, compiled into ``ns`` (no vLLM
    import)."""
    return lift(vllm_reader(version), rel, names, ns)


@functools.lru_cache(maxsize=None)
def vllm_convert(version: str):
    ns = lift_from_vllm(version, "model_executor/layers/fused_moe/oracle/int_wna16.py",
                        ["WNA16MoEBackend", "convert_to_wna16_moe_kernel_format"], {"torch": torch, "Enum": Enum})
    return types.SimpleNamespace(**ns)


def vllm_convert_wna16(ref, backend, p: dict, params_dtype=torch.bfloat16) -> dict:
    """``convert_to_wna16_moe_kernel_format`` of ``ref``'s version for ``backend`` on the loaded params ``p``,
    its outputs by name. 0.33.0 takes an ``input_dtype`` after the quant config and returns the 8-bit
    activation path's input global scales between the zero points and the biases; 0.34.0 has neither."""
    fn = ref.convert_to_wna16_moe_kernel_format
    lead = (backend, None, None) + ((params_dtype,) if "input_dtype" in inspect.signature(fn).parameters else ())
    out = fn(*lead, p["w13"], p["w2"], p["w13_scale"], p["w2_scale"], p["w13_zero"], p["w2_zero"], None, None)
    if len(out) == 10:
        assert out[6] is None and out[7] is None  # no input global scales for 16-bit activations
        out = out[:6] + out[8:]
    return dict(zip(("w13", "w2", "s13", "s2", "z13", "z2", "b13", "b2"), out, strict=True))


ORACLE_GRID = [
    (E, bits, sym, g, H, I, dtype)
    for bits, sym in SCHEMES for g in (16, 32, 128) for E in (1, 3)
    for H, I, dtype in ((128, 64, "bfloat16"), (256, 128, "float16"), (128, 384, "bfloat16"))
    if H % g == 0 and I % g == 0
]


@pytest.mark.parametrize("E,bits,sym,g,H,I,dtype", ORACLE_GRID)
def test_bytes_equal_vllm_convert_to_wna16_moe_kernel_format(E, bits, sym, g, H, I, dtype, vllm_version):
    ref = vllm_convert(vllm_version)
    shape, block = layer(E, H, I, dtype=dtype), wna16_block(E, H, I, bits, g, sym, seed=17 + E + g + H)
    ours = LAYOUT.encode(block, shape)
    p = ct_params(block, DTYPES[dtype])
    out = vllm_convert_wna16(ref, ref.WNA16MoEBackend.TRITON, p)
    w13, w2, s13, s2, z13, z2, b13, b2 = (out[k] for k in ("w13", "w2", "s13", "s2", "z13", "z2", "b13", "b2"))
    expected = {"w13_weight": w13, "w2_weight": w2, "w13_weight_scale": s13, "w2_weight_scale": s2}
    if not sym:
        expected.update(w13_weight_zero_point=z13, w2_weight_zero_point=z2)
    else:
        assert z13 is None and z2 is None
    assert b13 is None and b2 is None
    assert set(ours) == set(expected)
    for name, theirs in expected.items():
        assert ours[name].dtype == theirs.dtype and ours[name].shape == theirs.shape, name
        assert torch.equal(ours[name].contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8)), name
