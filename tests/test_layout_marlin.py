"""The ``marlin`` layout: what vLLM 0.33.0's Marlin MoE kernel reads (docs/layouts/marlin.md).

Proved four ways: the spec's reference vectors (§7.1, §7.2, copied from the spec, which took them
from vLLM's reference code), the spec's closed forms and invariants (§7.3), vLLM's own Python (when
vLLM is installed) and, on a GPU, vLLM's compiled ``moe_wna16_marlin_gemm`` run on our bytes.
decode(encode(x)) == x on every config ``check`` accepts (padded I, both w13 scale permutations, bias,
fp16), plan == what encode writes, streaming by chunks and the refusals are tests/test_layout_contract.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts.marlin import (
    DEVIATION,
    grouped_perm,
    pack_zero_points,
    padded_intermediate,
    repack_weights,
    single_perm,
    unpack_zero_points,
    unrepack_weights,
)
from moeconvert.schemes import WNA16Scheme

from helpers import rel, same_bits, vllm_marlin_reference as vllm_reference, vllm_moe_ops, vllm_process_marlin
from factories import wna16_block

LAYOUT = get_layout("marlin")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def layer(E, H, I, bias=False, dtype="bfloat16", bias_dtype=None):
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, has_bias=bias, dtype=dtype,
                      bias_dtype=bias_dtype)


def hex_words(t: torch.Tensor) -> list[str]:
    return [f"{int(x) & 0xFFFFFFFF:08x}" for x in t.flatten()]


def one_tile(u_kn: torch.Tensor) -> torch.Tensor:
    """A logical K-first ``u[k, n]`` as the N-first canonical codes of one expert."""
    return u_kn.T.contiguous().to(torch.uint8)[None]


# ---------------------------------------------------------------------------------------------------
# §7.1 / §7.2: reference vectors (values from vLLM's reference code, as printed in the spec)

_K = torch.arange(16).view(16, 1).expand(16, 64)
_N = torch.arange(64).view(1, 64).expand(16, 64)

SPEC_7_1 = [
    ("u=k int4", _K, 4,
     ["91918080"] * 4 + ["b3b3a2a2"] * 4, ["d5d5c4c4"] * 4 + ["f7f7e6e6"] * 4, ["f7f7e6e6"] * 4,
     "43e1cacbeda9cf7c511e7274ebdd613d8755fef38f10822ef206f576103944e8"),
    ("u=n%16 int4", _N % 16, 4,
     ["88008800"] * 8, ["88008800"] * 8, ["ff77ff77"] * 4,
     "12961a00375cf2edbf13ae0fc35b1909d7466f31d09125e0f7d8e2df3d736fe3"),
    ("u=(k+3n)%16 int4", (_K + 3 * _N) % 16, 4,
     ["19910880"] * 4 + ["3bb32aa2"] * 4, ["5dd54cc4"] * 4 + ["7ff76ee6"] * 4, ["c44cb33b"] * 4,
     "28628c23404d852eed4ea693abf4ba687a5113812f2861ee2da346a2c30f6396"),
    ("u=(16k+n)%256 int8", (16 * _K + _N) % 256, 8,
     "90108000 98188808 a0209010 a8289818 b030a020 b838a828 c040b030 c848b838".split(),
     "b030a020 b838a828 c040b030 c848b838 d050c040 d858c848 e060d050 e868d858".split(),
     "13930383 1b9b0b8b 23a31393 2bab1b9b".split(),
     "07632c54e4d56d7a7e1a15d588da50d3b36abc6e3cafcaf9c3c26086a86a4f52"),
]


@pytest.mark.parametrize("name,u,bits,w0_8,w8_16,w124_128,sha", SPEC_7_1, ids=[c[0] for c in SPEC_7_1])
def test_repack_of_one_tile_equals_spec_vectors(name, u, bits, w0_8, w8_16, w124_128, sha):
    words = repack_weights(one_tile(u), bits)
    assert words.shape == (1, 1, 64 * 16 * bits // 32)
    got = hex_words(words)
    assert got[0:8] == w0_8
    assert got[8:16] == w8_16
    assert got[124:128] == w124_128
    assert hashlib.sha256(words.numpy().tobytes()).hexdigest() == sha


def test_word_zero_for_u_equal_k_reads_as_the_b_fragment_by_hand():
    # thread 0 of warp 0 holds k = 0,8,0,8,1,9,1,9 (nibble 0 -> 7) for n = 0 and 8
    assert hex_words(repack_weights(one_tile(_K), 4))[0] == "91918080"


@pytest.mark.parametrize("z,expected", [
    (torch.arange(64) % 16, "88880000 99991111 aaaa2222 bbbb3333 cccc4444 dddd5555 eeee6666 ffff7777".split()),
    (torch.arange(64) // 4, ["ea62c840"] * 4 + ["fb73d951"] * 4),
], ids=["z=n%16", "z=n//4"])
def test_zero_points_equal_spec_vectors(z, expected):
    words = pack_zero_points(z.to(torch.uint8).view(1, 1, 64))
    assert words.shape == (1, 1, 8)
    assert hex_words(words) == expected


# ---------------------------------------------------------------------------------------------------
# §3.3 closed form and §7.3 invariants


def closed_form_index(K, N, bits):
    """(row, word, bit offset) of each u[k, n], written from the spec's closed form (§3.3)."""
    k = torch.arange(K).view(K, 1).expand(K, N)
    n = torch.arange(N).view(1, N).expand(K, N)
    kt, kk, nt, nn = k // 16, k % 16, n // 64, n % 64
    warp, hi_n, col = nn // 16, (nn % 16) // 8, nn % 8
    hi_k, tq, lo = kk // 8, (kk % 8) // 2, kk % 2
    t = 4 * col + tq
    if bits == 4:
        return kt, 128 * nt + 4 * t + warp, 4 * (4 * lo + 2 * hi_n + hi_k)
    return kt, 256 * nt + 8 * t + 2 * warp + hi_n, 8 * (2 * lo + hi_k)


def closed_form_repack(u_kn, bits):
    K, N = u_kn.shape
    row, word, shift = closed_form_index(K, N, bits)
    out = torch.zeros(K // 16, N * bits // 2, dtype=torch.int64)
    out.index_put_((row, word), u_kn.to(torch.int64) << shift, accumulate=True)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def closed_form_unrepack(words, bits, K, N):
    row, word, shift = closed_form_index(K, N, bits)
    return ((words.to(torch.int64) & 0xFFFFFFFF)[row, word] >> shift) & ((1 << bits) - 1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K,N", [(16, 64), (32, 128), (128, 192), (96, 256)])
def test_repack_equals_spec_closed_form(bits, K, N):
    gen = torch.Generator().manual_seed(K * N + bits)
    codes = torch.randint(0, 1 << bits, (3, N, K), generator=gen).to(torch.uint8)
    words = repack_weights(codes, bits)
    assert words.shape == (3, K // 16, N * bits // 2)
    for e in range(3):
        assert torch.equal(words[e], closed_form_repack(codes[e].T, bits))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K,N", [(16, 64), (64, 128), (256, 320)])
def test_repack_round_trips_and_keeps_every_bit(bits, K, N):
    gen = torch.Generator().manual_seed(K + N + bits)
    codes = torch.randint(0, 1 << bits, (2, N, K), generator=gen).to(torch.uint8)
    words = repack_weights(codes, bits)
    assert torch.equal(unrepack_weights(words, bits, N, K), codes)
    popcount = lambda t: sum(int(((t.to(torch.int64) & 0xFFFFFFFF) >> i & 1).sum()) for i in range(32))
    assert popcount(words) == sum(int(((codes.to(torch.int64) >> i) & 1).sum()) for i in range(bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_tiles_are_independent(bits):
    K, N, T = 48, 192, 16 * 64 * bits // 32
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (1, N, K), generator=gen).to(torch.uint8)
    before = repack_weights(codes, bits)
    kt, nt = 1, 2
    changed = codes.clone()
    tile = changed[0, 64 * nt:64 * (nt + 1), 16 * kt:16 * (kt + 1)]
    tile.copy_(((tile.to(torch.int64) + 1) % (1 << bits)).to(torch.uint8))  # every value in the tile moves
    diff = repack_weights(changed, bits) != before
    assert diff[0, kt, nt * T:(nt + 1) * T].all()
    diff[0, kt, nt * T:(nt + 1) * T] = False
    assert not diff.any()


def test_scale_perms_are_permutations_within_their_chunks():
    cols = torch.arange(256).repeat(3, 1)
    for perm, chunk in ((grouped_perm, 64), (single_perm, 32)):
        out = perm(cols)
        assert torch.equal(out.reshape(3, -1, chunk).sort(-1).values, cols.reshape(3, -1, chunk))
        assert torch.equal(perm(out), cols)  # both are involutions: decode applies them again
    assert grouped_perm(cols)[0, :16].tolist() == [0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57]
    assert single_perm(cols)[0, :32].tolist() == [
        0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
        4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31,
    ]


def test_scale_perms_equal_spec_formulas():
    c = torch.arange(192)
    grouped_src = 64 * (c // 64) + 8 * (c % 8) + (c % 64) // 8
    off = torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])
    single_src = 32 * (c // 32) + 2 * ((c % 32) // 8) + off[c % 8]
    x = torch.rand(2, 192)
    assert torch.equal(grouped_perm(x), x[:, grouped_src])
    assert torch.equal(single_perm(x), x[:, single_src])


def test_zero_point_map_places_each_nibble_exactly_once():
    N = 128
    one_hot = torch.eye(N, dtype=torch.uint8).view(1, N, N)  # group g has a 1 at column g only
    words = pack_zero_points(one_hot)
    nibbles = ((words.to(torch.int64)[..., None] & 0xFFFFFFFF) >> (4 * torch.arange(8))) & 0xF
    nibbles = nibbles.reshape(N, N)
    assert torch.equal(nibbles.sum(1), torch.ones(N, dtype=torch.int64))  # each source once ...
    assert torch.equal(nibbles.sum(0), torch.ones(N, dtype=torch.int64))  # ... in distinct places
    # closed form: nibble t of word w holds z[64(w//8) + 8 IL[t] + w%8]
    w, t = torch.arange(N // 8).view(-1, 1), torch.arange(8).view(1, -1)
    IL = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    src = (64 * (w // 8) + 8 * IL[t] + w % 8).flatten()
    assert torch.equal(nibbles[src, torch.arange(N)], torch.ones(N, dtype=torch.int64))
    assert torch.equal(unpack_zero_points(words), one_hot)


# ---------------------------------------------------------------------------------------------------
# §3.2 padding and §7.5 shapes


@pytest.mark.parametrize("I,g,Ip", [(128, 128, 128), (256, 128, 256), (96, 32, 128), (96, -1, 128),
                                    (64, 128, 128), (192, 64, 192), (64, 32, 64), (160, 32, 192)])
def test_padded_intermediate(I, g, Ip):
    assert padded_intermediate(I, g) == Ip


SHAPES_7_5 = [
    # bits, sym, g, I: expected shapes for E=2, H=128
    (4, True, 32, 64, dict(w13_weight=(2, 8, 256), w2_weight=(2, 4, 256),
                           w13_weight_scale=(2, 4, 128), w2_weight_scale=(2, 2, 128))),
    (4, False, 32, 64, dict(w13_weight_zero_point=(2, 4, 16), w2_weight_zero_point=(2, 2, 16))),
    (4, True, 32, 96, dict(w13_weight=(2, 8, 512), w2_weight=(2, 8, 256),
                           w13_weight_scale=(2, 4, 256), w2_weight_scale=(2, 4, 128))),
    (4, True, -1, 96, dict(w13_weight_scale=(2, 1, 256), w2_weight_scale=(2, 1, 128))),
    (8, True, 32, 64, dict(w13_weight=(2, 8, 512), w2_weight=(2, 4, 512))),
]


@pytest.mark.parametrize("bits,sym,g,I,expected", SHAPES_7_5)
def test_shapes_equal_spec(bits, sym, g, I, expected):
    shape, block = layer(2, 128, I), wna16_block(2, 128, I, bits, g, sym)
    planned = {s.suffix: s for s in LAYOUT.plan(shape, block.scheme)}
    encoded = LAYOUT.encode(block, shape)
    assert set(planned) == set(encoded)
    for suffix, dims in expected.items():
        assert planned[suffix].shape == dims and tuple(encoded[suffix].shape) == dims
    for suffix, spec in planned.items():
        assert tuple(encoded[suffix].shape) == spec.shape and encoded[suffix].dtype == spec.dtype, suffix


def test_plan_names_and_dtypes():
    shape = layer(3, 256, 192, bias=True, dtype="float16")
    specs = LAYOUT.plan(shape, WNA16Scheme(4, 64, False, "float32"))
    assert [(s.suffix, s.shape, s.dtype) for s in specs] == [
        ("w13_weight", (3, 16, 768), torch.int32),
        ("w2_weight", (3, 12, 512), torch.int32),
        ("w13_weight_scale", (3, 4, 384), torch.float16),
        ("w2_weight_scale", (3, 3, 256), torch.float16),
        ("w13_weight_zero_point", (3, 4, 48), torch.int32),
        ("w2_weight_zero_point", (3, 3, 32), torch.int32),
        ("w13_bias", (3, 384), torch.float16),
        ("w2_bias", (3, 256), torch.float16),
    ]


# ---------------------------------------------------------------------------------------------------
# the cast to the model dtype

SCHEMES = [(4, True), (4, False), (8, True)]


def test_scales_are_cast_to_the_model_dtype_with_round_to_nearest_even():
    # fp32 checkpoint scales into a bf16 model, as vLLM's loader copy_ does
    shape = layer(2, 128, 64, bias=True)
    block = wna16_block(2, 128, 64, 4, 32, True, bias=True, scale_dtype="float32", seed=7)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])  # -> 1, 1+2^-6, -1, 1+2^-7
    block.w13_scale[0, :4, 0] = ties
    decoded = LAYOUT.decode(LAYOUT.encode(block, shape), shape, block.scheme)
    assert decoded.w13_scale.dtype == torch.bfloat16 and decoded.w2_bias.dtype == torch.bfloat16
    assert decoded.w13_scale[0, :4, 0].tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]

    def rne_bf16(x: torch.Tensor) -> torch.Tensor:  # by hand, on the fp32 bits
        b = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF

    for name in ("w13_scale", "w2_scale", "w13_bias", "w2_bias"):
        got = getattr(decoded, name).view(torch.int16).to(torch.int64) & 0xFFFF
        assert torch.equal(got, rne_bf16(getattr(block, name))), name
        param = torch.empty(getattr(block, name).shape, dtype=torch.bfloat16)
        assert torch.equal(getattr(decoded, name), param.copy_(getattr(block, name))), name  # the loader's way


# ---------------------------------------------------------------------------------------------------
# §7.3 invariant 4: the dequantized layer, read back with the spec's formulas (not with decode)


def _inverse_cols(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out[..., src] = x
    return out


def spec_scale_src(n: int, grouped: bool) -> torch.Tensor:
    c = torch.arange(n)
    if grouped:
        return 64 * (c // 64) + 8 * (c % 8) + (c % 64) // 8
    return 32 * (c // 32) + 2 * ((c % 32) // 8) + torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])[c % 8]


def spec_zero_points(words: torch.Tensor) -> torch.Tensor:
    """Marlin zp words [G, Nn/8] -> z [G, Nn], by the closed form of §3.5."""
    G, W = words.shape
    w, t = torch.arange(W).view(-1, 1), torch.arange(8).view(1, -1)
    src = (64 * (w // 8) + 8 * torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])[t] + w % 8).flatten()
    nibbles = (((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> (4 * torch.arange(8))) & 0xF).reshape(G, -1)
    return _inverse_cols(nibbles, src)


def spec_dequant(words, scales, zeros, bits, K, N, g, grouped):
    """One expert's Marlin tensors -> dequantized K-first [K, N] float32."""
    u = closed_form_unrepack(words, bits, K, N).float()
    s = _inverse_cols(scales.float(), spec_scale_src(N, grouped))
    z = spec_zero_points(zeros).float() if zeros is not None else torch.full_like(s, 1 << (bits - 1))
    rows = torch.arange(K) // (g if g > 0 else K)
    return (u - z[rows]) * s[rows]


def canonical_dequant(codes, scales, zeros, bits, g):
    """Canonical N-first [N, K] codes -> dequantized K-first [K, N] float32."""
    K = codes.shape[1]
    cols = torch.arange(K) // (g if g > 0 else K)
    z = zeros.float() if zeros is not None else torch.full_like(scales.float(), 1 << (bits - 1))
    return ((codes.float() - z[:, cols]) * scales.float()[:, cols]).T


@pytest.mark.parametrize("bits,sym,g,I,H", [
    (4, True, 32, 96, 128), (4, False, 32, 96, 128), (4, False, -1, 96, 256), (8, True, 64, 64, 256),
    (4, True, 128, 128, 256), (4, False, 32, 160, 128), (8, True, -1, 192, 128),
])
def test_dequantized_layer_equals_canonical_with_zero_pads(bits, sym, g, I, H):
    shape, block = layer(2, H, I), wna16_block(2, H, I, bits, g, sym, seed=3)
    Ip = padded_intermediate(I, g)
    t = LAYOUT.encode(block, shape)
    grouped13 = g > 0 and H // g > 1  # the kernel's group mode: more than one scale row
    grouped2 = g > 0 and Ip // g > 1
    z13, z2 = t.get("w13_weight_zero_point"), t.get("w2_weight_zero_point")
    for e in range(2):
        w13 = spec_dequant(t["w13_weight"][e], t["w13_weight_scale"][e], None if sym else z13[e],
                           bits, H, 2 * Ip, g, grouped13)
        ref13 = canonical_dequant(block.w13[e], block.w13_scale[e], None if sym else block.w13_zero[e], bits, g)
        assert torch.equal(w13[:, :I], ref13[:, :I])  # gate
        assert torch.equal(w13[:, Ip:Ip + I], ref13[:, I:])  # up
        assert not w13[:, I:Ip].any() and not w13[:, Ip + I:].any()  # pads: scale 0
        w2 = spec_dequant(t["w2_weight"][e], t["w2_weight_scale"][e], None if sym else z2[e], bits, Ip, H, g, grouped2)
        ref2 = canonical_dequant(block.w2[e], block.w2_scale[e], None if sym else block.w2_zero[e], bits, g)
        assert torch.equal(w2[:I], ref2)
        if g > 0:
            assert not w2[I:].any()  # padded rows carry scale 0
        # channelwise: padded rows decode to (0 - z) * s; they only ever multiply zero activations


# ---------------------------------------------------------------------------------------------------
# check, warnings, metadata


def test_check_reports_every_violated_constraint_at_once():
    problems = LAYOUT.check(layer(2, 200, 36, dtype="float32"), WNA16Scheme(8, 48, False, "float32"))
    text = "\n".join(problems)
    assert len(problems) == 7, text
    for needle in ("8-bit weights with zero points", "group_size = 48", "hidden_size H = 200 must be a multiple of 128",
                   "hidden_size H = 200 must be divisible by group_size 48",
                   "intermediate_size I = 36 (per TP partition) must be divisible by group_size 48",
                   "intermediate_size I = 36 (per TP partition) must be a multiple of 8", "model dtype = float32"):
        assert needle in text
    assert any("bits = 3" in p for p in LAYOUT.check(layer(2, 128, 64), WNA16Scheme(3, 32, True, "bfloat16")))
    assert LAYOUT.check(layer(2, 128, 64), WNA16Scheme(4, 32, True, "bfloat16")) == []


def test_i_equal_group_size_deviates_from_vllm_on_purpose():
    shape, scheme = layer(4, 256, 128), WNA16Scheme(4, 128, True, "bfloat16")
    meta = LAYOUT.layer_metadata(shape, scheme)
    assert meta["intermediate_size_padded"] == 128
    assert meta["deviation"] == DEVIATION
    assert meta["w13_scale_perm"] == "grouped"
    (warning,) = LAYOUT.warnings(shape, scheme)
    assert "vLLM 0.33.0" in warning and "wrong results" in warning and "deviates" in warning
    # the bytes: grouped permutation of the [G13=2, 2Ip] scales, not the single one vLLM writes
    block = wna16_block(4, 256, 128, 4, 128, True)
    s13 = block.w13_scale.transpose(1, 2)
    assert torch.equal(LAYOUT.encode(block, shape)["w13_weight_scale"], grouped_perm(s13))
    assert not torch.equal(grouped_perm(s13), single_perm(s13))


def test_h_equal_group_size_follows_the_kernel_one_group_mode():
    shape, scheme = layer(2, 128, 256), WNA16Scheme(4, 128, True, "bfloat16")
    meta = LAYOUT.layer_metadata(shape, scheme)
    assert meta["w13_scale_perm"] == "single" and "deviation" in meta
    assert len(LAYOUT.warnings(shape, scheme)) == 1


@pytest.mark.parametrize("H,I,g,w13,w2", [(256, 256, 128, "grouped", "grouped"), (128, 64, 128, "single", "single"),
                                          (256, 96, -1, "single", "single"), (128, 64, 32, "grouped", "grouped")])
def test_ordinary_layers_carry_no_deviation(H, I, g, w13, w2):
    meta = LAYOUT.layer_metadata(layer(2, H, I), WNA16Scheme(4, g, True, "bfloat16"))
    assert meta["w13_scale_perm"] == w13 and meta["w2_scale_perm"] == w2 and "deviation" not in meta
    assert not any("deviates" in w for w in LAYOUT.warnings(layer(2, H, I), WNA16Scheme(4, g, True, "bfloat16")))


def test_padding_is_recorded_and_noted():
    shape, scheme = layer(2, 128, 96), WNA16Scheme(4, 32, True, "bfloat16")
    assert LAYOUT.layer_metadata(shape, scheme)["intermediate_size_padded"] == 128
    assert any("padded to Ip = 128" in w for w in LAYOUT.warnings(shape, scheme))


# ---------------------------------------------------------------------------------------------------
# Oracle: each vLLM version's own Python (``_process_weights_marlin`` with its reference repack)

def ct_params(block: ExpertBlock, params_dtype: torch.dtype):
    """The params vLLM holds after loading the CT checkpoint of ``block`` (spec §2), packed by CT itself."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    s = block.scheme
    signed = lambda u: (u.to(torch.int16) - s.offset).to(torch.int8)
    p = dict(
        w13=pack_to_int32(signed(block.w13), s.bits, packed_dim=1),
        w2=pack_to_int32(signed(block.w2), s.bits, packed_dim=1),
        w13_scale=block.w13_scale.to(params_dtype), w2_scale=block.w2_scale.to(params_dtype),
        w13_zero=None, w2_zero=None, w13_bias=None, w2_bias=None,
    )
    if not s.symmetric:
        p.update(w13_zero=pack_to_int32(signed(block.w13_zero), s.bits, packed_dim=0),
                 w2_zero=pack_to_int32(signed(block.w2_zero), s.bits, packed_dim=0))
    if block.w13_bias is not None:
        p.update(w13_bias=block.w13_bias.to(params_dtype), w2_bias=block.w2_bias.to(params_dtype))
    return p


ORACLE_GRID = [
    (bits, sym, g, I, H, bias)
    for bits, sym in SCHEMES for g in (32, 64, 128, -1) for I in (64, 96, 128, 256)
    for H, bias in ((128, I == 96), (256, I == 128))
    if g == -1 or I % g == 0
]


@pytest.mark.parametrize("bits,sym,g,I,H,bias", ORACLE_GRID)
def test_bytes_equal_vllm_process_weights_marlin(bits, sym, g, I, H, bias, vllm_version):
    ref = vllm_reference(vllm_version)
    shape, block = layer(2, H, I, bias=bias), wna16_block(2, H, I, bits, g, sym, bias, seed=11)
    ours = LAYOUT.encode(block, shape)
    p = ct_params(block, torch.bfloat16)
    out = vllm_process_marlin(ref, bits, g, I, p)
    w13, w2, s13, s2, z13, z2, b13, b2 = (out[k] for k in ("w13", "w2", "s13", "s2", "z13", "z2", "b13", "b2"))
    assert same_bits(ours["w13_weight"], w13)
    assert same_bits(ours["w2_weight"], w2)
    assert same_bits(ours["w2_weight_scale"], s2)
    if "deviation" in LAYOUT.layer_metadata(shape, block.scheme):
        # vLLM permutes w13 scales as if K were I; we permute them for the GEMM's real K = H, the way
        # vLLM's own marlin_permute_scales does for a dense layer, which is what the kernel reads.
        assert not same_bits(ours["w13_weight_scale"], s13)
        s13_true_k = ref.marlin_moe_permute_scales(
            _pad_w13_for_reference(ref, p["w13_scale"], I, padded_intermediate(I, g)), H, s13.shape[2], g)
        assert same_bits(ours["w13_weight_scale"], s13_true_k)
    else:
        assert same_bits(ours["w13_weight_scale"], s13)
    if not sym:
        assert same_bits(ours["w13_weight_zero_point"], z13)
        assert same_bits(ours["w2_weight_zero_point"], z2)
    else:
        assert "w13_weight_zero_point" not in ours and z13 is None
    if bias:
        assert same_bits(ours["w13_bias"], b13)
        assert same_bits(ours["w2_bias"], b2)


def _pad_w13_for_reference(ref, s13_nfirst, I, Ip):
    return ref._pad_w13_shard_cols(s13_nfirst.transpose(1, 2).contiguous(), I, Ip)


def test_oracle_covers_the_deviation_cases():
    assert (4, True, 128, 128, 256, True) in ORACLE_GRID  # I == g < H
    assert (4, True, 128, 256, 128, False) in ORACLE_GRID  # H == g < I


def test_weight_perm_equals_vllm_get_weight_perm(vllm_version):
    ref = vllm_reference(vllm_version)
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (1, 128, 64), generator=torch.Generator().manual_seed(bits))
        codes = codes.to(torch.uint8)
        theirs = ref.marlin_weights(codes[0].T.to(torch.int32), 64, 128, bits, ref.get_weight_perm(bits))
        assert torch.equal(repack_weights(codes, bits)[0], theirs)


# ---------------------------------------------------------------------------------------------------
# GPU: vLLM's compiled Marlin MoE kernel on our bytes (run on the device machine with -s)

UINT4B8, UINT4, UINT8B128 = 0x4000000100400, 0x4000000000400, 0x4000001000800  # vllm/scalar_type.py ids

GPU_CASES = [
    # bits, sym, g, H, I, bias, dtype
    (4, True, 128, 256, 256, False, "bfloat16"),
    (4, True, 32, 256, 96, False, "bfloat16"),  # padded I
    (4, True, -1, 256, 96, True, "bfloat16"),  # channelwise, padded, bias
    (4, False, 128, 256, 256, False, "bfloat16"),
    (4, False, 32, 256, 96, True, "float16"),  # asym, padded, bias, fp16
    (4, False, -1, 256, 256, False, "bfloat16"),
    (8, True, 128, 256, 256, False, "bfloat16"),
    (8, True, 32, 256, 96, False, "bfloat16"),
    (8, True, -1, 256, 128, False, "float16"),
    (4, True, 128, 256, 128, False, "bfloat16"),  # the quirk: I == g < H
    (4, False, 128, 256, 128, False, "bfloat16"),
    (4, True, 128, 128, 256, False, "bfloat16"),  # H == g < I: one group
]


def _dequant(codes, scales, zeros, bits, g):  # canonical [E, N, K] -> float32 [E, N, K]
    K = codes.shape[2]
    cols = torch.arange(K, device=codes.device) // (g if g > 0 else K)
    z = zeros.float() if zeros is not None else torch.full_like(scales.float(), 1 << (bits - 1))
    return (codes.float() - z[:, :, cols]) * scales.float()[:, :, cols]


def run_marlin_moe(tensors, shape, scheme, x, topk_w, topk_ids):
    """Both Marlin GEMMs as the runtime (and vLLM's ``_fused_marlin_moe``) calls them; returns (gemm1 out,
    act, gemm2 out)."""
    from moeconvert.runtime import vllm_marlin
    from moeconvert.runtime.reference import silu_and_mul

    vllm_moe_ops()
    E, H, Ip = shape.num_experts, shape.hidden_size, padded_intermediate(shape.intermediate_size, scheme.group_size)
    M, topk = topk_ids.shape
    qtype = vllm_marlin.weight_type_id("wna16", scheme.bits, scheme.symmetric)
    assert qtype == (UINT8B128 if scheme.bits == 8 else (UINT4B8 if scheme.symmetric else UINT4))
    t = {k: v.to(x.device) for k, v in tensors.items()}
    r = vllm_marlin.prepare(topk_w, topk_ids, E)
    c1 = vllm_marlin.gemm(x, t, True, r, type_id=qtype, size_n=2 * Ip, size_k=H)
    act = vllm_marlin.activation(c1, silu_and_mul, Ip, "gate_up", x.dtype)
    c2 = vllm_marlin.gemm(act, t, False, r, type_id=qtype, size_n=H, size_k=Ip)
    return c1, act, c2.view(M, topk, H)


def gpu_errors(block, shape, tensors, M=32, topk=2, seed=0, dev="cuda"):
    """Relative errors (gemm1, gemm2, whole MoE) of the kernel on ``tensors`` vs dequantize-then-matmul."""
    s = block.scheme
    dt = DTYPES[shape.dtype]
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    Ip = padded_intermediate(I, s.group_size)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, H, device=dev, generator=gen, dtype=torch.float32).to(dt)
    logits = torch.randn(M, E, device=dev, generator=gen)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), topk, -1)
    topk_w, topk_ids = topk_w.float().contiguous(), topk_ids.to(torch.int32).contiguous()

    cast = lambda t: None if t is None else t.to(dev).to(dt)  # the model-dtype values the kernel sees
    w13 = _dequant(block.w13.to(dev), cast(block.w13_scale), None if s.symmetric else block.w13_zero.to(dev),
                   s.bits, s.group_size)
    w2 = _dequant(block.w2.to(dev), cast(block.w2_scale), None if s.symmetric else block.w2_zero.to(dev),
                  s.bits, s.group_size)
    b13 = cast(block.w13_bias).float() if block.w13_bias is not None else torch.zeros(E, 2 * I, device=dev)
    b2 = cast(block.w2_bias).float() if block.w2_bias is not None else torch.zeros(E, H, device=dev)

    c1, act, c2 = run_marlin_moe(tensors, shape, s, x, topk_w, topk_ids)
    ids = topk_ids.flatten().long()
    xr = x.float().repeat_interleave(topk, 0)  # row m*topk + j is token m's j-th expert
    ref1 = torch.einsum("rk,rnk->rn", xr, w13[ids]) + b13[ids]
    got1 = torch.cat([c1[:, :I], c1[:, Ip:Ip + I]], 1)
    ref2 = (torch.einsum("rk,rnk->rn", act[:, :I].float(), w2[ids]) + b2[ids]) * topk_w.flatten()[:, None]
    a_ref = torch.nn.functional.silu(ref1[:, :I]) * ref1[:, I:]
    ref_moe = ((torch.einsum("rk,rnk->rn", a_ref, w2[ids]) + b2[ids]) * topk_w.flatten()[:, None]).view(M, topk, H)
    return rel(got1, ref1), rel(c2.reshape(M * topk, H), ref2), rel(c2.sum(1), ref_moe.sum(1))


@pytest.mark.gpu
@pytest.mark.parametrize("bits,sym,g,H,I,bias,dtype", GPU_CASES)
def test_vllm_marlin_kernel_computes_right_on_our_bytes(bits, sym, g, H, I, bias, dtype):
    vllm_moe_ops()
    shape = layer(4, H, I, bias=bias, dtype=dtype)
    block = wna16_block(4, H, I, bits, g, sym, bias, scale_dtype=dtype, seed=5)
    errs = gpu_errors(block, shape, LAYOUT.encode(block, shape))
    print(f"\nmarlin kernel w{bits} {'sym' if sym else 'asym'} g{g} H{H} I{I} bias={bias} {dtype}: "
          f"rel err gemm1 {errs[0]:.2e} gemm2 {errs[1]:.2e} moe {errs[2]:.2e}")
    assert max(errs) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bits,sym,g,H,I", [(4, True, 128, 256, 128), (4, True, 128, 128, 256)])
def test_vllm_own_w13_scale_layout_is_wrong_where_we_deviate(bits, sym, g, H, I):
    """The evidence for the deviation: vLLM's w13 scale permutation, run through vLLM's kernel."""
    vllm_moe_ops()
    shape = layer(4, H, I)
    block = wna16_block(4, H, I, bits, g, sym, seed=5)
    tensors = LAYOUT.encode(block, shape)
    assert "deviation" in LAYOUT.layer_metadata(shape, block.scheme)
    ours = tensors["w13_weight_scale"]
    vllms = single_perm(grouped_perm(ours)) if LAYOUT.layer_metadata(shape, block.scheme)["w13_scale_perm"] == \
        "grouped" else grouped_perm(single_perm(ours))
    errs_ours = gpu_errors(block, shape, tensors)
    errs_vllm = gpu_errors(block, shape, {**tensors, "w13_weight_scale": vllms})
    print(f"\nH{H} I{I} g{g}: gemm1 rel err with our w13 scales {errs_ours[0]:.2e}, with vLLM 0.33.0's {errs_vllm[0]:.2e}")
    assert errs_ours[0] < 2e-2 < errs_vllm[0]
