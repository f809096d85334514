"""The ``flashinfer-trtllm`` WNA16 layout: what FlashInfer's TRT-LLM MxInt4 MoE kernel reads, as vLLM
0.33.0 prepares it (docs/layouts/flashinfer-trtllm.md).

Proved four ways: the spec's vectors (§7.3 item 6, written out by hand from the spec text), the
spec's closed forms read back out of our bytes (nibbles, row order, 128x4 scale offsets), an
end-to-end repack + verify of a real compressed-tensors checkpoint and, when their sources are at hand,
vLLM's own ``prepare_static_weights_for_trtllm_mxint4_moe`` run with FlashInfer's own helpers
(MOECONVERT_VLLM_SRC, MOECONVERT_FLASHINFER_SRC). decode(encode(x)) == x, plan == what encode writes,
streaming by chunks and the refusals every layout owes are tests/test_layout_contract.py.
"""

from __future__ import annotations

import ast
import ctypes
import json
import re
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts.flashinfer_trtllm import (
    FlashInferTrtllmWNA16Layout,
    pack_signed_nibbles,
    shuffle_rows,
    swizzle_128x4,
    w13_rows,
)
from moeconvert.schemes import WNA16Scheme

from helpers import FLASHINFER_SRC, cli, lift, package_reader, package_version, same_bits, st_tensors, vllm_reader
from factories import wna16_block

LAYOUT = get_layout("flashinfer-trtllm", "wna16")
SCHEME = WNA16Scheme(bits=4, group_size=32, symmetric=True, scale_dtype="bfloat16")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def layer(E, H, I, **kw):
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, **kw)


# ---------------------------------------------------------------------------------------------------
# The spec's formulas, written out here (never taken from the module under test)


def spec_shuf(d: int) -> int:
    """§4 step 4: FlashInfer row d takes row shuf(d) (blocks of 32, epilogue_tile_m = 128)."""
    return 32 * (d // 32) + 4 * (d % 8) + (d % 32) // 8


def spec_gemm1_row(d: int) -> tuple[str, int]:
    """§4 step 4, 'net': GEMM1 row d is up row i if shuf(d) is even, else gate row i; i = shuf(d) >> 1."""
    j = spec_shuf(d)
    return ("up" if j % 2 == 0 else "gate", j >> 1)


def canonical_row(role: str, i: int, I: int) -> int:
    """Canonical w13 holds gate rows first, then up rows."""
    return i if role == "gate" else I + i


def spec_sf_offset(r: int, c: int, C: int) -> int:
    """§4 step 5: where entry (r, c) of a row-permuted [R, C] scale matrix lands in the flat output."""
    Cp = -(-C // 4) * 4
    return 512 * (c // 4) + 16 * (r % 32) + 4 * ((r % 128) // 32) + (c % 4) + (r // 128) * 128 * Cp


def spec_read_codes(packed: torch.Tensor, K: int) -> torch.Tensor:
    """One expert's ``[K/256, M, 128]`` bytes -> unsigned codes ``u[m, k]`` by §4's table: byte [b, d, j]
    holds k = 256b + 2j in its low nibble and k + 1 in its high nibble, as (u - 8) & 0xF."""
    k = torch.arange(K)
    b, j, high = k // 256, (k % 256) // 2, k % 2
    byte = packed[b, :, j].to(torch.int64)  # [K, M]
    nibble = (byte >> (4 * high)[:, None]) & 0xF
    return ((nibble + 8) & 0xF).T.to(torch.uint8)


def spec_read_scales(flat: torch.Tensor, R: int, C: int) -> torch.Tensor:
    """One expert's flat swizzled scales -> the row-permuted ``[R, C]`` matrix, by the §4.5 offsets."""
    offsets = torch.tensor([[spec_sf_offset(r, c, C) for c in range(C)] for r in range(R)])
    return flat[offsets]


# ---------------------------------------------------------------------------------------------------
# §7.3 item 6 (a): GEMM1 row sequence; the spec's text, expanded by hand

SPEC_GEMM1_ROWS_0_32 = (
    [("up", i) for i in (0, 2, 4, 6, 8, 10, 12, 14)]  # d = 0..7
    + [("gate", i) for i in (0, 2, 4, 6, 8, 10, 12, 14)]  # d = 8..15
    + [("up", i) for i in (1, 3, 5, 7, 9, 11, 13, 15)]  # d = 16..23
    + [("gate", i) for i in (1, 3, 5, 7, 9, 11, 13, 15)]  # d = 24..31
    + [("up", 16)]  # d = 32
)


def test_spec_formula_reproduces_the_spec_sequence():
    # the test's own reading of §4 agrees with the sequence the spec prints
    assert [spec_gemm1_row(d) for d in range(33)] == SPEC_GEMM1_ROWS_0_32


def test_gemm1_row_sequence_equals_spec():
    I = 256
    assert w13_rows(I)[:33].tolist() == [canonical_row(role, i, I) for role, i in SPEC_GEMM1_ROWS_0_32]


def test_gemm1_row_sequence_is_in_the_bytes():
    # every canonical row r carries its own number in its first three codes; read them back by §4's table
    E, H, I = 1, 256, 256
    block = wna16_block(E, H, I)
    r = torch.arange(2 * I).view(-1, 1)
    k = torch.arange(H).view(1, -1)
    block.w13 = ((r >> (4 * (k % 3))) & 0xF).to(torch.uint8)[None]
    u = spec_read_codes(LAYOUT.encode(block, layer(E, H, I))["w13_weight_packed"][0], H)
    held = (u[:, 0].long() | u[:, 1].long() << 4 | u[:, 2].long() << 8).tolist()
    assert held[:33] == [canonical_row(role, i, I) for role, i in SPEC_GEMM1_ROWS_0_32]
    assert held == [canonical_row(*spec_gemm1_row(d), I) for d in range(2 * I)]


# (b): the first 40 composed indices for 2I = 256, into the swapped [up; gate] tensor, as the spec
# prints them ("0,2,4,…,14,128,130,…,142,1,3,…,15,129,…,143,16,18,…"), expanded by hand
SPEC_COMPOSED_2I_256 = [
    0, 2, 4, 6, 8, 10, 12, 14,
    128, 130, 132, 134, 136, 138, 140, 142,
    1, 3, 5, 7, 9, 11, 13, 15,
    129, 131, 133, 135, 137, 139, 141, 143,
    16, 18, 20, 22, 24, 26, 28, 30,
]


def swapped_to_canonical(j: int, I: int) -> int:
    """Row j of vLLM's swapped [up; gate] w13 (§4 step 2) as a row of canonical [gate; up]."""
    return I + j if j < I else j - I


def test_composed_w13_index_equals_spec_for_2i_256():
    I = 128
    assert w13_rows(I)[:40].tolist() == [swapped_to_canonical(j, I) for j in SPEC_COMPOSED_2I_256]


def test_w2_rows_are_the_shuffle_alone():
    for H in (256, 512):
        assert shuffle_rows(H).tolist() == [spec_shuf(d) for d in range(H)]
    assert shuffle_rows(32).tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29,
                                          2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31]


# (c): unswizzle by the §4.5 formula, invert the row perms, get the checkpoint scales back exactly


@pytest.mark.parametrize("H,I", [(256, 256), (512, 256), (256, 512)])
def test_unswizzled_scales_with_rows_undone_equal_the_checkpoint_scales(H, I):
    E = 2
    block = wna16_block(E, H, I, seed=H + I)
    t = LAYOUT.encode(block, layer(E, H, I))
    for e in range(E):
        s13 = spec_read_scales(t["w13_weight_scale"][e], 2 * I, H // 32)
        back13 = torch.empty_like(s13)
        back13[[canonical_row(*spec_gemm1_row(d), I) for d in range(2 * I)]] = s13
        assert torch.equal(back13.view(torch.int16), block.w13_scale[e].view(torch.int16))
        s2 = spec_read_scales(t["w2_weight_scale"][e], H, I // 32)
        back2 = torch.empty_like(s2)
        back2[[spec_shuf(d) for d in range(H)]] = s2
        assert torch.equal(back2.view(torch.int16), block.w2_scale[e].view(torch.int16))


def test_swizzle_puts_each_entry_at_the_spec_offset():
    R, C = 256, 8
    ids = torch.arange(R * C, dtype=torch.int64).view(1, R, C)
    flat = swizzle_128x4(ids)[0]
    where = torch.empty(R * C, dtype=torch.int64)
    where[flat] = torch.arange(R * C)
    assert where.tolist() == [spec_sf_offset(r, c, C) for r in range(R) for c in range(C)]
    # two hand-computed offsets: (1, 0) -> 16; (32, 5) -> 512 + 4 + 1
    assert int(flat[16]) == 1 * C + 0 and int(flat[517]) == 32 * C + 5


# (d): shapes


def test_shapes_equal_spec_for_e2_h256_i256():
    shape, block = layer(2, 256, 256), wna16_block(2, 256, 256)
    expected = {
        "w13_weight_packed": ((2, 1, 512, 128), torch.uint8),
        "w13_weight_scale": ((2, 4096), torch.bfloat16),
        "w2_weight_packed": ((2, 1, 256, 128), torch.uint8),
        "w2_weight_scale": ((2, 2048), torch.bfloat16),
    }
    planned = {s.suffix: (s.shape, s.dtype) for s in LAYOUT.plan(shape, block.scheme)}
    encoded = {k: (tuple(v.shape), v.dtype) for k, v in LAYOUT.encode(block, shape).items()}
    assert planned == expected and encoded == expected
    assert [s.suffix for s in LAYOUT.plan(shape, block.scheme)] == list(expected)


def test_plan_for_a_larger_layer():
    specs = LAYOUT.plan(layer(3, 1024, 768), SCHEME)
    assert [(s.suffix, s.shape, s.dtype) for s in specs] == [
        ("w13_weight_packed", (3, 4, 1536, 128), torch.uint8),
        ("w13_weight_scale", (3, 1536 * 32), torch.bfloat16),
        ("w2_weight_packed", (3, 3, 1024, 128), torch.uint8),
        ("w2_weight_scale", (3, 1024 * 24), torch.bfloat16),
    ]


# ---------------------------------------------------------------------------------------------------
# weights read back with the spec's rules


def test_signed_nibbles_by_hand():
    # u = 0, 15 -> s = 8, 7 -> byte 0x78; u = 8, 7 -> s = 0, 15 -> byte 0xf0
    assert pack_signed_nibbles(torch.tensor([[0, 15, 8, 7]], dtype=torch.uint8)).tolist() == [[0x78, 0xF0]]


@pytest.mark.parametrize("H,I", [(256, 256), (512, 256), (256, 512)])
def test_every_code_is_where_the_spec_says(H, I):
    E = 2
    block = wna16_block(E, H, I, seed=3 * H + I)
    t = LAYOUT.encode(block, layer(E, H, I))
    src13 = [canonical_row(*spec_gemm1_row(d), I) for d in range(2 * I)]
    src2 = [spec_shuf(d) for d in range(H)]
    for e in range(E):
        assert torch.equal(spec_read_codes(t["w13_weight_packed"][e], H), block.w13[e, src13])
        assert torch.equal(spec_read_codes(t["w2_weight_packed"][e], I), block.w2[e, src2])


def test_weight_bytes_are_the_checkpoint_words_xor_0x88888888():
    # §4 steps 1 and 3 on compressed-tensors' own packing: each FlashInfer row is a checkpoint row's
    # int32 words with every nibble flipped by 8, read as little-endian bytes, cut in 128-byte blocks
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    E, H, I = 1, 512, 256
    block = wna16_block(E, H, I, seed=9)
    words = pack_to_int32((block.w13[0].to(torch.int16) - 8).to(torch.int8), 4, packed_dim=1)  # [2I, H/8]
    flipped = (words.to(torch.int64) ^ 0x88888888).to(torch.int64)
    flipped = torch.where(flipped >= 2**31, flipped - 2**32, flipped).to(torch.int32)
    row_bytes = flipped.contiguous().view(torch.uint8)  # [2I, H/2], little-endian
    packed = LAYOUT.encode(block, layer(E, H, I))["w13_weight_packed"][0]  # [H/256, 2I, 128]
    for d in (0, 1, 8, 31, 32, 200, 2 * I - 1):
        src = canonical_row(*spec_gemm1_row(d), I)
        assert torch.equal(packed[:, d, :].reshape(-1), row_bytes[src]), d


# ---------------------------------------------------------------------------------------------------
# extreme values, casting


def test_bfloat16_scales_need_no_cast():
    shape, block = layer(3, 256, 512), wna16_block(3, 256, 512, seed=5)
    assert LAYOUT.expected_block(block, shape).differences(block) == []


def test_decode_is_exact_on_every_code_and_extreme_scale():
    E, H, I = 1, 256, 256
    block = wna16_block(E, H, I)
    block.w13 = (torch.arange(2 * I * H) % 16).to(torch.uint8).view(1, 2 * I, H)
    block.w13_scale.view(torch.int16)[0, :4, 0] = torch.tensor([0x7F80, -0x80, 0x0001, -0x8000],
                                                                 dtype=torch.int16)  # inf, -inf, subnormal, -0
    shape = layer(E, H, I)
    assert LAYOUT.decode(LAYOUT.encode(block, shape), shape, block.scheme).differences(block) == []


@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
def test_scales_are_cast_to_bfloat16_like_vllms_loader(scale_dtype):
    E, H, I = 2, 256, 256
    shape, block = layer(E, H, I), wna16_block(E, H, I, scale_dtype=scale_dtype, seed=4)
    if scale_dtype == "float32":
        block.w13_scale[0, :3, 0] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # ties
    decoded = LAYOUT.decode(LAYOUT.encode(block, shape), shape, block.scheme)
    assert decoded.w13_scale.dtype == torch.bfloat16
    for name in ("w13_scale", "w2_scale"):
        param = torch.empty(getattr(block, name).shape, dtype=torch.bfloat16)
        assert torch.equal(getattr(decoded, name), param.copy_(getattr(block, name))), name  # the loader's way
    if scale_dtype == "float32":
        assert decoded.w13_scale[0, :3, 0].tolist() == [1.0, 1 + 2**-6, -1.0]  # round to nearest even
    assert decoded.differences(block)  # not the source's dtype ...
    assert LAYOUT.expected_block(block, shape).differences(decoded) == []  # ... but what verify expects
    assert any("cast to bfloat16" in w for w in LAYOUT.warnings(shape, block.scheme))


# ---------------------------------------------------------------------------------------------------
# check, registry, warnings


def test_check_reports_every_violated_constraint_at_once():
    four = LAYOUT.check(layer(2, 384, 256), WNA16Scheme(8, 128, False, "bfloat16"))
    assert len(four) == 4, four
    text = "\n".join(four)
    for needle in ("bits = 8", "zero points", "group_size = 128", "hidden_size H = 384 must be a multiple of 256"):
        assert needle in text
    every = LAYOUT.check(layer(2, 200, 100, has_bias=True, activation="gelu", dtype="float16"),
                         WNA16Scheme(8, -1, False, "float32"))
    assert len(every) == 8, every
    text = "\n".join(every)
    for needle in ("bits = 8", "zero points", "channelwise", "model dtype = float16", "expert bias",
                   "activation = gelu", "hidden_size H = 200", "intermediate_size I = 100 (per TP partition)"):
        assert needle in text
    assert LAYOUT.check(layer(2, 256, 256), SCHEME) == []
    assert LAYOUT.check(layer(2, 256, 256, activation="swigluoai"), SCHEME) == []
    assert LAYOUT.check(layer(2, 256, 256), WNA16Scheme(4, 32, True, "float32")) == []  # cast, like vLLM


@pytest.mark.parametrize("H,I", [(128, 256), (256, 128), (256, 384), (2048, 768 // 2)])  # last: Qwen3-30B-A3B at TP 2
def test_sizes_off_256_are_refused(H, I):
    problems = LAYOUT.check(layer(2, H, I), SCHEME)
    assert len(problems) == 1 and "multiple of 256" in problems[0]


def test_registered_for_wna16_under_the_backend_name():
    assert isinstance(LAYOUT, FlashInferTrtllmWNA16Layout)
    assert LAYOUT.name == "flashinfer-trtllm" and LAYOUT.schemes == ("wna16",) and LAYOUT.version == 1
    assert "trtllm_mxint4_block_scale_moe" in LAYOUT.kernel
    assert LAYOUT.made_for["vllm"] == ["0.33.0"] and LAYOUT.made_for["flashinfer"]


def test_warnings():
    assert LAYOUT.warnings(layer(2, 256, 256), SCHEME) == []
    (w,) = LAYOUT.warnings(layer(2, 256, 256, activation="swigluoai"), SCHEME)
    assert "gemm1_alpha" in w


# ---------------------------------------------------------------------------------------------------
# End to end: repack a real compressed-tensors checkpoint, verify it, read it back by the spec


def test_repack_and_verify_a_compressed_tensors_checkpoint(example_ckpt, tmp_path):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src = example_ckpt("qwen3-moe", "w4a16", group_size=32, hidden_size=256, intermediate_size=256, num_experts=4)
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "flashinfer-trtllm", expect=0)
    cli("verify", out, "--against", src, expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    assert manifest["layout"]["name"] == "flashinfer-trtllm" and manifest["layout"]["version"] == 1
    s, o = st_tensors(src), st_tensors(out)
    assert manifest["moe_layers"]
    for lay in manifest["moe_layers"]:
        p, E, H, I = lay["prefix"], lay["num_experts"], lay["hidden_size"], lay["intermediate_size"]
        assert (E, H, I) == (4, 256, 256)
        for e in range(E):
            def codes(role):  # compressed-tensors' own unpacking, signed -> unsigned
                w = s[f"{p}.{e}.{role}.weight_packed"]
                n, k = w.shape[0], w.shape[1] * 8
                return (unpack_from_int32(w, 4, torch.Size((n, k))).to(torch.int16) + 8).to(torch.uint8)

            def scales(role):
                return s[f"{p}.{e}.{role}.weight_scale"].to(torch.bfloat16).view(torch.int16)

            # GEMM1 row d holds (role, i) = spec_gemm1_row(d) of the source's gate_proj / up_proj
            rows13 = [spec_gemm1_row(d) for d in range(2 * I)]
            by_role = {"gate": (codes("gate_proj"), scales("gate_proj")), "up": (codes("up_proj"), scales("up_proj"))}
            want13 = torch.stack([by_role[role][0][i] for role, i in rows13])
            want_s13 = torch.stack([by_role[role][1][i] for role, i in rows13])
            assert torch.equal(spec_read_codes(o[f"{p}.w13_weight_packed"][e], H), want13), (p, e)
            s13 = spec_read_scales(o[f"{p}.w13_weight_scale"][e], 2 * I, H // 32)
            assert torch.equal(s13.view(torch.int16), want_s13), (p, e)
            down = codes("down_proj")
            g2 = spec_read_codes(o[f"{p}.w2_weight_packed"][e], I)
            s2 = spec_read_scales(o[f"{p}.w2_weight_scale"][e], H, I // 32)
            src2 = [spec_shuf(d) for d in range(H)]
            assert torch.equal(g2, down[src2])
            assert torch.equal(s2.view(torch.int16),
                               s[f"{p}.{e}.down_proj.weight_scale"][src2].to(torch.bfloat16).view(torch.int16))


def test_repack_refuses_what_the_kernel_cannot_take(example_ckpt, tmp_path):
    src = example_ckpt("qwen3-moe", "w4a16", group_size=32, hidden_size=256, intermediate_size=256, num_experts=4)
    # TP 2 leaves I = 128 per rank
    assert "multiple of 256" in cli("repack", src, tmp_path / "tp2", "--backend", "flashinfer-trtllm", "--tp-size", 2,
                                    expect=2).err
    assert not (tmp_path / "tp2").exists()
    g128 = example_ckpt("qwen3-moe", "w4a16", group_size=128, hidden_size=256, intermediate_size=256,
                        num_experts=4)
    assert "group_size = 128" in cli("repack", g128, tmp_path / "g128", "--backend", "flashinfer-trtllm", expect=2).err


# ---------------------------------------------------------------------------------------------------
# Oracle: vLLM 0.33.0's prepare_static_weights_for_trtllm_mxint4_moe, run with FlashInfer's own helpers
#
# Neither package is imported (both need CUDA builds): their functions are lifted out of their files
# with ast and run on CPU tensors. FlashInfer's block_scale_interleave is a compiled op; on CPU tensors
# it runs blockScaleInterleaveHost, whose offsets come from computeSFIndex in fp4Op.cpp. That function
# is compiled here from FlashInfer's own source and called through ctypes.


def _compile_sf_index(read, build_dir: Path):
    """FlashInfer's computeSFIndex (fp4Op.cpp) and PadUpFn (quantization.h), as a C function that
    fills the offsets of every (r, c) of the padded [rows, cols] scale matrix."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build FlashInfer's host computeSFIndex")
    csrc = "data/csrc/nv_internal/tensorrt_llm"
    fp4op = read(f"{csrc}/thop/fp4Op.cpp")
    func = re.search(r"^int computeSFIndex\(.*?^}\n", fp4op, re.S | re.M)
    padup = re.search(r"^#define PadUpFn\(.*$", read(f"{csrc}/kernels/quantization.h"), re.M)
    assert func and padup, "FlashInfer's computeSFIndex / PadUpFn moved"
    members = sorted(set(re.findall(r"QuantizationSFLayout::(\w+)", func.group(0))))
    source = "\n".join([
        "#include <stdexcept>",
        f"namespace tensorrt_llm {{ enum class QuantizationSFLayout {{ {', '.join(members)} }}; }}",
        '#define TLLM_THROW(...) throw std::runtime_error("unsupported layout")',
        padup.group(0),
        func.group(0),
        'extern "C" void sf_offsets(int rows, int cols, int* out) {',
        "  int pr = PadUpFn(rows, 128), pc = PadUpFn(cols, 4);",
        "  for (int r = 0; r < pr; ++r)",
        "    for (int c = 0; c < pc; ++c)",
        "      out[r * pc + c] = computeSFIndex(r, c, rows, cols,",
        "                                       tensorrt_llm::QuantizationSFLayout::SWIZZLED_128x4);",
        "}",
    ])
    (build_dir / "sf_index.cpp").write_text(source)
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(build_dir / "sf_index.so"),
                    str(build_dir / "sf_index.cpp")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(build_dir / "sf_index.so"))
    lib.sf_offsets.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]

    def block_scale_interleave(unswizzled_sf: torch.Tensor) -> torch.Tensor:
        """blockScaleInterleaveHost for one 2-D matrix: rows padded to 128, cols to 4, zero-filled."""
        assert unswizzled_sf.dim() == 2 and unswizzled_sf.dtype in (torch.uint8, torch.bfloat16)
        rows, cols = unswizzled_sf.shape
        pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
        offsets = torch.empty(pr * pc, dtype=torch.int32)
        lib.sf_offsets(rows, cols, offsets.data_ptr())
        padded = unswizzled_sf.new_zeros(pr, pc)
        padded[:rows, :cols] = unswizzled_sf
        out = unswizzled_sf.new_empty(pr * pc)
        out[offsets.long()] = padded.reshape(-1)
        return out

    return block_scale_interleave


_FI_FUNCTIONS = {
    "utils.py": (["srcToDstBlk16RowMap", "srcToDstBlk32RowMap", "get_shuffle_block_size",
                  "get_shuffle_matrix_a_row_indices", "get_shuffle_matrix_sf_a_row_indices"],
                 ["_unaligned_rows_message"]),  # 0.7.4 only
    "fused_moe/core.py": (["_maybe_get_cached_w3_w1_permute_indices", "get_w2_permute_indices_with_cache",
                           "get_reorder_rows_for_gated_act_gemm_row_indices", "convert_to_block_layout"], []),
}
_VLLM_PREPARE = "model_executor/layers/quantization/utils/flashinfer_mxint4_moe.py"
# what prepare_static_weights_for_trtllm_mxint4_moe imports inside its body: provided by the namespace
_VLLM_PREPARE_IMPORTS = {"block_scale_interleave", "convert_to_block_layout",
                         "_maybe_get_cached_w3_w1_permute_indices", "get_w2_permute_indices_with_cache",
                         "reorder_w1w3_to_w3w1", "convert_packed_uint4b8_to_signed_int4_inplace"}


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """FlashInfer's own helpers (its Python, and its C++ scale-interleave index compiled for the host)."""
    fi = package_reader(FLASHINFER_SRC, "flashinfer")
    if fi is None:
        pytest.skip("FlashInfer's source is not at hand (pip download flashinfer-python==0.7.2.post1 --no-deps, "
                    "and set MOECONVERT_FLASHINFER_SRC to the wheel or to a folder holding flashinfer/)")
    ns: dict = {"torch": torch}
    for rel, (names, optional) in _FI_FUNCTIONS.items():
        lift(fi, rel, names, ns, package="flashinfer", optional=optional)
    ns["block_scale_interleave"] = _compile_sf_index(fi, tmp_path_factory.mktemp("flashinfer-sf"))
    ns["flashinfer_version"] = package_version(fi, "_build_meta.py") or package_version(fi, "version.py")
    return types.SimpleNamespace(**ns)


_PREPARED: dict = {}


def vllm_prepare(reference, version: str):
    """vLLM ``version``'s ``prepare_static_weights_for_trtllm_mxint4_moe``, run with FlashInfer's helpers."""
    if version in _PREPARED:
        return _PREPARED[version]
    vllm = vllm_reader(version)
    ns = dict(vars(reference))

    def on_cpu(key, node):  # the in-place uint4b8 -> int4 conversion asserts CUDA only to be fast
        node.body = [n for n in node.body if not (isinstance(n, ast.Assert) and "is_cuda" in ast.unparse(n.test))]
        return node

    lift(vllm, "model_executor/layers/quantization/utils/quant_utils.py",
         ["convert_packed_uint4b8_to_signed_int4_inplace"], ns, edit=on_cpu)
    lift(vllm, "model_executor/layers/quantization/utils/flashinfer_fp4_moe.py", ["reorder_w1w3_to_w3w1"], ns)

    imported: set = set()

    def imports_from_namespace(key, node):
        imported.update(a.asname or a.name for n in node.body if isinstance(n, ast.ImportFrom) for a in n.names)
        node.body = [n for n in node.body if not isinstance(n, ast.ImportFrom)]
        return node

    lift(vllm, _VLLM_PREPARE, ["prepare_static_weights_for_trtllm_mxint4_moe"], ns, edit=imports_from_namespace)
    assert imported == _VLLM_PREPARE_IMPORTS, f"vLLM {version}'s prepare now imports {sorted(imported)}"
    _PREPARED[version] = ns["prepare_static_weights_for_trtllm_mxint4_moe"]
    return _PREPARED[version]


def ct_params(block: ExpertBlock):
    """The params vLLM holds after loading the CT checkpoint of ``block`` (spec §2), packed by CT itself."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed = lambda u: (u.to(torch.int16) - 8).to(torch.int8)
    return (pack_to_int32(signed(block.w13), 4, packed_dim=1), block.w13_scale.to(torch.bfloat16),
            pack_to_int32(signed(block.w2), 4, packed_dim=1), block.w2_scale.to(torch.bfloat16))


@pytest.mark.parametrize("E,H,I,scale_dtype", [
    (2, 256, 256, "bfloat16"), (3, 512, 256, "bfloat16"), (2, 256, 512, "bfloat16"), (1, 768, 768, "bfloat16"),
    (2, 512, 512, "float32"),
])
def test_bytes_equal_vllm_prepare_static_weights_for_trtllm_mxint4_moe(reference, E, H, I, scale_dtype, vllm_version):
    prepare = vllm_prepare(reference, vllm_version)
    block = wna16_block(E, H, I, scale_dtype=scale_dtype, seed=E + H + I)
    ours = LAYOUT.encode(block, layer(E, H, I))
    w13, s13, w2, s2 = ct_params(block)
    theirs = prepare(w13, s13, w2, s2)
    assert same_bits(ours["w13_weight_packed"], theirs["gemm1_weights"])
    assert same_bits(ours["w13_weight_scale"], theirs["gemm1_scales"])
    assert same_bits(ours["w2_weight_packed"], theirs["gemm2_weights"])
    assert same_bits(ours["w2_weight_scale"], theirs["gemm2_scales"])


def test_flashinfer_composed_w13_index_equals_the_spec_vector(reference):
    # the spec's vector (b), confirmed with FlashInfer's own index code on a [2I = 256, H/2] weight
    cache: dict = {}
    idx = reference._maybe_get_cached_w3_w1_permute_indices(cache, torch.zeros(256, 64, dtype=torch.uint8), 128)
    assert idx[:40].tolist() == SPEC_COMPOSED_2I_256
    scale_idx = reference._maybe_get_cached_w3_w1_permute_indices(
        cache, torch.zeros(256, 8, dtype=torch.bfloat16), 128, num_elts_per_sf=32)
    assert torch.equal(scale_idx, idx)  # num_elts_per_sf selects asserts only


@pytest.mark.parametrize("M", [32, 128, 256, 1024])
def test_shuffle_equals_flashinfer_get_shuffle_matrix_a_row_indices(reference, M):
    assert torch.equal(shuffle_rows(M), reference.get_shuffle_matrix_a_row_indices(torch.zeros(M, 4), 128))


@pytest.mark.parametrize("R,C", [(128, 4), (256, 8), (512, 24)])
def test_swizzle_equals_flashinfer_host_block_scale_interleave(reference, R, C):
    x = torch.randn(3, R, C).to(torch.bfloat16)
    ours = swizzle_128x4(x)
    for e in range(3):
        assert same_bits(ours[e], reference.block_scale_interleave(x[e].contiguous()))
