"""The ``triton-fast`` layouts and their fused MoE kernel (kernels/moe_fast.py and the modules it launches).

Weights are random canonical blocks (codes, scales, zero points, biases) encoded by the real
``triton-fast`` layout; the reference is ``runtime/reference.py``'s ``reference_moe`` on the same
block dequantized. The kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child process (the
variable changes every Triton kernel defined after it is set, so it must not leak into the other
tests) in fp16/fp32; bf16 on realistic shapes is the GPU test (``-m gpu``).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout
from moeconvert.layouts.triton_fast import pack_fragments, pack_int8_fragments, unpack_fragments, unpack_int8_fragments
from moeconvert.schemes import MXFP4Scheme, WNA16Scheme

from interpreted import TOL, rel, record, result, run_child




def random_block(quant: str, E: int, H: int, I: int, dtype: torch.dtype, bias: bool, g: torch.Generator,
                 device="cpu", mx_top: int = 130) -> ExpertBlock:
    """A canonical block: ``int4-sym-g32``, ``int8-asym-g32``, ``int8-asym-gch`` (channelwise), ``mxfp4``
    (``mx_top``: the e8m0 exponent of one large scale in each projection)..."""
    if quant == "mxfp4":
        s = MXFP4Scheme()

        def proj(N, K):
            codes = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
            # 2^(S-127) ~ 1/sqrt(K) keeps outputs O(1); S = 0 (2^-127) and large S occur too
            S = torch.randint(119, 125, (E, N, K // 32), generator=g).to(torch.uint8)
            S[0, 0, 0], S[-1, -1, -1] = 0, mx_top
            return codes.to(device), S.to(device), None
    else:
        bits, sym, gs = int(quant[3]), "-sym-" in quant, quant.rsplit("-g", 1)[1]
        gs = -1 if gs == "ch" else int(gs)
        s = WNA16Scheme(bits, gs, sym, str(dtype).removeprefix("torch."))

        def proj(N, K):
            G = s.groups(K)
            u = torch.randint(0, 1 << bits, (E, N, K), generator=g, dtype=torch.uint8)
            sc = ((torch.rand(E, N, G, generator=g) + 0.5) / (K ** 0.5 * (1 << (bits - 1)))).to(dtype)
            z = None if sym else torch.randint(0, 1 << bits, (E, N, G), generator=g, dtype=torch.uint8)
            return u.to(device), sc.to(device), None if z is None else z.to(device)

    w13, s13, z13 = proj(2 * I, H)
    w2, s2, z2 = proj(H, I)
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(device, dtype) if bias else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).to(device, dtype) if bias else None
    return ExpertBlock(s, w13, w2, s13, s2, z13, z2, b13, b2)


def encoded(quant, E, H, I, dtype, bias, g, act="silu", device="cpu", mx_top: int = 130):
    """(triton-fast tensors, the reference's DequantizedExperts) of one random block."""
    from moeconvert.runtime.reference import dequantize_block

    block = random_block(quant, E, H, I, dtype, bias, g, device, mx_top)
    shape = LayerShape(E, H, I, has_bias=bias, activation=act, dtype=str(dtype).removeprefix("torch."))
    tensors = get_layout("triton-fast", block.scheme.kind).encode(block, shape)
    return tensors, dequantize_block(block)


# ---------------------------------------------------------------------------------------------------
# 1. the layout: bytes by hand, round trip, refusals


def _mma_operand_place(n: int, k: int, atom_k: int) -> tuple[int, int, int, int, int]:
    """Where mma.m16n8k16's first operand puts weight (n, k) of an atom of 16 rows x ``atom_k`` inputs:
    (lane 4g + t, half h: row g or g + 8, 16-input step kt, half step kh: inputs 2t, 2t+1 or 2t+8, 2t+9,
    e: which of the two)."""
    row_in_atom, k_in_atom = n % 16, k % atom_k
    g, h = row_in_atom % 8, row_in_atom // 8
    kt, rest = k_in_atom // 16, k_in_atom % 16
    return 4 * g + (rest % 8) // 2, h, kt, rest // 8, rest % 2


def _fragment_position(n: int, k: int) -> tuple[int, int, int]:
    """(atom row, byte within the row, nibble shift) of 4-bit code (n, k): a lane's 16 bytes are one word
    per 16-input step, register c = nibbles c and c + 4."""
    lane, h, kt, kh, e = _mma_operand_place(n, k, 64)
    nibble = (2 * kh + h) + 4 * e  # register 2kh + h, its low (e = 0) or high half
    return n // 16, (k // 64) * 512 + lane * 16 + 4 * kt + nibble // 2, 4 * (nibble % 2)


def _int8_fragment_position(n: int, k: int) -> tuple[int, int]:
    """(atom row, byte within the row) of int8 code (n, k), two 16-input steps to a 32-input atom: a lane's
    16 bytes are one word per half step, each word two registers (rows g then g + 8, inputs in order)."""
    lane, h, kt, kh, e = _mma_operand_place(n, k, 32)
    return n // 16, (k // 32) * 512 + lane * 16 + 4 * (2 * kt + kh) + 2 * h + e


def _code_at(packed: torch.Tensor, bits: int, e: int, n: int, k: int) -> int:
    """Code (n, k) of expert e read from fragment bytes by the by-hand positions above."""
    if bits == 8:
        row, byte = _int8_fragment_position(n, k)
        return int(packed[e, row, byte])
    row, byte, shift = _fragment_position(n, k)
    return (int(packed[e, row, byte]) >> shift) & 15


@pytest.mark.parametrize("bits", [4, 8])
def test_fragment_bytes_hold_each_lanes_mma_operand(bits):
    g = torch.Generator().manual_seed(bits)
    K = 128 if bits == 4 else 96  # two 64-input / three 32-input atoms
    codes = torch.randint(0, 1 << bits, (2, 32, K), dtype=torch.uint8, generator=g)
    pack, unpack = (pack_fragments, unpack_fragments) if bits == 4 else (pack_int8_fragments, unpack_int8_fragments)
    packed = pack(codes)
    assert packed.shape == (2, 2, K * bits * 2) and packed.dtype == torch.uint8
    for e in range(2):
        for n in range(32):
            for k in range(K):
                assert _code_at(packed, bits, e, n, k) == int(codes[e, n, k]), (e, n, k)
    assert torch.equal(unpack(packed), codes)


@pytest.mark.parametrize("quant,bias", [("int4-sym-g32", False), ("int4-asym-g64", True), ("int8-asym-g32", False),
                                        ("int8-sym-gch", True), ("int4-asym-gch", False), ("mxfp4", True)])
def test_encode_decode_round_trip_exact(quant, bias):
    g = torch.Generator().manual_seed(zlib.crc32(quant.encode()))
    dtype = torch.bfloat16
    block = random_block(quant, 3, 256, 128, dtype, bias, g)
    shape = LayerShape(3, 256, 128, has_bias=bias, dtype="bfloat16")
    layout = get_layout("triton-fast", block.scheme.kind)
    assert layout.check(shape, block.scheme) == []
    tensors = layout.encode(block, shape)
    plan = {t.suffix: t for t in layout.plan(shape, block.scheme)}
    assert set(plan) == set(tensors)
    for name, t in tensors.items():
        assert tuple(t.shape) == tuple(plan[name].shape) and t.dtype == plan[name].dtype, name
        assert t.is_contiguous()
    assert layout.decode(tensors, shape, block.scheme).differences(layout.expected_block(block, shape)) == []
    # positions by hand: w2 of expert 2, output channel 21, input k = 75 (and int8: the byte itself)
    if quant == "mxfp4" or quant.startswith("int4"):
        row, byte, shift = _fragment_position(21, 75)
        nibble = (int(tensors["w2_weight"][2, row, byte]) >> shift) & 15
    if quant == "mxfp4":
        assert nibble == (int(block.w2[2, 21, 75 // 2]) >> 4) & 15  # odd k: the high nibble of the pair
        assert int(tensors["w2_weight_scale"][2, 1, 5]) == int(block.w2_scale[2, 5, 1])
    elif quant.startswith("int4"):
        assert nibble == int(block.w2[2, 21, 75])
    else:
        row, byte = _int8_fragment_position(21, 75)
        assert int(tensors["w2_weight"][2, row, byte]) == int(block.w2[2, 21, 75])
    if "asym" in quant:
        assert int(tensors["w13_weight_zero_point"][1, 0, 7]) == int(block.w13_zero[1, 7, 0])


@pytest.mark.parametrize("scheme,shape,needle", [
    (WNA16Scheme(4, 64, True, "bfloat16"), LayerShape(4, 256, 96), "divisible by group_size 64"),
    (WNA16Scheme(4, -1, True, "bfloat16"), LayerShape(4, 256, 96), "multiple of 64 for int4"),
    (WNA16Scheme(4, 32, True, "bfloat16"), LayerShape(4, 256, 128, activation="gelu"), "activation = gelu"),
    (WNA16Scheme(2, 32, True, "bfloat16"), LayerShape(4, 256, 128), "bits = 2"),
    (WNA16Scheme(4, 32, True, "bfloat16"), LayerShape(2048, 256, 128), "at most 1024 experts"),
    (MXFP4Scheme(), LayerShape(4, 256, 96), "multiple of 64"),
    (MXFP4Scheme(), LayerShape(4, 256, 128, dtype="float16"), "float16 cannot"),
])
def test_check_refuses_what_the_kernel_cannot_read(scheme, shape, needle):
    problems = get_layout("triton-fast", scheme.kind).check(shape, scheme)
    assert any(needle in p for p in problems), problems
    quant = "mxfp4" if scheme.kind == "mxfp4" else f"int{scheme.bits}-sym-g{scheme.group_size}"
    block = random_block(quant, 1, shape.hidden_size, shape.intermediate_size, torch.bfloat16, False,
                         torch.Generator().manual_seed(0))  # one expert: the check reads the shape's count
    with pytest.raises(MoeConvertError):
        get_layout("triton-fast", scheme.kind).encode(block, shape)


def test_configs_lookup_picks_the_nearest_m(tmp_path, monkeypatch):
    from moeconvert.kernels import configs

    key = configs.entry_key("int4", 128, 8, 2, 256, 128)
    assert key == "int4/g128 E=8 k=2 H=256 I=128"
    c1 = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=3)
    c2 = dict(c1, BLOCK_M=64, num_warps=8)
    table = {"device": "Test GPU", "triton": "x", "entries": {key: {"1": [c1, c1], "256": [c2, c2]}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("MOECONVERT_KERNEL_CONFIGS", str(path))
    assert configs.lookup(key, 4, "Test GPU")[0]["BLOCK_M"] == 16
    assert configs.lookup(key, 200, "Test GPU")[0]["BLOCK_M"] == 64
    assert configs.lookup("int4/g128 E=9 k=2 H=256 I=128", 4, "Test GPU") is None
    got = configs.get_configs("int4", 8, 2, H=256, I=128, M=300, group=128, device="cpu")
    assert got is not None and got[0]["BLOCK_M"] in (16, 32, 64, 128)


def test_programmatic_dependent_launch_only_where_it_measured_faster(monkeypatch):
    pytest.importorskip("triton")
    from moeconvert.kernels import pdl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pdl.ENV_NO_PDL, raising=False)
    monkeypatch.setattr(pdl, "_capability", lambda index: 9)  # a Hopper GPU, without one here
    cuda = torch.device("cuda", 0)
    have = pdl.gdc_wait is not None  # this Triton has the grid dependency control instructions
    assert pdl.launch_options(cuda) == {"PDL": have, "launch_pdl": have}
    assert pdl.launch_options(cuda, wanted=False) == {"PDL": False, "launch_pdl": False}  # one token's GEMMs
    assert not pdl.launch_options(torch.device("cpu"))["launch_pdl"]
    monkeypatch.setattr(pdl, "_capability", lambda index: 8)
    assert not pdl.launch_options(cuda)["launch_pdl"]
    monkeypatch.setattr(pdl, "_capability", lambda index: 9)
    monkeypatch.setenv(pdl.ENV_NO_PDL, "1")
    assert not pdl.launch_options(cuda)["launch_pdl"]


# ---------------------------------------------------------------------------------------------------
# 2. the kernel, direct calls (child process under the interpreter)

TOP_K, E = 2, 4
BASE = dict(E=E, H=256, I=128, bias=False, act="silu", offset=0, e_global=E)
CFG = lambda **kw: dict(dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=2), **kw)


def _cases():
    out = []
    add = lambda id, **kw: out.append(dict(BASE, id=id, **kw))
    for q in ("int4-sym-g32", "int4-asym-g64", "int4-sym-g128", "int4-sym-gch", "int4-asym-gch",
              "int8-sym-g32", "int8-asym-g64", "int8-sym-gch"):
        add(f"fp32-{q}-M13", quant=q, dtype="float32", M=13, I=256 if q.endswith("g128") else 128)
    add("fp32-int4-sym-g32-M1-bias", quant="int4-sym-g32", dtype="float32", M=1, bias=True)
    add("fp16-int4-sym-g128-M13-bias", quant="int4-sym-g128", dtype="float16", M=13, bias=True, I=256)
    add("fp16-int4-asym-g32-M13", quant="int4-asym-g32", dtype="float16", M=13)
    add("fp16-int8-sym-g64-M5", quant="int8-sym-g64", dtype="float16", M=5)
    add("fp32-mxfp4-swigluoai-bias-M13", quant="mxfp4", dtype="float32", M=13, bias=True, act="swigluoai",
        params={"alpha": 1.5, "limit": 3.0})
    add("fp32-mxfp4-silu-M3", quant="mxfp4", dtype="float32", M=3)
    # Kimi-K3's SITU, with and without linear_beta (the reference's SITU is vLLM's own: tests/test_runtime.py)
    add("fp32-mxfp4-situ-M13", quant="mxfp4", dtype="float32", M=13, act="situ",
        params={"beta": 0.75, "linear_beta": 0.5})
    add("fp16-int4-sym-g32-situ-M5", quant="int4-sym-g32", dtype="float16", M=5, act="situ", params={"beta": 0.5})
    # tiles: several groups in one K step (per-element scales), split-K GEMM2 with fp32 atomics, swizzle
    add("fp32-int4-asym-g32-bk128-M13", quant="int4-asym-g32", dtype="float32", M=13,
        configs=[CFG(BLOCK_K=128), CFG(BLOCK_K=128)])
    add("fp32-int8-sym-g32-bk64-M13", quant="int8-sym-g32", dtype="float32", M=13, configs=[CFG(), CFG()])
    add("fp32-int4-sym-g32-splitk-M13", quant="int4-sym-g32", dtype="float32", M=13,
        configs=[CFG(GROUP_M=4, BLOCK_N=64), CFG(SPLIT_K=2, BLOCK_K=64)])
    add("fp32-mxfp4-splitk-bias-M7", quant="mxfp4", dtype="float32", M=7, bias=True,
        configs=[CFG(BLOCK_M=32), CFG(BLOCK_M=32, SPLIT_K=3)])
    # 4-bit scales: after the MMA (one group a step) and in the operand (two groups a step; K not
    # whole steps: the last step's atoms and scale rows masked)
    add("fp32-int4-sym-g128-I128-M13", quant="int4-sym-g128", dtype="float32", M=13, I=128)
    add("fp16-int4-asym-g128-H384-M5", quant="int4-asym-g128", dtype="float16", M=5, H=384, I=128,
        configs=[CFG(BLOCK_K=256), CFG(BLOCK_K=128, SPLIT_K=1)])
    add("fp16-int4-sym-g128-H384-bk256-M5", quant="int4-sym-g128", dtype="float16", M=5, H=384, I=128,
        configs=[CFG(BLOCK_K=256), CFG(BLOCK_K=128)])
    # symmetric scales of one group a step in the operand instead of on the product (OPERAND_SCALE, the
    # MMA then runs asynchronously), int4 and int8 (int8 also on the product, both operand orders)
    add("fp16-int4-sym-g128-operand-scale-M13", quant="int4-sym-g128", dtype="float16", M=13, I=256,
        configs=[CFG(OPERAND_SCALE=1), CFG(BLOCK_K=128, OPERAND_SCALE=1)])
    add("fp32-int4-sym-gch-operand-scale-M7", quant="int4-sym-gch", dtype="float32", M=7, H=320, I=192,
        configs=[CFG(BLOCK_K=64, OPERAND_SCALE=1), CFG(BLOCK_K=64, SPLIT_K=2, OPERAND_SCALE=1)])
    add("fp16-int8-sym-g128-operand-scale-M13", quant="int8-sym-g128", dtype="float16", M=13, I=256,
        configs=[CFG(OPERAND_SCALE=1), CFG(BLOCK_K=128, OPERAND_SCALE=1)])
    add("fp32-int8-sym-g64-scale-on-product-M13", quant="int8-sym-g64", dtype="float32", M=13,
        configs=[CFG(BLOCK_K=64), CFG(BLOCK_K=32)])
    # zero points with one group a step: u - z exact in the operand and the scale on the product (by
    # default), or (u - z) * s in the operand (OPERAND_SCALE)
    add("fp16-int8-asym-g64-scale-on-product-M13", quant="int8-asym-g64", dtype="float16", M=13,
        configs=[CFG(BLOCK_K=64), CFG(BLOCK_K=32)])
    add("fp16-int4-asym-g128-operand-scale-M13", quant="int4-asym-g128", dtype="float16", M=13, I=256,
        configs=[CFG(OPERAND_SCALE=1), CFG(BLOCK_K=128, OPERAND_SCALE=1)])
    add("fp32-int8-asym-g64-operand-scale-M7", quant="int8-asym-g64", dtype="float32", M=7,
        configs=[CFG(BLOCK_K=64, OPERAND_SCALE=1), CFG(BLOCK_K=32, OPERAND_SCALE=1)])
    add("fp32-int4-sym-gch-H320-bk128-M7", quant="int4-sym-gch", dtype="float32", M=7, H=320, I=192,
        configs=[CFG(BLOCK_K=128), CFG(BLOCK_K=128, SPLIT_K=2)])
    add("fp32-mxfp4-H192-bk128-M7", quant="mxfp4", dtype="float32", M=7, H=192, I=320,
        configs=[CFG(BLOCK_K=128, BLOCK_N=64), CFG(BLOCK_K=128, BLOCK_N=16)])
    # MXFP4 with one dot per 32-input scale group (GROUP_DOTS = 1, opt-in) instead of scales in the operand
    add("fp32-mxfp4-group-dots-M7", quant="mxfp4", dtype="float32", M=7, H=192, I=320, bias=True,
        configs=[CFG(BLOCK_K=128, GROUP_DOTS=1), CFG(BLOCK_K=64, GROUP_DOTS=1, SPLIT_K=2)])
    add("fp32-mxfp4-group-dots-bn64-M13", quant="mxfp4", dtype="float32", M=13, act="swigluoai",
        configs=[CFG(BLOCK_N=64, GROUP_DOTS=1), CFG(BLOCK_N=64, BLOCK_K=128, GROUP_DOTS=1)])
    # int8 in 32-input atoms: steps of one atom, asymmetric (zero points in fp32), split-K
    add("fp32-int8-asym-g32-bk32-M5", quant="int8-asym-g32", dtype="float32", M=5,
        configs=[CFG(BLOCK_K=32), CFG(BLOCK_K=32, SPLIT_K=2)])
    add("fp16-int8-asym-g64-bk128-M13", quant="int8-asym-g64", dtype="float16", M=13, I=256,
        configs=[CFG(BLOCK_K=128), CFG(BLOCK_K=128, SPLIT_K=2)])
    add("fp32-mxfp4-swigluoai-splitk-M13", quant="mxfp4", dtype="float32", M=13, bias=True, act="swigluoai",
        configs=[CFG(BLOCK_N=64), CFG(BLOCK_M=16, SPLIT_K=2)])
    # EP: rank 1 of 2 (experts 4..7 of 8), ids on both sides of the cut; with and without split-K
    add("fp32-int4-sym-g32-ep-M13", quant="int4-sym-g32", dtype="float32", M=13, offset=4, e_global=8)
    add("fp32-int4-sym-g32-ep-splitk-M13", quant="int4-sym-g32", dtype="float32", M=13, offset=4, e_global=8,
        configs=[CFG(), CFG(SPLIT_K=2)])
    # GEMM1 split over K (the last split of a tile sums the partials, adds the bias once, activates)
    add("fp32-int4-sym-g128-gemm1-splitk-bias-M13", quant="int4-sym-g128", dtype="float32", M=13, bias=True,
        H=384, configs=[CFG(SPLIT_K=3, BLOCK_N=64, GROUP_M=4), CFG()])
    add("fp16-int4-asym-g32-gemm1-splitk-M5", quant="int4-asym-g32", dtype="float16", M=5,
        configs=[CFG(SPLIT_K=2, BLOCK_K=128), CFG(SPLIT_K=2)])
    # one token: a block per pair, no align (with split-K GEMMs; EP; the same expert twice)
    add("fp32-mxfp4-gemm1-splitk-bias-M1", quant="mxfp4", dtype="float32", M=1, bias=True, act="swigluoai",
        configs=[CFG(SPLIT_K=4), CFG(SPLIT_K=2)])
    add("fp32-int4-sym-g32-ep-M1", quant="int4-sym-g32", dtype="float32", M=1, offset=4, e_global=8)
    add("fp32-int8-asym-g64-ep-splitk-M1", quant="int8-asym-g64", dtype="float32", M=1, offset=4, e_global=8,
        configs=[CFG(SPLIT_K=2), CFG(SPLIT_K=2)])
    add("fp16-int4-sym-g128-same-expert-twice-M1", quant="int4-sym-g128", dtype="float16", M=1, I=256, dup=True)
    return out


CASES = _cases()


def _run_case(case: dict) -> dict:
    from moeconvert.runtime.moeconvert_triton import weights_from_tensors
    from moeconvert.kernels.moe_fast import fused_moe_fast
    from moeconvert.runtime.reference import activation_fn, reference_moe

    g = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    dtype = getattr(torch, case["dtype"])
    q, M, offset = case["quant"], case["M"], case["offset"]
    tensors, ref_w = encoded(q, case["E"], case["H"], case["I"], dtype, case["bias"], g, case["act"])
    x = torch.randn(M, case["H"], generator=g).to(dtype)
    ids = torch.randint(0, case["e_global"], (M, TOP_K), generator=g, dtype=torch.int32)
    if offset and M == 1:  # one pair on each side of the cut
        ids[0] = torch.tensor([offset + 3, 1], dtype=torch.int32)
    elif offset:  # both sides of the cut, and token 0 fully local
        ids[0] = torch.tensor([offset, offset + 1], dtype=torch.int32)
        ids[1] = torch.tensor([0, offset + 3], dtype=torch.int32)
    if case.get("dup"):
        ids[0] = torch.tensor([2, 2], dtype=torch.int32)
    tw = torch.rand(M, TOP_K, generator=g)
    fmt = "mxfp4" if q == "mxfp4" else q[:4]
    group = 32 if q == "mxfp4" else WNA16Scheme(4, int(q.rsplit("-g", 1)[1]) if "gch" not in q else -1, True,
                                                 "float32").group_size
    params = case.get("params", {})
    cfgs = case.get("configs")
    y = fused_moe_fast(x, weights_from_tensors(tensors, "w13"), weights_from_tensors(tensors, "w2"), tw, ids,
                       fmt=fmt, group_size=group, activation=case["act"], expert_offset=offset,
                       all_ids_local=case["e_global"] == case["E"], configs=tuple(cfgs) if cfgs else None, **params)
    want = reference_moe(x.float(), ref_w, tw, ids, activation_fn(case["act"], params), expert_offset=offset)
    return {"rel": rel(y, want), "dtype": str(y.dtype), "shape": list(y.shape), "finite": bool(y.isfinite().all()),
            "nonzero": bool(want.abs().sum() > 0)}


def _run_align() -> dict:
    """Triton align vs a loop: the same blocks of the same experts holding the same pairs."""
    from moeconvert.kernels.align import align

    out = {}
    for M, k, E_, offset, bm in [(1, 1, 1, 0, 16), (13, 2, 4, 0, 4), (13, 2, 4, 2, 4), (37, 4, 8, 8, 16),
                                 (300, 8, 64, 0, 16), (5, 3, 3, 100, 8), (100, 8, 64, 32, 16),
                                 (700, 8, 32, 16, 32)]:  # 5600 pairs: the multi-program path
        g = torch.Generator().manual_seed(M * 7 + E_)
        ids = torch.randint(0, max(E_ + offset, 2 * E_), (M, k), generator=g, dtype=torch.int32)
        sorted_ids, expert_ids, ntpp = align(ids, bm, E_, offset)
        flat = (ids.reshape(-1).long() - offset).tolist()
        want_blocks = []
        for e in range(E_):
            pairs = [p for p, i in enumerate(flat) if i == e]
            for b in range(0, len(pairs), bm):
                want_blocks.append((e, sorted(pairs[b:b + bm])))
        used = int(ntpp.item())
        got_blocks = []
        for b in range(used // bm):
            chunk = sorted_ids[b * bm:(b + 1) * bm].tolist()
            got_blocks.append((int(expert_ids[b]), sorted(p for p in chunk if p != M * k)))
        # pairs inside one expert's run may be in any order: compare each expert's set of pairs and block count
        per_e = lambda blocks: {e: (sum(1 for x, _ in blocks if x == e), sorted(p for x, ps in blocks if x == e
                                                                              for p in ps)) for e in range(E_)}
        out[f"{M}-{k}-{E_}-{offset}-{bm}"] = {
            "ok": per_e(got_blocks) == per_e(want_blocks) and used == len(want_blocks) * bm
            and all(int(v) == M * k for v in sorted_ids[used:].tolist())
            and all(int(v) == -1 for v in expert_ids[used // bm:].tolist())
            and [e for e, _ in got_blocks] == sorted(e for e, _ in got_blocks),
            "used": used, "want": len(want_blocks) * bm}
    return out


# 3. through the runtime: load(..., kernel="triton") of triton-fast folders
LOADS = {
    "repack-w4a16-g32": dict(family="qwen3-moe", args=dict(scheme="w4a16", group_size=32), cmd="repack",
                             extra=[], load={}),
    "repack-w4a16-g128-example": dict(family="qwen3-moe", args=dict(scheme="w4a16"), cmd="repack", extra=[], load={}),
    "repack-w8a16-g64-asym-ep1of2": dict(family="qwen3-moe", args=dict(scheme="w8a16", group_size=64, symmetric=False),
                                         cmd="repack", extra=["--ep-size", "2", "--ep-rank", "1"],
                                         load=dict(ep_size=2, ep_rank=1)),
    "quantize-mxfp4-gpt-oss": dict(family="gpt-oss", args=dict(scheme="bf16"), cmd="quantize",
                                   extra=["--format", "mxfp4"], load={}),
}


def _run_load(folder: str, load_kw: dict) -> dict:
    from moeconvert.runtime import load

    model = load(folder, device="cpu", kernel="triton", **load_kw)
    layer = next(iter(model))
    g = torch.Generator().manual_seed(5)
    # bf16 models run fp16 activations here: the interpreter gets bf16 dots wrong
    dtype = torch.float32 if layer.entry.shape.dtype == "float32" else torch.float16
    x = torch.randn(7, layer.hidden_size, generator=g).to(dtype)
    ids = torch.randint(0, layer.entry.num_experts_global, (7, 2), generator=g, dtype=torch.int32)
    w = torch.rand(7, 2, generator=g)
    y = layer(x, w, ids)
    want = layer.reference(x, w, ids)
    return {"rel": rel(y, want), "kernel": layer.kernel, "dtype": str(y.dtype), "x_dtype": str(dtype),
            "shape": list(y.shape), "want_shape": list(want.shape), "nonzero": bool(want.float().abs().sum() > 0)}


def _child(work: Path) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    spec = json.loads((work / "spec.json").read_text())
    only = spec.get("only")
    results = {}
    for case in CASES:
        if only and case["id"] not in only:
            continue
        record(results, case["id"], _run_case, case)
    record(results, "align", _run_align)
    for name, folder in spec["loads"].items():
        record(results, "load-" + name, _run_load, folder, LOADS[name]["load"])
    (work / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory, example_ckpt):
    pytest.importorskip("triton")
    from moeconvert.cli import main

    work = tmp_path_factory.mktemp("kernels-fast")
    loads = {}
    for name, spec in LOADS.items():
        src = example_ckpt(spec["family"], num_layers=1, num_experts=4, **spec["args"])
        out = work / name
        with pytest.raises(SystemExit) as exc:
            main([spec["cmd"], str(src), str(out), "--backend", "triton-fast", *spec["extra"]])
        assert exc.value.code == 0
        loads[name] = str(out)
    (work / "spec.json").write_text(json.dumps({"loads": loads}))
    run_child(__file__, "child", work, timeout=900)
    return json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fused_moe_fast_matches_the_reference_interpreted(interpreted, case):
    r = result(interpreted, case["id"])
    assert r["dtype"] == "torch." + case["dtype"] and r["shape"] == [case["M"], case["H"]]
    assert r["finite"] and r["nonzero"]
    assert r["rel"] < TOL[case["dtype"]], r


def test_align_kernel_matches_a_python_loop_interpreted(interpreted):
    r = result(interpreted, "align")
    bad = {k: v for k, v in r.items() if not v["ok"]}
    assert len(r) == 8 and not bad, bad


@pytest.mark.parametrize("name", list(LOADS))
def test_runtime_runs_a_triton_fast_folder_with_our_kernel_interpreted(interpreted, name):
    r = result(interpreted, "load-" + name)
    assert r["kernel"] == "triton"
    assert r["dtype"] == r["x_dtype"] and r["shape"] == r["want_shape"] and r["nonzero"]
    assert r["rel"] < TOL[r["x_dtype"].removeprefix("torch.")], r


# ---------------------------------------------------------------------------------------------------
# 4. GPU: bf16 on realistic shapes (Qwen3-30B-A3B's experts, gpt-oss-120b's MXFP4 at E = 32)

GPU_CASES = [("int4-sym-g128", 128, 8, 2048, 768), ("int4-asym-g32", 128, 8, 2048, 768),
             ("int8-sym-g128", 128, 8, 2048, 768), ("int4-sym-gch", 128, 8, 2048, 768),
             ("int8-asym-g64", 128, 8, 2048, 768), ("int8-sym-gch", 128, 8, 2048, 768),
             ("int4-sym-g128", 128, 8, 2048, 384),  # Qwen3-30B-A3B at TP 2
             ("mxfp4", 32, 4, 2880, 2880)]


# M 1 / 64 / 1024 each (M = 1: a block per pair, no align; split-K GEMM1 where the heuristic splits),
# and variants: MXFP4 with one dot per scale group (GROUP_DOTS), and with scales <= 2 (the 2^126 folded into the scale); int4 with GEMM1
# split in 4 at M = 64 (many tiles counting splits at once); both GEMMs split at M = 1; symmetric
# scales in the operand (OPERAND_SCALE) at M = 1024
GPU_RUNS = [(*c, M, "") for c in GPU_CASES for M in (1, 64, 1024)]
GPU_RUNS += [(*c, M, v) for c in GPU_CASES if c[0] == "mxfp4" for M in (1, 64) for v in ("group-dots", "fold")]
GPU_RUNS += [(*GPU_CASES[0], M, "gemm1-split4") for M in (64, 1024)]
GPU_RUNS += [(*c, 1024, "operand-scale") for c in (GPU_CASES[0], GPU_CASES[2], GPU_CASES[3])]
GPU_RUNS += [(*c, 1, "both-split") for c in (GPU_CASES[0], GPU_CASES[-1])]  # one zeroed buffer for both


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant,E_,k,H,I,M,variant", GPU_RUNS,
                         ids=[f"{r[0]}-I{r[4]}-M{r[5]}" + (f"-{r[6]}" if r[6] else "") for r in GPU_RUNS])
def test_fused_moe_fast_bf16_realistic_shape_gpu(quant, E_, k, H, I, M, variant):
    from moeconvert.runtime.moeconvert_triton import weights_from_tensors
    from moeconvert.kernels.configs import heuristic_configs
    from moeconvert.kernels.moe_fast import fused_moe_fast, mx_small_scales
    from moeconvert.runtime.reference import activation_fn, reference_moe

    g = torch.Generator().manual_seed(M + E_)
    act = "swigluoai" if quant == "mxfp4" else "silu"
    Hp, Ip = (-(-H // 64) * 64, -(-I // 64) * 64) if quant == "mxfp4" else (H, I)
    # MXFP4: one scale of 2^3 (S = 130) in each projection, no folding; "fold": 2^1 (S = 128) at most
    tensors, ref_w = encoded(quant, E_, Hp, Ip, torch.bfloat16, quant == "mxfp4", g, act,
                             mx_top=128 if variant == "fold" else 130)
    small = variant == "fold"
    if quant == "mxfp4":
        assert mx_small_scales(weights_from_tensors(tensors, "w13"), weights_from_tensors(tensors, "w2")) == small
    tensors = {n: t.cuda() for n, t in tensors.items()}
    ref_w = type(ref_w)(*(None if t is None else t.cuda()
                          for t in (ref_w.w13, ref_w.w2, ref_w.w13_bias, ref_w.w2_bias)))
    x = torch.randn(M, Hp, generator=g).to("cuda", torch.bfloat16)
    logits = torch.randn(M, E_, generator=g).cuda()
    tw, ids = torch.topk(torch.softmax(logits, -1), k)
    fmt = "mxfp4" if quant == "mxfp4" else quant[:4]
    group = 32 if quant == "mxfp4" else (-1 if "gch" in quant else int(quant.rsplit("-g", 1)[1]))
    knob = {"group-dots": ("GROUP_DOTS", 1, 0), "gemm1-split4": ("SPLIT_K", 4, 1)}
    configs = list(heuristic_configs(fmt, E_, k, Hp, Ip, M))
    if variant in knob:
        key, value, which = knob[variant]
        configs[which] = dict(configs[which], **{key: value})
    elif variant == "operand-scale":  # symmetric scales in the operand (prefill's asynchronous MMA)
        configs = [dict(c, OPERAND_SCALE=1) for c in configs]
    elif variant == "both-split":
        configs = [dict(configs[0], SPLIT_K=4), dict(configs[1], SPLIT_K=2)]
    y = fused_moe_fast(x, weights_from_tensors(tensors, "w13"), weights_from_tensors(tensors, "w2"), tw,
                       ids.to(torch.int32), fmt=fmt, group_size=group, activation=act, configs=tuple(configs),
                       mx_small_scales=small)
    want = reference_moe(x.float(), ref_w, tw, ids, activation_fn(act))
    assert y.dtype == torch.bfloat16 and y.shape == (M, Hp)
    assert rel(y, want) < TOL["bfloat16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["int8-sym-g128", "int8-asym-g64", "int4-sym-g128"])
@pytest.mark.parametrize("M", [3, 700])
def test_fused_moe_fast_fp16_gpu(quant, M):
    """fp16 activations: int8's own unpacking (1024 + u in fp16, no fp32 step) and int4's, against the
    reference, with the heuristic's tiles (M = 700: the scale in the operand)."""
    from moeconvert.runtime.moeconvert_triton import weights_from_tensors
    from moeconvert.kernels.moe_fast import fused_moe_fast
    from moeconvert.runtime.reference import activation_fn, reference_moe

    g = torch.Generator().manual_seed(M)
    tensors, ref_w = encoded(quant, 16, 1024, 512, torch.float16, False, g)
    tensors = {n: t.cuda() for n, t in tensors.items()}
    ref_w = type(ref_w)(*(None if t is None else t.cuda()
                          for t in (ref_w.w13, ref_w.w2, ref_w.w13_bias, ref_w.w2_bias)))
    x = torch.randn(M, 1024, generator=g).to("cuda", torch.float16)
    tw, ids = torch.topk(torch.softmax(torch.randn(M, 16, generator=g).cuda(), -1), 4)
    y = fused_moe_fast(x, weights_from_tensors(tensors, "w13"), weights_from_tensors(tensors, "w2"), tw,
                       ids.to(torch.int32), fmt=quant[:4], group_size=int(quant.rsplit("-g", 1)[1]))
    want = reference_moe(x.float(), ref_w, tw, ids, activation_fn("silu"))
    assert y.dtype == torch.float16 and rel(y, want) < TOL["float16"]


# the GPU unpacking against the portable one, bit for bit: every format's codes, zero points and scales
# reach the MMA as the same numbers (asymmetric int4 as (128 + u) - (128 + z), several scale groups a
# step in PTX; asymmetric int8 in fp32 for bf16), so the layer's output is identical, not only close
EXACT_CASES = [(q, dt, bk) for q in ("int4-asym-g32", "int4-asym-g128", "int4-asym-gch", "int8-asym-g32", "int8-asym-g128",
                                     "int4-sym-g32", "int8-sym-g32", "mxfp4")
               for dt in (torch.bfloat16, torch.float16) for bk in (64, 128)
               if not (q == "mxfp4" and dt == torch.float16)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant,dtype,bk", EXACT_CASES,
                         ids=[f"{q}-{str(d)[6:]}-bk{b}" for q, d, b in EXACT_CASES])
def test_gpu_unpacking_is_bitwise_the_portable_one_gpu(quant, dtype, bk, monkeypatch):
    from moeconvert.runtime.moeconvert_triton import weights_from_tensors
    from moeconvert.kernels.moe_fast import ENV_PORTABLE, fused_moe_fast

    g = torch.Generator().manual_seed(bk)
    act = "swigluoai" if quant == "mxfp4" else "silu"
    tensors, _ = encoded(quant, 8, 512, 256, dtype, quant == "mxfp4", g, act)
    tensors = {n: t.cuda() for n, t in tensors.items()}
    x = torch.randn(40, 512, generator=g).to("cuda", dtype)
    tw, ids = torch.topk(torch.softmax(torch.randn(40, 8, generator=g).cuda(), -1), 2)
    fmt = "mxfp4" if quant == "mxfp4" else quant[:4]
    group = 32 if quant == "mxfp4" else (-1 if "gch" in quant else int(quant.rsplit("-g", 1)[1]))
    # no split-K (whose atomic adds sum in any order); 64 x 64 tiles, BLOCK_K 64 or 128 (one group or
    # several a step)
    cfg = CFG(BLOCK_M=64, BLOCK_N=64, BLOCK_K=bk, num_stages=3)

    def run():
        return fused_moe_fast(x, weights_from_tensors(tensors, "w13"), weights_from_tensors(tensors, "w2"), tw,
                              ids.to(torch.int32), fmt=fmt, group_size=group, activation=act, configs=(cfg, cfg))

    monkeypatch.delenv(ENV_PORTABLE, raising=False)
    fast = run()
    monkeypatch.setenv(ENV_PORTABLE, "1")
    portable = run()
    assert fast.abs().max() > 0
    assert torch.equal(fast, portable), f"{(fast.float() - portable.float()).abs().max().item():.3e} apart"


def _shipped_h200_runs() -> list[tuple[str, str]]:
    from moeconvert.bench.kernel import SHAPES

    return [(name, M) for name in SHAPES for M in ("1", "16", "64", "256", "4096")]


@functools.lru_cache(maxsize=1)
def _shipped_shape_weights(name: str):
    """8 experts of a bench shape (its H, I, format), encoded, on the GPU, with the reference's weights."""
    from moeconvert.bench.kernel import SHAPES

    _, _, H, I, f = SHAPES[name]
    quant = "mxfp4" if f == "mxfp4" else "int4-sym-g128"
    Hp, Ip = (-(-H // 64) * 64, -(-I // 64) * 64)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors, ref_w = encoded(quant, 8, Hp, Ip, torch.bfloat16, f == "mxfp4", g,
                             "swigluoai" if f == "mxfp4" else "silu", mx_top=128)
    tensors = {n: t.cuda() for n, t in tensors.items()}
    ref_w = type(ref_w)(*(None if t is None else t.cuda()
                          for t in (ref_w.w13, ref_w.w2, ref_w.w13_bias, ref_w.w2_bias)))
    return tensors, ref_w, Hp


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,M", _shipped_h200_runs(), ids=[f"{n}-M{m}" for n, m in _shipped_h200_runs()])
def test_every_shipped_h200_config_matches_the_reference_gpu(name, M):
    """The configs of kernels/tuned/nvidia-h200.json (the tuner times them, it does not check them),
    each on 8 experts of its shape with real H and I, against the reference."""
    from moeconvert.kernels import configs
    from moeconvert.runtime.moeconvert_triton import weights_from_tensors
    from moeconvert.kernels.moe_fast import fused_moe_fast
    from moeconvert.bench.kernel import SHAPES
    from moeconvert.runtime.reference import activation_fn, reference_moe

    E, k, H, I, f = SHAPES[name]
    fmt, group = ("mxfp4", 32) if f == "mxfp4" else ("int4", 128)
    table = json.loads((Path(configs.SHIPPED) / "nvidia-h200.json").read_text())["entries"]
    c1, c2 = table[configs.entry_key(fmt, group, E, k, H, I)][M]
    tensors, ref_w, Hp = _shipped_shape_weights(name)
    g = torch.Generator().manual_seed(int(M))
    x = torch.randn(int(M), Hp, generator=g).to("cuda", torch.bfloat16)
    tw, ids = torch.topk(torch.softmax(torch.randn(int(M), 8, generator=g), -1), min(k, 8))
    act = "swigluoai" if f == "mxfp4" else "silu"
    y = fused_moe_fast(x, weights_from_tensors(tensors, "w13"), weights_from_tensors(tensors, "w2"), tw.cuda(),
                       ids.to("cuda", torch.int32), fmt=fmt, group_size=group, activation=act, configs=(c1, c2),
                       mx_small_scales=f == "mxfp4")
    want = reference_moe(x.float(), ref_w, tw.cuda(), ids.cuda(), activation_fn(act))
    assert rel(y, want) < TOL["bfloat16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["repack-w4a16-g128-example", "quantize-mxfp4-gpt-oss"])
def test_load_dispatches_triton_fast_folders_to_our_kernel_gpu(name, example_ckpt, tmp_path):
    from moeconvert.cli import main
    from moeconvert.runtime import load

    spec = LOADS[name]
    if spec["cmd"] == "repack":  # the example's int4 checkpoint is written by compressed-tensors
        pytest.importorskip("compressed_tensors")
    src = example_ckpt(spec["family"], num_layers=1, num_experts=4, **spec["args"])
    out = tmp_path / name
    with pytest.raises(SystemExit) as exc:
        main([spec["cmd"], str(src), str(out), "--backend", "triton-fast", *spec["extra"]])
    assert exc.value.code == 0
    layer = next(iter(load(out, device="cuda")))  # no kernel= : the runtime picks ours for this layout
    assert layer.kernel == "triton"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, layer.hidden_size, generator=g).to("cuda", torch.bfloat16)
    ids = torch.randint(0, layer.entry.num_experts_global, (33, 2), generator=g, dtype=torch.int32).cuda()
    w = torch.rand(33, 2, generator=g).cuda()
    y, want = layer(x, w, ids), layer.reference(x, w, ids)
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    assert rel(y, want) < TOL["bfloat16"]


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(Path(sys.argv[2]))
