"""The ``triton`` layout for MXFP4 experts: triton_kernels' Hopper swizzle as vLLM 0.33.0 holds it
(docs/layouts/triton-mxfp4.md).

Proved four ways: positions worked out by hand from the spec's index maps and bit table,
decode(encode(x)) == x over sizes that need every kind of storage padding (sizes below the kernel's
floor, which tests/test_layout_contract.py does not take: it takes what ``check`` accepts),
triton_kernels' own ``convert_layout`` and vLLM's own ``_swizzle_mxfp4`` on CPU (when their sources are at hand:
MOECONVERT_TRITON_KERNELS_SRC, MOECONVERT_VLLM_SRC), and, on a GPU, triton_kernels' ``matmul_ogs``
run on our bytes wrapped by the loader recipe of docs/layouts/triton-mxfp4.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts.triton_mxfp4 import (
    TritonMXFP4Layout,
    deinterleave_gate_up,
    interleave_gate_up,
    swizzle_scales,
    swizzle_values,
    unswizzle_scales,
    unswizzle_values,
)
from moeconvert.schemes import MXFP4Scheme

from helpers import VLLM_SRC, lift, package_location, rel, vllm_reader
from factories import mxfp4_block

LAYOUT = get_layout("triton", "mxfp4")

# Tests that run triton_kernels or check its tile-size floor; every other test here proves bytes and may
# use layers too small for the kernel to run (the floor is lifted for them).
KERNEL_TESTS = {"test_matmul_ogs_computes_right_on_our_bytes", "test_check_refuses_rows_the_kernel_cannot_tile"}


@pytest.fixture(autouse=True)
def _byte_level_sizes(request, monkeypatch):
    if request.node.originalname not in KERNEL_TESTS:
        monkeypatch.setattr("moeconvert.layouts.triton_mxfp4.KERNEL_MIN_N", 0)
        monkeypatch.setattr("moeconvert.layouts.triton_mxfp4.KERNEL_K_MULTIPLE", 32)


def test_check_refuses_rows_the_kernel_cannot_tile():
    # seen on an H200: matmul_ogs fails to compile for N <= 128 (BLOCK_N 128, Hopper scale swizzle wants 256)
    problems = LAYOUT.check(layer(1, 96, 64), MXFP4Scheme())
    assert any("w13 rows 2*I = 128 must exceed 128" in p for p in problems)
    assert any("w2 rows H = 96 must exceed 128" in p for p in problems)
    assert any("H = 160 must be a multiple of 64" in p for p in LAYOUT.check(layer(1, 160, 128), MXFP4Scheme()))
    assert not LAYOUT.check(layer(1, 192, 128), MXFP4Scheme())  # 2*I = 256, H = 192


def layer(E, H, I, bias=False, activation="swigluoai", dtype="bfloat16"):
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, has_bias=bias, activation=activation,
                      dtype=dtype)


def one_byte(n, kb, value, N, Kb):
    """A single expert's packed ``[N, Kb]`` with one nonzero byte."""
    p = torch.zeros(1, N, Kb, dtype=torch.uint8)
    p[0, n, kb] = value
    return p


def nonzero_positions(t):
    return [tuple(i.tolist()) for i in torch.nonzero(t)]


def test_registered_under_triton_for_mxfp4():
    assert isinstance(LAYOUT, TritonMXFP4Layout)
    assert LAYOUT.name == "triton" and LAYOUT.schemes == ("mxfp4",) and LAYOUT.version == 1
    # vLLM rounds I up to 64 for its TRITON backends and leaves H alone (spec §5.3)
    assert LAYOUT.pad_multiples == (1, 64)


# ---------------------------------------------------------------------------------------------------
# values, by hand from §6.4: word (row, q), row = 4 R0 + c0, q = 32 R1 + 16 s0 + 4 c1 + a1, with
# n = 16 R0 + 2 c0 + s0 (+8 for slots 1, 3) and kb = 32 R1 + 8 a1 + c1 (+4 for slots 2, 3); the word
# is little-endian, low 16 bits from low nibbles. Slot bits (s, e1, e0, m): b0 15 8 7 6, b1 12 5 4 3,
# b2 9 2 1 0, b3 14 11 10 13.


def test_byte_0x21_at_origin():
    # n=0, kb=0: word (0, 0) slot b0. Low nibble 1 (m) -> bit 6; high nibble 2 (e0) -> bit 7 + 16.
    # word 0x00800040 -> bytes 40 00 80 00
    out = swizzle_values(one_byte(0, 0, 0x21, 16, 32))
    assert out.shape == (1, 4, 128)
    assert out[0, 0, :4].tolist() == [0x40, 0x00, 0x80, 0x00]
    assert nonzero_positions(out) == [(0, 0, 0), (0, 0, 2)]


def test_byte_at_n9_kb13_lands_in_slot_3_of_word_21():
    # n = 9 = 8 + 1: s0 = 1, slot has the +8 (w0 = 1); kb = 13 = 8 + 4 + 1: a1 = 1, +4 (w1 = 1), c1 = 1.
    # row 0, q = 16 + 4 + 1 = 21, slot b3 -> bytes 84..87. Low nibble 0xF: bits 14, 11, 10, 13 = 0x6C00;
    # high nibble 0x7: bits 11, 10, 13 = 0x2C00 -> word 0x2C006C00 -> bytes 00 6C 00 2C
    out = swizzle_values(one_byte(9, 13, 0x7F, 16, 32))
    assert out[0, 0, 84:88].tolist() == [0x00, 0x6C, 0x00, 0x2C]
    assert int((out != 0).sum()) == 2


def test_second_row_tile():
    # n = 22 = 16 + 2*3: R0 = 1, c0 = 3 -> row 7; kb = 0 -> word 0, slot b0. 0x88: sign bits 15 and 31
    out = swizzle_values(one_byte(22, 0, 0x88, 32, 32))
    assert out.shape == (1, 8, 128)
    assert out[0, 7, :4].tolist() == [0x00, 0x80, 0x00, 0x80]
    assert int((out != 0).sum()) == 2


def test_packed_k_padded_to_32_bytes():
    # K = 32 -> Kb = 16, padded to 32. n = 3 = 2 + 1: c0 = 1, s0 = 1 -> row 1; kb = 15 = 8 + 4 + 3:
    # a1 = 1, w1 = 1, c1 = 3 -> q = 16 + 12 + 1 = 29, slot b2 -> byte 116 (low half, bits 0..7). m -> bit 0.
    out = swizzle_values(one_byte(3, 15, 0x01, 16, 16))
    assert out.shape == (1, 4, 128)
    assert nonzero_positions(out) == [(0, 1, 116)]
    assert int(out[0, 1, 116]) == 0x01


def test_rows_padded_to_16():
    # N = 8 -> N' = 16; the 8 pad rows are slots b1/b3 of the same words
    p = torch.full((1, 8, 32), 0x11, dtype=torch.uint8)
    out = swizzle_values(p)
    assert out.shape == (1, 4, 128)
    # every word has slots b0, b2 = 0x11 (m -> bits 6 and 0, both halves), b1, b3 = 0 (padding)
    assert bool((out.view(4, 32, 4) == torch.tensor([0x41, 0x00, 0x41, 0x00], dtype=torch.uint8)).all())


@pytest.mark.parametrize("nibble,word_bytes", [
    (0x1, [0x49, 0x20]),  # m: bits 6, 3, 0, 13
    (0x8, [0x00, 0xD2]),  # sign: bits 15, 12, 9, 14
    (0x6, [0xB6, 0x0D]),  # e1 e0: bits 8 7, 5 4, 2 1, 11 10
])
def test_all_four_slots_of_one_word(nibble, word_bytes):
    # the four bytes of word (0, 0) are D[0,0], D[8,0], D[0,4], D[8,4]
    p = torch.zeros(1, 16, 32, dtype=torch.uint8)
    for n, kb in ((0, 0), (8, 0), (0, 4), (8, 4)):
        p[0, n, kb] = nibble | (nibble << 4)
    out = swizzle_values(p)
    assert out[0, 0, :4].tolist() == word_bytes + word_bytes
    assert int((out != 0).sum()) == sum(b != 0 for b in word_bytes) * 2


def test_value_bits_are_a_permutation():
    # every one of the 4096 single-bit probes of a 16 x 32 byte matrix lands on a distinct single bit
    seen = set()
    for n in range(16):
        for kb in range(32):
            for bit in range(8):
                out = swizzle_values(one_byte(n, kb, 1 << bit, 16, 32))
                (pos,) = nonzero_positions(out)
                assert bin(int(out[pos])).count("1") == 1
                seen.add((pos, int(out[pos])))
    assert len(seen) == 16 * 32 * 8


# ---------------------------------------------------------------------------------------------------
# scales, by hand: out[8 d0 + d2, 64 d5 + 32 d1 + 4 d4 + 2 d6 + d3] = S[m, k],
# m = 256 d0 + 128 d1 + 16 d2 + 8 d3 + d4, k = 2 d5 + d6


@pytest.mark.parametrize("N,G,m,k,row,col,shape", [
    (256, 4, 0, 0, 0, 0, (1, 8, 128)),
    (256, 4, 137, 3, 0, 103, (1, 8, 128)),  # 137 = 128 + 8 + 1; k = 2 + 1
    (256, 4, 255, 0, 7, 61, (1, 8, 128)),  # 255 = 128 + 7*16 + 8 + 7
    (320, 1, 300, 0, 10, 17, (1, 16, 128)),  # N'' = 512, K/32 = 1 -> 4; 300 = 256 + 2*16 + 8 + 4
    (64, 3, 17, 2, 1, 68, (1, 8, 128)),  # N'' = 256; 17 = 16 + 1: d2 = d4 = 1; k = 2: d5 = 1
])
def test_scale_positions(N, G, m, k, row, col, shape):
    s = torch.zeros(1, N, G, dtype=torch.uint8)
    s[0, m, k] = 0xAB
    out = swizzle_scales(s)
    assert out.shape == shape
    assert nonzero_positions(out) == [(0, row, col)]
    assert int(out[0, row, col]) == 0xAB


# ---------------------------------------------------------------------------------------------------
# the layer: rows, tensors, metadata


def test_swigluoai_interleaves_w13_rows_silu_keeps_halves():
    E, H, I = 1, 64, 64
    block = mxfp4_block(E, H, I, bias=True)
    block.w13.zero_(), block.w13_scale.zero_()
    block.w13[0, I, 0] = 0x01  # up row 0, k = 0
    block.w13_scale[0, I, 0] = 0x7F
    block.w13_bias.copy_(torch.arange(2 * I, dtype=torch.bfloat16).view(1, -1))

    gpt = LAYOUT.encode(block, layer(E, H, I, bias=True, activation="swigluoai"))
    # up_0 is GEMM row n = 1 (s0 = 1): word (0, 16), slot b0, m -> bit 6 -> byte 64
    assert nonzero_positions(gpt["w13_weight"]) == [(0, 0, 64)] and int(gpt["w13_weight"][0, 0, 64]) == 0x40
    assert nonzero_positions(gpt["w13_weight_scale"]) == [(0, 0, 4)]  # m = 1 -> d4 = 1 -> col 4
    assert gpt["w13_bias"][0, :6].tolist() == [0.0, 64.0, 1.0, 65.0, 2.0, 66.0]
    assert gpt["w13_bias"].dtype == torch.float32

    silu = LAYOUT.encode(block, layer(E, H, I, bias=True, activation="silu"))
    # up_0 stays GEMM row n = 64: R0 = 4 -> row 16, word 0
    assert nonzero_positions(silu["w13_weight"]) == [(0, 16, 0)] and int(silu["w13_weight"][0, 16, 0]) == 0x40
    assert nonzero_positions(silu["w13_weight_scale"]) == [(0, 4, 0)]  # m = 64 -> d2 = 4 -> row 4
    assert silu["w13_bias"][0, :3].tolist() == [0.0, 1.0, 2.0]


def test_interleave_by_hand():
    x = torch.tensor([[10, 11, 12, 20, 21, 22]])  # [gate 0..2; up 0..2]
    assert interleave_gate_up(x).tolist() == [[10, 20, 11, 21, 12, 22]]
    assert deinterleave_gate_up(interleave_gate_up(x)).tolist() == x.tolist()


def test_plan_shapes_by_hand():
    # w13: N = 2I = 128, K = H = 96: Kb 48 -> 64, K/32 = 3 -> 4, N'' = 256
    # w2: N = H = 96, K = I = 64: Kb 32, K/32 = 2 -> 4, N'' = 256
    specs = {s.suffix: (s.shape, s.dtype) for s in LAYOUT.plan(layer(2, 96, 64, bias=True), MXFP4Scheme())}
    assert specs == {
        "w13_weight": ((2, 32, 256), torch.uint8),  # [E, N'/4, 4 Kb']
        "w2_weight": ((2, 24, 128), torch.uint8),
        "w13_weight_scale": ((2, 8, 128), torch.uint8),  # [E, N''/32, 32 Ks4]
        "w2_weight_scale": ((2, 8, 128), torch.uint8),
        "w13_bias": ((2, 128), torch.float32),
        "w2_bias": ((2, 96), torch.float32),
    }


def test_layer_metadata_by_hand():
    meta = LAYOUT.layer_metadata(layer(2, 96, 64), MXFP4Scheme())
    assert meta["triton_kernels_api"] == "3.5.1"
    assert meta["w13_row_order"] == "interleaved"
    assert meta["vllm_backends"] == ["TRITON", "TRITON_UNFUSED"]
    assert meta["opt_flags_constraints"] == {"split_k": 1}
    assert meta["w13"] == {
        "n": 128, "k": 96,
        "logical_shape": [2, 96, 128],
        "value_layout": {"name": "HOPPER_VALUE", "shape": [2, 48, 128], "mx_axis": 1, "mma_version": 3},
        "value_storage_shape": [2, 256, 32],
        "scale_shape": [2, 4, 128],
        "scale_layout": {"name": "HOPPER_SCALE", "shape": [2, 4, 128], "mx_axis": 1, "num_warps": 8},
        "scale_storage_shape": [2, 128, 8],
        "padded": {"n_value": 128, "kb_value": 64, "n_scale": 256, "scale_groups": 4},
    }
    assert meta["w2"]["logical_shape"] == [2, 64, 96]
    assert meta["w2"]["value_layout"]["shape"] == [2, 32, 96]
    assert meta["w2"]["scale_layout"]["shape"] == [2, 4, 96]
    silu = LAYOUT.layer_metadata(layer(2, 96, 64, activation="silu"), MXFP4Scheme())
    assert silu["w13_row_order"] == "gate_up" and silu["vllm_backends"] == ["TRITON_UNFUSED"]


# ---------------------------------------------------------------------------------------------------
# round trip and padding

ROUND_TRIP = [
    (E, H, I, bias, act)
    for E in (1, 3)
    for H, I in ((32, 64), (64, 64), (96, 128), (128, 192), (288, 64))
    for bias, act in ((False, "swigluoai"), (True, "swigluoai"), (True, "silu"))
]


@pytest.mark.parametrize("E,H,I,bias,act", ROUND_TRIP)
def test_decode_encode_is_identity(E, H, I, bias, act):
    shape = layer(E, H, I, bias=bias, activation=act)
    block = mxfp4_block(E, H, I, bias=bias, seed=E * 1000 + H + I)
    out = LAYOUT.encode(block, shape)
    back = LAYOUT.decode(out, shape, MXFP4Scheme())
    assert LAYOUT.expected_block(block, shape).differences(back) == []
    assert back.w13_bias is None or back.w13_bias.dtype == torch.float32


def test_round_trip_of_a_gpt_oss_sized_hidden():
    shape = layer(1, 2880, 64, bias=True)  # K/32 = 90 -> 92 for w13, w2 N = 2880 -> 3072 for scales
    block = mxfp4_block(1, 2880, 64, bias=True, seed=3)
    assert LAYOUT.expected_block(block, shape).differences(LAYOUT.decode(LAYOUT.encode(block, shape), shape,
                                                                         MXFP4Scheme())) == []


@pytest.mark.parametrize("H,I", [(32, 64), (96, 128), (288, 192)])
def test_padding_is_zero_and_no_bit_is_lost(H, I):
    """The value swizzle moves bits, never changes them: set bits of the buffer == set bits of the
    block; the scale buffer holds the scale bytes and zeros."""
    block = mxfp4_block(2, H, I, seed=7, codes=(1, 256), scales=(1, 256))
    out = LAYOUT.encode(block, layer(2, H, I))

    def popcount(t):
        return sum(int(((t >> b) & 1).sum()) for b in range(8))

    for name in ("w13", "w2"):
        assert popcount(out[f"{name}_weight"]) == popcount(getattr(block, name))
        s, src = out[f"{name}_weight_scale"], getattr(block, f"{name}_scale")
        assert int((s != 0).sum()) == src.numel()
        assert torch.equal(s[s != 0].sort().values, src.flatten().sort().values)


def test_decode_drops_storage_padding():
    p = torch.randint(0, 256, (2, 40, 24), dtype=torch.uint8)  # N 40 -> 48, Kb 24 -> 32
    assert torch.equal(unswizzle_values(swizzle_values(p), 40, 48), p)
    s = torch.randint(0, 256, (2, 40, 3), dtype=torch.uint8)  # N 40 -> 256, 3 -> 4
    assert torch.equal(unswizzle_scales(swizzle_scales(s), 40, 96), s)


# ---------------------------------------------------------------------------------------------------
# constraints


def test_check_passes_a_good_layer():
    assert LAYOUT.check(layer(4, 2880, 2880), MXFP4Scheme()) == []
    assert LAYOUT.check(layer(4, 2048, 768, activation="silu"), MXFP4Scheme()) == []


def test_check_lists_every_violation():
    problems = LAYOUT.check(layer(0, 48, 96, activation="gelu"), MXFP4Scheme())
    assert len(problems) == 4, problems
    assert "hidden_size H = 48" in problems[0] and "32" in problems[0]
    assert "intermediate_size per TP rank = 96" in problems[1] and "64" in problems[1]
    assert "activation 'gelu'" in problems[2]
    assert "num_experts = 0" in problems[3]


def test_warnings():
    assert LAYOUT.warnings(layer(1, 64, 64), MXFP4Scheme()) == []
    (w,) = LAYOUT.warnings(layer(1, 64, 64, activation="silu"), MXFP4Scheme())
    assert "triton_unfused" in w
    (w,) = LAYOUT.warnings(layer(1, 64, 64, dtype="float16"), MXFP4Scheme())
    assert "bfloat16" in w


# ---------------------------------------------------------------------------------------------------
# oracles: triton_kernels' own swizzle, and vLLM's _swizzle_mxfp4, on CPU


def _extract(wheel: Path, prefix: str) -> Path:
    """Unpack ``prefix`` (a folder named triton_kernels) of a wheel; returns the folder holding it."""
    out = Path(tempfile.mkdtemp(prefix="moeconvert-tk-"))
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(prefix):
                zf.extract(name, out)
    return out / Path(prefix).parent


def _triton_kernels_root() -> Path | None:
    """The folder that holds a ``triton_kernels`` package with the Hopper MX layouts."""
    candidates = []
    src = os.environ.get("MOECONVERT_TRITON_KERNELS_SRC")
    if src:
        path = Path(src)
        if path.is_file():
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
            prefix = next((n.split("triton_kernels/")[0] + "triton_kernels/" for n in names
                           if n.endswith("triton_kernels/tensor_details/layout_details/hopper_value.py")), None)
            if prefix is None:
                return None
            return _extract(path, prefix)
        candidates += [path.parent if path.name == "triton_kernels" else path, path / "vllm" / "third_party",
                       path / "third_party"]
    else:
        vllm = package_location(VLLM_SRC, "vllm")  # a wheel or the package folder
        if vllm is not None and vllm.is_file():
            return _extract(vllm, "vllm/third_party/triton_kernels/")
        if vllm is not None:
            candidates.append(vllm / "third_party")
        spec = importlib.util.find_spec("triton_kernels")
        if spec is not None and spec.submodule_search_locations:
            candidates.append(Path(list(spec.submodule_search_locations)[0]).parent)
    for c in candidates:
        if (c / "triton_kernels" / "tensor_details" / "layout_details" / "hopper_value.py").is_file():
            return c
    return None


@functools.lru_cache(maxsize=1)
def triton_kernels():
    """triton_kernels' tensor + layout modules (pure torch for the swizzles), or skip."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    root = _triton_kernels_root()
    if root is None:
        pytest.skip("triton_kernels with HopperMXValueLayout not found: set MOECONVERT_TRITON_KERNELS_SRC to a folder "
                    "holding triton_kernels/ (e.g. vllm-0.33.0's vllm/third_party) or to the vllm-0.33.0 wheel")
    loaded = sys.modules.get("triton_kernels")
    if loaded is not None and Path(loaded.__file__).parent.parent.resolve() != root.resolve():
        pytest.skip(f"another triton_kernels is imported already ({loaded.__file__})")
    sys.path.insert(0, str(root))
    try:
        tensor = importlib.import_module("triton_kernels.tensor")
        layout = importlib.import_module("triton_kernels.tensor_details.layout")
    finally:
        sys.path.remove(str(root))
    files = [root / "triton_kernels" / "tensor_details" / "layout_details" / f for f in ("hopper_value.py",
                                                                                          "hopper_scale.py")]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    print(f"\ntriton_kernels from {root} (hopper_value.py + hopper_scale.py sha256 {digest})")
    return types.SimpleNamespace(tensor=tensor, layout=layout, root=root, digest=digest)


def tk_swizzle(packed, scales):
    """What §6.4 says vLLM does, with triton_kernels' own objects: transposed views wrapped, scale K/32
    padded to 4, then ``convert_layout`` to the Hopper layouts (num_warps=8, mx_axis=1)."""
    tk = triton_kernels()
    w = tk.tensor.convert_layout(tk.tensor.wrap_torch_tensor(packed.transpose(-2, -1), dtype=tk.tensor.FP4),
                                 tk.layout.HopperMXValueLayout, mx_axis=1)
    padded = torch.nn.functional.pad(scales, (0, -scales.shape[-1] % 4))
    s = tk.tensor.convert_layout(tk.tensor.wrap_torch_tensor(padded.transpose(-2, -1)),
                                 tk.layout.HopperMXScaleLayout, mx_axis=1, num_warps=8)
    return w, s


ORACLE_SIZES = [(2, 32, 128), (1, 48, 192), (2, 256, 256), (1, 40, 2880), (1, 300, 96), (3, 128, 32),
                (1, 16, 64), (2, 520, 160), (1, 8, 32), (2, 5760, 64)]


@pytest.mark.parametrize("E,N,K", ORACLE_SIZES)
def test_bytes_equal_triton_kernels_convert_layout(E, N, K):
    gen = torch.Generator().manual_seed(N + K)
    packed = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (E, N, K // 32), generator=gen, dtype=torch.uint8)
    w, s = tk_swizzle(packed, scales)
    # the engine holds the .mT view of a contiguous buffer: ours
    assert w.storage.data.mT.is_contiguous() and s.storage.data.mT.is_contiguous()
    assert torch.equal(w.storage.data.mT, swizzle_values(packed))
    assert torch.equal(s.storage.data.mT, swizzle_scales(scales))
    # and the library's own unswizzle of our bytes gives the canonical tensors back
    ours_w = swizzle_values(packed).mT
    assert torch.equal(w.storage.layout.unswizzle_data(ours_w), packed.transpose(-2, -1))
    ours_s = swizzle_scales(scales).mT
    assert torch.equal(s.storage.layout.unswizzle_data(ours_s)[:, :K // 32, :N], scales.transpose(-2, -1))


def test_metadata_equals_the_objects_triton_kernels_builds():
    E, H, I = 2, 96, 64
    shape = layer(E, H, I)
    block = mxfp4_block(E, H, I)
    meta = LAYOUT.layer_metadata(shape, MXFP4Scheme())
    rows = interleave_gate_up
    for name, packed, scales in (("w13", rows(block.w13), rows(block.w13_scale)), ("w2", block.w2, block.w2_scale)):
        w, s = tk_swizzle(packed, scales)
        m = meta[name]
        assert list(w.shape) == m["logical_shape"] and list(w.shape_max) == m["logical_shape"]
        assert w.dtype == triton_kernels().tensor.FP4
        vl = w.storage.layout
        assert (vl.name, list(vl.initial_shape), vl.mx_axis, vl.mma_version) == (
            m["value_layout"]["name"], m["value_layout"]["shape"], m["value_layout"]["mx_axis"],
            m["value_layout"]["mma_version"])
        assert list(w.storage.data.shape) == m["value_storage_shape"]
        sl = s.storage.layout
        assert (sl.name, list(sl.initial_shape), sl.mx_axis, sl.num_warps) == (
            m["scale_layout"]["name"], m["scale_layout"]["shape"], m["scale_layout"]["mx_axis"],
            m["scale_layout"]["num_warps"])
        assert list(s.shape) == m["scale_shape"] and list(s.storage.data.shape) == m["scale_storage_shape"]


def test_loader_recipe_rebuilds_the_objects_without_moving_data():
    """docs/layouts/triton-mxfp4.md's recipe, on our encoded tensors, gives what convert_layout gives."""
    tk = triton_kernels()
    E, H, I = 3, 64, 128
    shape = layer(E, H, I)
    block = mxfp4_block(E, H, I, seed=4)
    out = LAYOUT.encode(block, shape)
    meta = LAYOUT.layer_metadata(shape, MXFP4Scheme())
    for name, packed, scales in (("w13", interleave_gate_up(block.w13), interleave_gate_up(block.w13_scale)),
                                 ("w2", block.w2, block.w2_scale)):
        m, buf, sbuf = meta[name], out[f"{name}_weight"], out[f"{name}_weight_scale"]
        vl, sl = m["value_layout"], m["scale_layout"]
        w = tk.tensor.Tensor(
            tk.tensor.Storage(buf.mT, tk.layout.HopperMXValueLayout(vl["shape"], mx_axis=vl["mx_axis"],
                                                                    mma_version=vl["mma_version"])),
            dtype=tk.tensor.FP4, shape=m["logical_shape"], shape_max=m["logical_shape"])
        s = tk.tensor.Tensor(
            tk.tensor.Storage(sbuf.mT, tk.layout.HopperMXScaleLayout(sl["shape"], mx_axis=sl["mx_axis"],
                                                                     num_warps=sl["num_warps"])),
            dtype=torch.uint8, shape=m["scale_shape"])
        assert w.storage.data.data_ptr() == buf.data_ptr() and s.storage.data.data_ptr() == sbuf.data_ptr()
        ref_w, ref_s = tk_swizzle(packed, scales)
        for ours, ref in ((w, ref_w), (s, ref_s)):
            assert ours.shape == ref.shape and ours.dtype == ref.dtype
            assert ours.storage.data.stride() == ref.storage.data.stride()
            assert torch.equal(ours.storage.data, ref.storage.data)
            assert ours.storage.layout.name == ref.storage.layout.name


#: the triton_kernels files whose code the swizzles run (tensor + layouts)
_TK_LAYOUT_FILES = ("tensor.py", "tensor_details/layout.py", "tensor_details/layout_details/base.py",
                    "tensor_details/layout_details/hopper_value.py", "tensor_details/layout_details/hopper_scale.py")


def _triton_kernels_digest(read) -> str:
    return hashlib.sha256("".join(read(rel) for rel in _TK_LAYOUT_FILES).encode()).hexdigest()


_VLLM_STUB_FUNCTIONS = {
    "model_executor/layers/quantization/utils/mxfp4_utils.py": ["_swizzle_mxfp4"],
    "model_executor/layers/fused_moe/oracle/mxfp4.py": ["_interleave_gate_up_rows"],
}


@contextlib.contextmanager
def _as_hopper(tk):
    """triton_kernels' default-layout helpers believe they run on an SM90 GPU; opt-flag constraints
    (which vLLM sets process-wide) are put back afterwards."""
    layout = tk.layout
    opt_flags = importlib.import_module("triton_kernels.matmul_ogs_details.opt_flags")
    saved = (layout.cuda_capability_geq, layout.is_hip_cdna4, dict(opt_flags._opt_flags_constraints))
    layout.cuda_capability_geq = lambda major, minor=0: (9, 0) >= (major, minor)
    layout.is_hip_cdna4 = lambda: False
    try:
        yield opt_flags
    finally:
        layout.cuda_capability_geq, layout.is_hip_cdna4 = saved[0], saved[1]
        opt_flags._opt_flags_constraints.clear()
        opt_flags._opt_flags_constraints.update(saved[2])


@functools.lru_cache(maxsize=None)
def vllm_swizzle(version: str):
    """vLLM ``version``'s own ``_swizzle_mxfp4`` (and ``_interleave_gate_up_rows``), lifted out with ast and
    run as on an H200: CUDA, capability 9.0, torch >= 2.8.1, the triton_kernels that version vendors
    ("3.5.1"; the same files in 0.33.0 and 0.34.0, checked here against the copy imported)."""
    tk = triton_kernels()
    read = vllm_reader(version)
    vendored = _triton_kernels_digest(lambda rel: read(f"third_party/triton_kernels/{rel}"))
    if vendored != _triton_kernels_digest(lambda rel: (tk.root / "triton_kernels" / rel).read_text()):
        pytest.skip(f"vLLM {version} vendors other triton_kernels layout files than those imported from {tk.root}: "
                    f"set MOECONVERT_TRITON_KERNELS_SRC to that version's wheel and run this version alone")
    platform = types.SimpleNamespace(
        is_cuda=lambda: True, is_rocm=lambda: False, is_device_capability=lambda cap: cap == 90,
        is_device_capability_family=lambda cap: False)
    ns = {"torch": torch, "Any": object, "current_platform": platform, "has_triton_kernels": lambda: True,
          "get_triton_kernels_version": lambda: "3.5.1", "is_torch_equal_or_newer": lambda v: True,
          "should_use_gfx1250_mx_scale_swizzle": lambda: False, "should_use_cdna4_mx_scale_swizzle": lambda: False,
          "logger": types.SimpleNamespace(warning_once=lambda *a, **k: None)}
    for path, names in _VLLM_STUB_FUNCTIONS.items():
        lift(read, path, names, ns)

    def swizzle(w, s):
        sys.path.insert(0, str(tk.root))
        try:
            with _as_hopper(tk) as opt_flags:
                out = ns["_swizzle_mxfp4"](w, s)
                constraints = dict(opt_flags._opt_flags_constraints)
        finally:
            sys.path.remove(str(tk.root))
        return out, constraints

    return types.SimpleNamespace(swizzle=swizzle, interleave=ns["_interleave_gate_up_rows"])


@pytest.mark.parametrize("E,H,I,bias", [(2, 64, 64, True), (1, 96, 128, False), (3, 2880, 64, True)])
def test_layer_bytes_equal_vllm_gpt_oss_triton_path(E, H, I, bias, vllm_version):
    """vLLM's gpt-oss checkpoint path to TRITON (convert_gpt_oss_weight_to_mxfp4_moe_kernel_format): the
    checkpoint's interleaved rows, biases cast to fp32, then ``_swizzle_mxfp4`` of each weight."""
    ref = vllm_swizzle(vllm_version)
    shape = layer(E, H, I, bias=bias)
    block = mxfp4_block(E, H, I, bias=bias, seed=H + I)
    ours = LAYOUT.encode(block, shape)
    # the gpt-oss checkpoint holds w13 interleaved: vLLM's own interleave of our [gate; up]
    ckpt = {k: ref.interleave(getattr(block, k)) for k in ("w13", "w13_scale")}
    for name, w, s in (("w13", ckpt["w13"], ckpt["w13_scale"]), ("w2", block.w2, block.w2_scale)):
        (tw, flex, ts), constraints = ref.swizzle(w, s)
        assert constraints == {"split_k": 1}
        assert torch.equal(tw.storage.data.mT, ours[f"{name}_weight"]), name
        assert torch.equal(ts.storage.data.mT, ours[f"{name}_weight_scale"]), name
        meta = LAYOUT.layer_metadata(shape, MXFP4Scheme())[name]
        assert list(tw.shape) == meta["logical_shape"] and list(ts.shape) == meta["scale_shape"]
    if bias:
        b13 = ref.interleave(block.w13_bias.unsqueeze(-1)).squeeze(-1).to(torch.float32)
        assert torch.equal(ours["w13_bias"], b13)
        assert torch.equal(ours["w2_bias"], block.w2_bias.to(torch.float32))


def test_our_interleave_is_vllms(vllm_version):
    ref = vllm_swizzle(vllm_version)
    x = torch.randint(0, 256, (2, 128, 5), dtype=torch.uint8)
    assert torch.equal(interleave_gate_up(x), ref.interleave(x))


# ---------------------------------------------------------------------------------------------------
# GPU: triton_kernels' matmul_ogs (the consumer) on our bytes, rebuilt by the loader recipe


def _dequant(packed, scales):
    from moeconvert.mxfp4 import dequantize_mxfp4

    return dequantize_mxfp4(packed, scales)


@functools.lru_cache(maxsize=1)
def _matmul_ogs():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 (Hopper) GPU")
    tk = triton_kernels()
    sys.path.insert(0, str(tk.root))
    try:
        mo = importlib.import_module("triton_kernels.matmul_ogs")
        opt_flags = importlib.import_module("triton_kernels.matmul_ogs_details.opt_flags")
        numerics = importlib.import_module("triton_kernels.numerics")
        swiglu = importlib.import_module("triton_kernels.swiglu")
    finally:
        sys.path.remove(str(tk.root))
    opt_flags.update_opt_flags_constraints({"split_k": 1})  # as vLLM does on SM90 (layer_metadata)
    return types.SimpleNamespace(tk=tk, mo=mo, numerics=numerics, swiglu=swiglu)


def rebuild(out, meta, name, dev):
    """The loader recipe (docs/layouts/triton-mxfp4.md)."""
    k = _matmul_ogs()
    T, L = k.tk.tensor, k.tk.layout
    m, vl, sl = meta[name], meta[name]["value_layout"], meta[name]["scale_layout"]
    buf, sbuf = out[f"{name}_weight"].to(dev), out[f"{name}_weight_scale"].to(dev)
    w = T.Tensor(T.Storage(buf.mT, L.HopperMXValueLayout(vl["shape"], mx_axis=vl["mx_axis"],
                                                         mma_version=vl["mma_version"])),
                 dtype=T.FP4, shape=m["logical_shape"], shape_max=m["logical_shape"])
    s = T.Tensor(T.Storage(sbuf.mT, L.HopperMXScaleLayout(sl["shape"], mx_axis=sl["mx_axis"],
                                                          num_warps=sl["num_warps"])),
                 dtype=torch.uint8, shape=m["scale_shape"])
    pc = k.mo.PrecisionConfig(weight_scale=s, flex_ctx=k.mo.FlexCtx(rhs_data=k.numerics.InFlexData()))
    return w, pc


def _small_scales(block):
    """Scale bytes near 127 so products stay in a sane range for the bf16 comparison."""
    for name in ("w13_scale", "w2_scale"):
        t = getattr(block, name)
        t.copy_(torch.randint(118, 124, t.shape, dtype=torch.uint8))
    return block


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,bias", [(2, 256, 128, True), (3, 2880, 192, True), (1, 192, 128, False)])
def test_matmul_ogs_computes_right_on_our_bytes(E, H, I, bias):
    k = _matmul_ogs()
    dev = "cuda"
    shape = layer(E, H, I, bias=bias)
    block = _small_scales(mxfp4_block(E, H, I, bias=bias, seed=11))
    out = LAYOUT.encode(block, shape)
    meta = LAYOUT.layer_metadata(shape, MXFP4Scheme())
    M = 64
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(E, M, H, device=dev, generator=gen).to(torch.bfloat16)
    w13, pc13 = rebuild(out, meta, "w13", dev)
    w2, pc2 = rebuild(out, meta, "w2", dev)
    b13 = out["w13_bias"].to(dev) if bias else None
    b2 = out["w2_bias"].to(dev) if bias else None

    # GEMM1 (plain), in the kernel's row order, against dequantize-then-matmul of the canonical block
    y1 = k.mo.matmul_ogs(x, w13, b13, precision_config=pc13)
    W13 = _dequant(interleave_gate_up(block.w13), interleave_gate_up(block.w13_scale)).to(dev)
    ref1 = torch.einsum("emk,enk->emn", x.float(), W13)
    if bias:
        ref1 += out["w13_bias"].to(dev)[:, None, :]
    err1 = rel(y1, ref1)

    # GEMM1 with the fused swiglu epilogue (what TRITON runs): it pairs even/odd columns = gate/up
    alpha, limit = 1.702, 7.0
    act = k.mo.FusedActivation(k.mo.FnSpecs("swiglu", k.swiglu.swiglu_fn, ("alpha", "limit")), (alpha, limit), 2)
    ya = k.mo.matmul_ogs(x, w13, b13, precision_config=pc13, fused_activation=act)
    gate, up = ref1[..., 0::2].clamp(max=limit), ref1[..., 1::2].clamp(-limit, limit)
    ref_act = gate * torch.sigmoid(alpha * gate) * (up + 1)
    erra = rel(ya, ref_act)

    # GEMM2
    a = ya.to(torch.bfloat16)
    y2 = k.mo.matmul_ogs(a, w2, b2, precision_config=pc2)
    W2 = _dequant(block.w2, block.w2_scale).to(dev)
    ref2 = torch.einsum("emk,enk->emn", a.float(), W2)
    if bias:
        ref2 += out["w2_bias"].to(dev)[:, None, :]
    err2 = rel(y2, ref2)
    print(f"\ntriton matmul_ogs E{E} H{H} I{I} bias={bias}: rel err gemm1 {err1:.2e} swiglu {erra:.2e} gemm2 {err2:.2e}")
    assert max(err1, erra, err2) < 2e-2
