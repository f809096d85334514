"""The MXFP4 layouts ``flashinfer-cutlass`` (SM90) and ``flashinfer-trtllm`` (Blackwell).

Proved by: vectors worked out by hand from docs/layouts/flashinfer-mxfp4.md (single-bit probes of the fp4
interleave, one-hot probes of the row orders and the scale layouts), a literal port of FlashInfer's
CUDA interleave kernel, and (optional, when the sources are found) vLLM
0.33.0's own conversion functions run with FlashInfer's own pure-torch helpers on the same tensors.
On a GPU with nvcc, FlashInfer's CUDA interleave kernel itself is compiled and run on our inputs.
decode(encode(x)) == x, plan == what encode writes, streaming by chunks and the refusals every layout
owes are tests/test_layout_contract.py.

Sources for the optional oracle: ``MOECONVERT_FLASHINFER_SRC`` (a flashinfer wheel, the unpacked
wheel, or the ``flashinfer`` package folder; else an installed flashinfer, found without importing
it) and ``MOECONVERT_VLLM_SRC`` (a vllm wheel or a folder holding ``vllm/``; else an installed vllm).
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import sys
import types
from enum import Enum
from pathlib import Path
from typing import Union

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts.flashinfer_cutlass import (
    FlashInferCutlassMXFP4Layout,
    deinterleave_sm90_fp4,
    fold_scales_sm90,
    interleave_sm90_fp4,
    unfold_scales_sm90,
)
from moeconvert.layouts.flashinfer_trtllm_mxfp4 import FlashInferTrtllmMXFP4Layout, trtllm_w13_rows
from moeconvert.schemes import MXFP4Scheme

from helpers import FLASHINFER_SRC, assert_lists_exactly, lift, package_reader, same_bits, undecorated, vllm_reader
from factories import mxfp4_block

CUTLASS = get_layout("flashinfer-cutlass", "mxfp4")
TRTLLM = get_layout("flashinfer-trtllm", "mxfp4")
MX = MXFP4Scheme()


def layer(E, Hp, Ip, bias=False, dtype="bfloat16", activation="silu"):
    return LayerShape(num_experts=E, hidden_size=Hp, intermediate_size=Ip, has_bias=bias, dtype=dtype,
                      activation=activation)


def one_hot(shape, where, value=1):
    t = torch.zeros(shape, dtype=torch.uint8)
    t[where] = value
    return t


def nonzero_positions(t: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in p) for p in torch.nonzero(t)]


# ---------------------------------------------------------------------------------------------------
# §6.3 step 2: the SM90 fp4 byte interleave, single-bit probes worked out by hand from the spec text
#
# source byte (row, col, bit) -> destination (row, byte col, value). For c = 32p + 8m + t: slot b0 =
# W[r0, c], b1 = W[r0+8, c], b2 = W[r0, c+4], b3 = W[r0+8, c+4]; the word goes to row r0 + 8(m%2),
# column 32p + 16(m//2) + 4t; low nibbles in bits 0-15, high nibbles in 16-31, per the table
# b0 (m, e0, e1, s) -> (6, 7, 8, 15), b1 -> (3, 4, 5, 12), b2 -> (0, 1, 2, 9), b3 -> (13, 10, 11, 14).

PROBES = [
    # n, k, (src row, src byte, src bit), (dst row, dst byte, dst value)
    (16, 64, (0, 0, 0), (0, 0, 0x40)),  # b0 low m -> bit 6
    (16, 64, (0, 0, 1), (0, 0, 0x80)),  # b0 low e0 -> bit 7
    (16, 64, (0, 0, 2), (0, 1, 0x01)),  # b0 low e1 -> bit 8
    (16, 64, (0, 0, 3), (0, 1, 0x80)),  # b0 low sign -> bit 15
    (16, 64, (0, 0, 7), (0, 3, 0x80)),  # b0 high sign -> bit 31
    (16, 64, (0, 0, 4), (0, 2, 0x40)),  # b0 high m -> bit 22
    (16, 64, (8, 0, 3), (0, 1, 0x10)),  # b1 low sign -> bit 12
    (16, 64, (8, 0, 0), (0, 0, 0x08)),  # b1 low m -> bit 3
    (16, 64, (0, 4, 0), (0, 0, 0x01)),  # b2 low m -> bit 0
    (16, 64, (0, 4, 3), (0, 1, 0x02)),  # b2 low sign -> bit 9
    (16, 64, (8, 4, 0), (0, 1, 0x20)),  # b3 low m -> bit 13
    (16, 64, (8, 4, 1), (0, 1, 0x04)),  # b3 low e0 -> bit 10
    (16, 64, (8, 4, 7), (0, 3, 0x40)),  # b3 high sign -> bit 30
    (16, 64, (0, 8, 0), (8, 0, 0x40)),  # m = 1: to row r0 + 8
    (16, 64, (0, 1, 0), (0, 4, 0x40)),  # t = 1: to byte 4
    (16, 64, (2, 19, 4), (2, 30, 0x40)),  # i = 2, m = 2, t = 3: row 2, byte 16 + 12 + 2
    (16, 128, (13, 61, 6), (13, 55, 0x08)),  # p = 1, m = 3, t = 1, b3 high e1 -> bit 27
    (32, 64, (17, 0, 3), (17, 1, 0x80)),  # band 1, i = 1
    (32, 128, (31, 63, 7), (31, 63, 0x40)),  # last row/byte: b3 of r0 = 23, m = 3, t = 3 -> bit 30
]


@pytest.mark.parametrize("n,k,src,dst", PROBES)
def test_single_bit_probes_land_where_the_spec_table_says(n, k, src, dst):
    r, c, bit = src
    w = one_hot((1, n, k // 2), (0, r, c), 1 << bit)
    out = interleave_sm90_fp4(w)
    assert out.shape == w.shape and out.dtype == torch.uint8
    assert nonzero_positions(out) == [(0, dst[0], dst[1])]
    assert int(out[0, dst[0], dst[1]]) == dst[2]
    assert torch.equal(deinterleave_sm90_fp4(out), w)


def test_interleave_is_a_bit_permutation():
    """Each of the 4096 single-bit inputs of one 16 x 64 tile lands on one bit, no two on the same one."""
    nbytes = 16 * 64 // 2
    idx = torch.arange(nbytes * 8)
    probes = torch.zeros(nbytes * 8, nbytes, dtype=torch.uint8)
    probes[idx, idx // 8] = (1 << (idx % 8)).to(torch.uint8)
    out = interleave_sm90_fp4(probes.view(nbytes * 8, 16, 32)).view(nbytes * 8, nbytes)
    bits = ((out.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(nbytes * 8, nbytes * 8)
    assert torch.equal(bits.sum(1), torch.ones(nbytes * 8, dtype=torch.int64))
    assert torch.equal(bits.sum(0), torch.ones(nbytes * 8, dtype=torch.int64))


@pytest.mark.parametrize("n,k", [(32, 128), (48, 320)])
def test_interleave_moves_whole_bits_bijectively_on_larger_matrices(n, k):
    """Probe j sets every source bit whose index has bit j set; the outputs spell each destination
    bit's source index, which must run over all indices exactly once."""
    nbits = n * k * 4
    idx = torch.arange(nbits)
    width = max(1, (nbits - 1).bit_length())
    spelled = torch.zeros(nbits, dtype=torch.int64)
    for j in range(width):
        on = ((idx >> j) & 1).view(-1, 8) << torch.arange(8)
        w = on.sum(-1).to(torch.uint8).view(1, n, k // 2)
        out = interleave_sm90_fp4(w).flatten()
        spelled |= (((out.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().to(torch.int64)) << j
    assert torch.equal(spelled.sort().values, idx)


# A literal port of FlashInfer's interleave_fp4_weights_for_sm90_mixed_gemm_kernel (moe_gemm_mixed_utils.cu,
# identical in 0.7.2.post1 and 0.7.4): its loops and its 18 mask/shift lines, one expert at a time.
_CUDA_MASKS = [
    (0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
    (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
    (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
    (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
    (0x01000000, -11), (0x06000000, -15),
]


def cuda_port_interleave(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape[0], w.shape[1] * 2
    src = w.flatten().tolist()
    dst = [None] * len(src)
    for block_id in range(rows // 2):
        for partition_id in range(cols // 64):
            for lane_id in range(16):  # blockDim.x = 16
                row_id = block_id // 8 * 16 + block_id % 8
                mma_id = lane_id // 4
                dst_row_id = row_id + (mma_id % 2) * 8
                interleaved_lane_id = lane_id // 8 * 16 + (lane_id % 4) * 4
                col_id = partition_id * 32 + mma_id * 8 + lane_id % 4
                dst_col_id = partition_id * 32 + interleaved_lane_id
                first = row_id * cols // 2 + col_id
                second = (row_id + 8) * cols // 2 + col_id
                raw = src[first] | src[second] << 8 | src[first + 4] << 16 | src[second + 4] << 24
                word = 0
                for mask, shift in _CUDA_MASKS:
                    word |= (raw & mask) << shift if shift >= 0 else (raw & mask) >> -shift
                d = dst_row_id * cols // 2 + dst_col_id
                for j in range(4):
                    dst[d + j] = (word >> (8 * j)) & 0xFF
    assert None not in dst
    return torch.tensor(dst, dtype=torch.uint8).view(w.shape)


@pytest.mark.parametrize("n,k", [(16, 64), (32, 128), (48, 256), (64, 192)])
def test_interleave_equals_a_port_of_flashinfers_cuda_kernel(n, k):
    w = torch.randint(0, 256, (3, n, k // 2), generator=torch.Generator().manual_seed(n + k)).to(torch.uint8)
    ours = interleave_sm90_fp4(w)
    for e in range(3):
        assert torch.equal(ours[e], cuda_port_interleave(w[e]))


# ---------------------------------------------------------------------------------------------------
# §6.3 step 3: the scale fold, out[e, a, b, f, 4m + s] = in[e, 64a + 16m + f, 4b + s]


def test_scale_fold_by_hand():
    # in[r, c] = 4 (r % 64) + c for C = 4 (values < 256); R = 128 gives two row blocks
    r, c = torch.arange(128).view(-1, 1), torch.arange(4).view(1, -1)
    s = (4 * (r % 64) + c).to(torch.uint8).view(1, 128, 4)
    s[0, 64:] += 1  # the second row block differs by one everywhere
    out = fold_scales_sm90(s)
    assert out.shape == (1, 2, 1, 16, 16)
    assert out[0, 0, 0, 0].tolist() == [0, 1, 2, 3, 64, 65, 66, 67, 128, 129, 130, 131, 192, 193, 194, 195]
    assert out[0, 0, 0, 1].tolist() == [4, 5, 6, 7, 68, 69, 70, 71, 132, 133, 134, 135, 196, 197, 198, 199]
    assert out[0, 0, 0, 15].tolist() == [60, 61, 62, 63, 124, 125, 126, 127, 188, 189, 190, 191, 252, 253, 254, 255]
    assert out[0, 1, 0, 0].tolist() == [1, 2, 3, 4, 65, 66, 67, 68, 129, 130, 131, 132, 193, 194, 195, 196]
    assert torch.equal(unfold_scales_sm90(out), s)


def test_scale_fold_second_k_block_by_hand():
    # C = 8: K block b = 1 holds columns 4..7
    s = one_hot((1, 64, 8), (0, 33, 6), 7)  # row 33 = 16*2 + 1 -> m = 2, f = 1; column 6 -> b = 1, s = 2
    out = fold_scales_sm90(s)
    assert out.shape == (1, 1, 2, 16, 16)
    assert nonzero_positions(out) == [(0, 0, 1, 1, 10)]


# ---------------------------------------------------------------------------------------------------
# flashinfer-cutlass: whole-layer vectors


def test_cutlass_w13_is_up_then_gate():
    Hp, Ip = 128, 128
    block = mxfp4_block(1, Hp, Ip)
    block.w13.zero_()
    block.w13[0, Ip, 0] = 0x01  # up row 0, element 0 = code 1 (m bit)
    block.w13[0, 0, 0] = 0x10  # gate row 0, element 1 = code 1
    out = CUTLASS.encode(block, layer(1, Hp, Ip))["w13_weight"]
    # up row 0 becomes GEMM row 0; b0 low m -> bit 6. gate row 0 becomes row Ip; b0 high m -> bit 22
    assert nonzero_positions(out) == [(0, 0, 0), (0, Ip, 2)]
    assert int(out[0, 0, 0]) == 0x40 and int(out[0, Ip, 2]) == 0x40


def test_cutlass_scales_swap_then_fold():
    Hp, Ip = 256, 128
    block = mxfp4_block(1, Hp, Ip)
    block.w13_scale.zero_()
    block.w13_scale[0, Ip + 17, 5] = 9  # up row 17 -> GEMM row 17: a = 0, m = 1, f = 1; col 5 -> b = 1, s = 1
    block.w13_scale[0, 70, 0] = 3  # gate row 70 -> GEMM row 198: a = 3, m = 0, f = 6; col 0
    out = CUTLASS.encode(block, layer(1, Hp, Ip))["w13_weight_scale"]
    assert out.shape == (1, 4, 2, 16, 16)
    assert nonzero_positions(out) == [(0, 0, 1, 1, 5), (0, 3, 0, 6, 0)]
    assert int(out[0, 0, 1, 1, 5]) == 9 and int(out[0, 3, 0, 6, 0]) == 3


def test_cutlass_biases_are_bf16_up_then_gate():
    Hp, Ip = 128, 128
    block = mxfp4_block(2, Hp, Ip, bias=True)
    block.w13_bias = torch.arange(2 * 2 * Ip, dtype=torch.float32).view(2, 2 * Ip).to(torch.bfloat16)
    out = CUTLASS.encode(block, layer(2, Hp, Ip, bias=True))
    assert out["w13_bias"].dtype == torch.bfloat16 and out["w2_bias"].dtype == torch.bfloat16
    assert out["w13_bias"][0, :3].tolist() == [128.0, 129.0, 130.0]  # up 0, 1, 2
    assert out["w13_bias"][0, Ip:Ip + 2].tolist() == [0.0, 1.0]  # gate 0, 1
    assert out["w13_bias"][1, 0].item() == 384.0
    assert torch.equal(out["w2_bias"], block.w2_bias)


# ---------------------------------------------------------------------------------------------------
# flashinfer-trtllm: whole-layer vectors (§6.6)
#
# GEMM1 row d holds interleaved row shuf(d) = 32(d//32) + 4(d%8) + (d%32)//8; interleaved row 2j is
# up j (canonical Ip + j), 2j + 1 is gate j (canonical j).


def test_trtllm_w13_rows_by_hand():
    Ip = 128
    rows = trtllm_w13_rows(Ip).tolist()
    evens, odds = [0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]
    assert rows[:32] == [Ip + j for j in evens] + evens + [Ip + j for j in odds] + odds
    assert rows[32:40] == [Ip + 16 + j for j in evens]
    assert sorted(rows) == list(range(2 * Ip))


def test_trtllm_weights_follow_the_rows():
    Hp, Ip = 256, 128
    block = mxfp4_block(1, Hp, Ip)
    block.w13.zero_()
    block.w2.zero_()
    block.w13[0, Ip + 2, 7] = 0xAB  # up 2 -> interleaved 4 -> GEMM1 row 1
    block.w13[0, 15, 0] = 0x01  # gate 15 -> interleaved 31 -> GEMM1 row 31
    block.w2[0, 37, 3] = 0x5C  # w2 row 37 = 32 + 5: d = 32 + 8*(5%4) + 5//4 = 41
    out = TRTLLM.encode(block, layer(1, Hp, Ip))
    assert nonzero_positions(out["w13_weight"]) == [(0, 1, 7), (0, 31, 0)]
    assert int(out["w13_weight"][0, 1, 7]) == 0xAB
    assert nonzero_positions(out["w2_weight"]) == [(0, 41, 3)]


def test_trtllm_scales_row_shuffle_then_128x4_swizzle_by_hand():
    Hp, Ip = 256, 128  # w13 scales [256, 8]: two row tiles of 128, two column tiles of 4
    cases = [
        # canonical (row, col) -> flat byte offset in the expert's swizzled scales
        ((Ip, 0), 0),  # up 0 -> row 0
        ((Ip + 2, 0), 16),  # up 2 -> row 1: (r % 32) * 16
        ((Ip + 16, 0), 4),  # up 16 -> interleaved 32 -> row 32: ((r % 128) // 32) * 4
        ((Ip, 5), 512 + 1),  # column 5: (c // 4) * 512 + c % 4
        ((Ip + 64, 0), 1024),  # up 64 -> row 128: (r // 128) * 128 * 8
        ((15, 3), 31 * 16 + 3),  # gate 15 -> row 31
    ]
    for (r, c), offset in cases:
        block = mxfp4_block(1, Hp, Ip)
        block.w13_scale.zero_()
        block.w13_scale[0, r, c] = 127
        s = TRTLLM.encode(block, layer(1, Hp, Ip))["w13_weight_scale"]
        assert s.dtype == torch.float8_e4m3fn and s.shape == (1, 2 * Ip, Hp // 32)
        flat = s.view(torch.uint8).flatten()
        assert nonzero_positions(flat) == [(offset,)], (r, c)
        assert int(flat[offset]) == 127  # the e8m0 byte itself, re-typed, not converted


def test_trtllm_biases_are_fp32_in_row_order():
    Hp, Ip = 256, 128
    block = mxfp4_block(1, Hp, Ip, bias=True)
    block.w13_bias = torch.arange(2 * Ip, dtype=torch.bfloat16).view(1, -1)
    block.w2_bias = torch.arange(Hp, dtype=torch.bfloat16).view(1, -1)
    out = TRTLLM.encode(block, layer(1, Hp, Ip, bias=True))
    assert out["w13_bias"].dtype == torch.float32 and out["w2_bias"].dtype == torch.float32
    assert out["w13_bias"][0, :4].tolist() == [128.0, 130.0, 132.0, 134.0]
    assert out["w13_bias"][0, 8:10].tolist() == [0.0, 2.0]
    assert out["w2_bias"][0, :10].tolist() == [0.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0, 1.0, 5.0]


# ---------------------------------------------------------------------------------------------------
# bytes that move, plans, registry


@pytest.mark.parametrize("L", [CUTLASS, TRTLLM], ids=["cutlass", "trtllm"])
def test_encode_changes_bytes_it_should(L):
    """Not the identity: a test of the round trip alone would pass for one."""
    shape, block = layer(2, 256, 128), mxfp4_block(2, 256, 128, seed=1)
    t = L.encode(block, shape)
    assert not torch.equal(t["w13_weight"], block.w13)
    assert not torch.equal(t["w2_weight"], block.w2)


def test_plans():
    assert [(s.suffix, s.shape, s.dtype) for s in CUTLASS.plan(layer(4, 384, 256, bias=True), MX)] == [
        ("w13_weight", (4, 512, 192), torch.uint8),
        ("w13_weight_scale", (4, 8, 3, 16, 16), torch.uint8),
        ("w2_weight", (4, 384, 128), torch.uint8),
        ("w2_weight_scale", (4, 6, 2, 16, 16), torch.uint8),
        ("w13_bias", (4, 512), torch.bfloat16),
        ("w2_bias", (4, 384), torch.bfloat16),
    ]
    assert [(s.suffix, s.shape, s.dtype) for s in TRTLLM.plan(layer(4, 512, 256, bias=True), MX)] == [
        ("w13_weight", (4, 512, 256), torch.uint8),
        ("w13_weight_scale", (4, 512, 16), torch.float8_e4m3fn),
        ("w2_weight", (4, 512, 128), torch.uint8),
        ("w2_weight_scale", (4, 512, 8), torch.float8_e4m3fn),
        ("w13_bias", (4, 512), torch.float32),
        ("w2_bias", (4, 512), torch.float32),
    ]


def test_registry_and_padding():
    assert isinstance(CUTLASS, FlashInferCutlassMXFP4Layout) and isinstance(TRTLLM, FlashInferTrtllmMXFP4Layout)
    assert CUTLASS.pad_multiples == (128, 128)  # spec §5.3
    assert TRTLLM.pad_multiples == (256, 128)
    assert type(get_layout("flashinfer-trtllm", "wna16")).__name__ != "FlashInferTrtllmMXFP4Layout"


def test_activations_do_not_change_the_bytes():
    """gpt-oss (swigluoai) ends in the same kernel order: vLLM de-interleaves (CUTLASS) or re-pairs (TRT-LLM)."""
    block = mxfp4_block(2, 256, 128, bias=True, seed=4)
    for L in (CUTLASS, TRTLLM):
        a = L.encode(block, layer(2, 256, 128, bias=True))
        b = L.encode(block, layer(2, 256, 128, bias=True, activation="swigluoai"))
        assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in ("w13_weight", "w13_weight_scale"))
        assert all(torch.equal(a[k], b[k]) for k in ("w13_bias", "w2_bias"))
    assert any("flashinfer_cutlass" in w for w in CUTLASS.warnings(layer(2, 256, 128, activation="swigluoai"), MX))
    assert any("Blackwell" in w and "_cache_permute_indices" in w for w in TRTLLM.warnings(layer(2, 256, 128), MX))


# ---------------------------------------------------------------------------------------------------
# check() lists every violated constraint, each on its own line


def test_cutlass_check_reports_every_violation_at_once():
    assert_lists_exactly(CUTLASS.check(layer(2, 96, 48, dtype="float16", activation="gelu"), MX), [
        "model dtype = float16",
        "activation = gelu",
        "hidden_size Hp = 96 must be a multiple of 128",
        "intermediate_size Ip (per TP rank) = 48 must be a multiple of the MXFP4 block 32",
        "intermediate_size Ip (per TP rank) = 48 must be a multiple of 128",
        "w13_weight: K = 96 must be divisible by 64",
        "w13_weight_scale: rows = 96 must be divisible by 64",
        "w13_weight_scale: K/32 = 3 must be divisible by 4",
        "w2_weight: K = 48 must be divisible by 64",
        "w2_weight_scale: rows = 96 must be divisible by 64",
    ])
    assert any("n = 8 rows must be divisible by 16" in p for p in CUTLASS.check(layer(1, 8, 128), MX))
    assert CUTLASS.check(layer(1, 128, 128), MX) == []


def test_trtllm_check_reports_every_violation_at_once():
    assert_lists_exactly(TRTLLM.check(layer(2, 96, 48, dtype="float16", activation="gelu"), MX), [
        "model dtype = float16",
        "activation = gelu",
        "hidden_size Hp = 96 must be a multiple of 256",
        "intermediate_size Ip (per TP rank) = 48 must be a multiple of the MXFP4 block 32",
        "intermediate_size Ip (per TP rank) = 48 must be a multiple of 128",
        "w13_weight_scale: rows = 96 must be divisible by 128",
        "w13_weight_scale: K/32 = 3 must be divisible by 4",
        "w2_weight_scale: rows = 96 must be divisible by 128",
    ])
    assert any("rows = 16 must be divisible by 32" in p for p in TRTLLM.check(layer(1, 16, 128), MX))
    assert TRTLLM.check(layer(1, 256, 128), MX) == []
    assert TRTLLM.check(layer(1, 128, 128), MX) == ["hidden_size Hp = 128 must be a multiple of 256 (vLLM 0.33.0 "
                                                    "pads it to 256 for this backend; docs/layouts/flashinfer-mxfp4.md)"]


# ---------------------------------------------------------------------------------------------------
# Oracle: each vLLM version's conversion functions with FlashInfer's own helpers (optional)


@functools.lru_cache(maxsize=1)
def flashinfer_helpers():
    read = package_reader(FLASHINFER_SRC, "flashinfer")
    if read is None:
        pytest.skip("FlashInfer sources not found (set MOECONVERT_FLASHINFER_SRC to a flashinfer-python wheel or "
                    "its unpacked folder)")
    ns: dict = {"torch": torch, "Union": Union, "Optional": __import__("typing").Optional}
    fi = dict(package="flashinfer", edit=undecorated)
    lift(read, "utils.py", ["srcToDstBlk16RowMap", "srcToDstBlk32RowMap", "get_shuffle_block_size",
                            "get_shuffle_matrix_a_row_indices", "get_shuffle_matrix_sf_a_row_indices"], ns,
         optional=["_unaligned_rows_message"], **fi)  # 0.7.4 only (an assert message)
    lift(read, "fused_moe/core.py", ["get_w2_permute_indices_with_cache"], ns, **fi)
    lift(read, "fused_moe/prepare.py", ["interleave_moe_scales_for_sm90_mixed_gemm"], ns, **fi)
    # two pure-torch renderings of the 128x4 swizzle that FlashInfer keeps beside its CUDA op
    lift(read, "diffusion_ops/minimax_h3_fc1_swiglu.py", ["_SF_TILE_ROWS", "_swizzle_sf_128x4"], ns, **fi)
    unswizzle_ns: dict = {"torch": torch}
    lift(read, "gemm/gemm_bf16_fp4.py", ["_unswizzle_sf_128x4"], unswizzle_ns, **fi)
    ns["_unswizzle_sf_128x4"] = unswizzle_ns["_unswizzle_sf_128x4"]
    return types.SimpleNamespace(**ns, read=read)


class _MoEActivation(Enum):  # the members vLLM's conversions compare against
    SILU = "silu"
    SWIGLUOAI = "swigluoai"
    SWIGLUOAI_UNINTERLEAVE = "swigluoai_uninterleave"


@functools.lru_cache(maxsize=None)
def vllm_conversions(version: str):
    read = vllm_reader(version)
    ns: dict = {"torch": torch, "Enum": Enum, "Union": Union, "MoEActivation": _MoEActivation,
                "current_platform": types.SimpleNamespace(is_rocm=lambda: False, is_xpu=lambda: False)}
    lift(read, "model_executor/layers/quantization/utils/flashinfer_utils.py", ["swap_w13_to_w31"], ns,
         edit=undecorated)
    lift(read, "model_executor/layers/fused_moe/oracle/mxfp4.py",
         ["Mxfp4MoeBackend", "TRTLLM_BACKENDS", "TRITON_BACKENDS", "B12X_BACKENDS", "FLASHINFER_MOE_EP_MXFP4_BACKENDS",
          "_interleave_gate_up_rows", "convert_gpt_oss_weight_to_mxfp4_moe_kernel_format",
          "convert_weight_to_mxfp4_moe_kernel_format"], ns, edit=undecorated)
    return types.SimpleNamespace(**ns)


def _fake_flashinfer(monkeypatch, weight_interleave):
    """sys.modules entries for the FlashInfer imports inside vLLM's conversions: FlashInfer's own
    pure-torch helpers, and ``weight_interleave`` standing in for the CUDA fp4 interleave op."""
    fi = flashinfer_helpers()

    def interleave_moe_weights_for_sm90_mixed_gemm(weight, quant_type="fp4"):
        assert quant_type == "fp4" and weight.dtype == torch.uint8 and weight.dim() == 3
        return torch.stack([weight_interleave(w) for w in weight.contiguous()])

    mods = {
        "flashinfer": types.ModuleType("flashinfer"),
        "flashinfer.fp4_quantization": types.ModuleType("flashinfer.fp4_quantization"),
        "flashinfer.fused_moe": types.ModuleType("flashinfer.fused_moe"),
        "flashinfer.fused_moe.core": types.ModuleType("flashinfer.fused_moe.core"),
    }
    mods["flashinfer.fp4_quantization"].nvfp4_block_scale_interleave = fi._swizzle_sf_128x4
    mods["flashinfer.fused_moe"].interleave_moe_scales_for_sm90_mixed_gemm = fi.interleave_moe_scales_for_sm90_mixed_gemm
    mods["flashinfer.fused_moe"].interleave_moe_weights_for_sm90_mixed_gemm = interleave_moe_weights_for_sm90_mixed_gemm
    mods["flashinfer.fused_moe.core"].get_w2_permute_indices_with_cache = fi.get_w2_permute_indices_with_cache
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def _vllm_convert(version: str, backend: str, block: ExpertBlock, gpt_oss: bool, weight_interleave, monkeypatch):
    """vLLM ``version``'s conversion of the params it holds for ``block`` (generic: rows [gate; up]; gpt-oss:
    interleaved)."""
    v = vllm_conversions(version)
    _fake_flashinfer(monkeypatch, weight_interleave)
    w13, s13, b13 = block.w13.clone(), block.w13_scale.clone(), block.w13_bias
    b2 = None if block.w2_bias is None else block.w2_bias.clone()
    if gpt_oss:  # how gpt-oss's checkpoint rows (and biases) come: 2j = gate j, 2j + 1 = up j
        w13, s13 = v._interleave_gate_up_rows(w13), v._interleave_gate_up_rows(s13)
        b13 = v._interleave_gate_up_rows(b13.unsqueeze(-1)).squeeze(-1)
        fn = v.convert_gpt_oss_weight_to_mxfp4_moe_kernel_format
        kw = {}
    else:
        b13 = None if b13 is None else b13.clone()
        fn = v.convert_weight_to_mxfp4_moe_kernel_format
        kw = {"activation": _MoEActivation.SILU}
    out = fn(mxfp4_backend=v.Mxfp4MoeBackend[backend], layer=types.SimpleNamespace(), w13_weight=w13,
             w2_weight=block.w2.clone(), w13_weight_scale=s13, w2_weight_scale=block.w2_scale.clone(),
             w13_bias=b13, w2_bias=b2, _cache_permute_indices={}, **kw)
    names = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias")
    return {n: t for n, t in zip(names, out) if t is not None}


ORACLE_CASES = [
    # backend, layout, Hp, Ip, E, bias, gpt_oss
    ("FLASHINFER_CUTLASS_MXFP4_BF16", "cutlass", 128, 128, 1, False, False),
    ("FLASHINFER_CUTLASS_MXFP4_BF16", "cutlass", 384, 256, 3, True, False),
    ("FLASHINFER_CUTLASS_MXFP4_BF16", "cutlass", 256, 384, 2, True, True),
    ("FLASHINFER_TRTLLM_MXFP4_BF16", "trtllm", 256, 128, 1, False, False),
    ("FLASHINFER_TRTLLM_MXFP4_BF16", "trtllm", 512, 384, 3, True, False),
    ("FLASHINFER_TRTLLM_MXFP4_BF16", "trtllm", 256, 256, 2, True, True),
]


@pytest.mark.parametrize("backend,which,Hp,Ip,E,bias,gpt_oss", ORACLE_CASES)
def test_bytes_equal_vllm_conversion_with_flashinfer_helpers(backend, which, Hp, Ip, E, bias, gpt_oss, monkeypatch,
                                                              vllm_version):
    L = CUTLASS if which == "cutlass" else TRTLLM
    shape = layer(E, Hp, Ip, bias=bias, activation="swigluoai" if gpt_oss else "silu")
    block = mxfp4_block(E, Hp, Ip, bias, seed=Hp * Ip + E)
    ours = L.encode(block, shape)
    theirs = _vllm_convert(vllm_version, backend, block, gpt_oss, cuda_port_interleave, monkeypatch)
    assert set(ours) == set(theirs)
    for name in ours:
        assert same_bits(ours[name], theirs[name]), name


def test_fold_and_rows_equal_flashinfer_helpers():
    fi = flashinfer_helpers()
    s = torch.randint(0, 256, (3, 384, 12), generator=torch.Generator().manual_seed(2)).to(torch.uint8)
    assert torch.equal(fold_scales_sm90(s), fi.interleave_moe_scales_for_sm90_mixed_gemm(s))
    for m in (256, 512, 768):
        perm = fi.get_w2_permute_indices_with_cache({}, torch.zeros(m, 8, dtype=torch.uint8), 128)
        rows = trtllm_w13_rows(m // 2)
        up_gate = torch.stack([m // 2 + torch.arange(m // 2), torch.arange(m // 2)], 1).reshape(m)
        assert torch.equal(rows, up_gate[perm])


def test_flashinfers_two_128x4_helpers_agree_with_our_swizzle():
    fi = flashinfer_helpers()
    s = torch.randint(0, 256, (2, 256, 8), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    shape = layer(2, 256, 128)
    block = mxfp4_block(2, 256, 128)
    block.w13_scale = s
    ours = TRTLLM.encode(block, shape)["w13_weight_scale"].view(torch.uint8)
    rows = trtllm_w13_rows(128)
    for e in range(2):
        flat = fi._swizzle_sf_128x4(s[e][rows])
        assert torch.equal(ours[e].flatten(), flat)
        assert torch.equal(fi._unswizzle_sf_128x4(flat, 256, 8), s[e][rows])


# ---------------------------------------------------------------------------------------------------
# GPU: FlashInfer's CUDA fp4 interleave kernel itself, compiled from its source


_WRAPPER = r"""
#include "moe_gemm_mixed_utils.h"
extern "C" int moeconvert_interleave_fp4(uint8_t* src, uint8_t* dst, int rows, int cols) {
  tensorrt_llm::kernels::cutlass_kernels::interleave_fp4_weights_for_sm90_mixed_gemm(src, dst, rows, cols, 0);
  return static_cast<int>(cudaDeviceSynchronize());
}
"""
_CU_DIR = "data/csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm"


@functools.lru_cache(maxsize=1)
def flashinfer_cuda_interleave():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("needs nvcc to build FlashInfer's interleave kernel")
    read = flashinfer_helpers().read
    import tempfile

    build = Path(tempfile.mkdtemp(prefix="moeconvert-fi-sm90-"))
    for f in ("moe_gemm_mixed_utils.cu", "moe_gemm_mixed_utils.h"):
        (build / f).write_text(read(f"{_CU_DIR}/{f}"))
    (build / "wrapper.cu").write_text(_WRAPPER)
    lib = build / "libfi_sm90_interleave.so"
    subprocess.run([nvcc, "-O2", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90", f"-I{build}", "-cudart", "shared",
                    str(build / "wrapper.cu"), str(build / "moe_gemm_mixed_utils.cu"), "-o", str(lib)],
                   check=True, capture_output=True)
    so = ctypes.CDLL(str(lib))
    so.moeconvert_interleave_fp4.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]

    def run(w: torch.Tensor) -> torch.Tensor:
        src = w.contiguous().cuda()
        dst = torch.full_like(src, 0xAA)
        torch.cuda.synchronize()
        rc = so.moeconvert_interleave_fp4(src.data_ptr(), dst.data_ptr(), src.shape[0], src.shape[1] * 2)
        assert rc == 0, f"CUDA error {rc}"
        return dst.cpu()

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(16, 64), (128, 128), (256, 2944), (5760, 256), (1024, 1024)])
def test_interleave_equals_flashinfers_cuda_kernel(n, k):
    run = flashinfer_cuda_interleave()
    w = torch.randint(0, 256, (2, n, k // 2), generator=torch.Generator().manual_seed(n * k)).to(torch.uint8)
    ours = interleave_sm90_fp4(w)
    for e in range(2):
        assert torch.equal(ours[e], run(w[e])), (n, k, e)


@pytest.mark.gpu
@pytest.mark.parametrize("which,Hp,Ip,bias", [("cutlass", 384, 256, True), ("cutlass", 2944, 384, False)])
def test_bytes_equal_vllm_conversion_with_flashinfers_cuda_interleave(which, Hp, Ip, bias, monkeypatch, vllm_version):
    run = flashinfer_cuda_interleave()
    shape, block = layer(2, Hp, Ip, bias=bias), mxfp4_block(2, Hp, Ip, bias, seed=9)
    ours = CUTLASS.encode(block, shape)
    theirs = _vllm_convert(vllm_version, "FLASHINFER_CUTLASS_MXFP4_BF16", block, False, run, monkeypatch)
    for name in ours:
        assert same_bits(ours[name], theirs[name]), name
