"""moeconvert.mxfp4: the three MXFP4 rules, bit for bit (docs/mxfp4-rounding.md, docs/mxfp4-rounding.md).

The oracle tests run the engines' own Triton quantizers on CPU under ``TRITON_INTERPRET=1`` in a
subprocess (this file, run as a script) and require zero differing bytes, once per vLLM version in
``helpers.VLLM_VERSIONS``, each against that version's source (``.oracles/`` from scripts/setup-tests.sh,
``MOECONVERT_VLLM_SRC`` naming wheels or folders holding ``vllm/``, or an installed vllm). A version whose
source is not at hand skips, saying how to get it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import VLLM_VERSION, VLLM_VERSIONS, vllm_location, vllm_missing  # tests/ is on sys.path (under pytest, and as the oracle script)
from moeconvert.errors import MoeConvertError
from moeconvert.mxfp4 import (
    E2M1_VALUES,
    count_nonfinite,
    dequantize_mxfp4,
    mxfp4_error_stats,
    nonfinite_experts,
    quantize_mxfp4,
    require_finite,
)

VLLM_QUANTIZER = "vllm/model_executor/layers/quantization/utils/mxfp4_utils.py"
TRITON_KERNELS = "vllm/third_party/triton_kernels/"
REPO = Path(__file__).resolve().parent.parent


def _b(hexbytes: str) -> list[int]:
    return list(bytes.fromhex(hexbytes))


def _block(values, dtype=torch.bfloat16) -> torch.Tensor:
    """One 32-block: ``values`` followed by zeros."""
    return torch.tensor(list(values) + [0.0] * (32 - len(values)), dtype=dtype)


# ==================================================================================================
# 1. The hand-computed vectors of docs/mxfp4-rounding.md (vllm, triton_kernels) and their OCP twins
#    (computed by hand in docs/mxfp4-rounding.md). Bytes in memory order.

VECTOR_A = [0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7,
            -0.0, -.25, -.5, -.75, -1, -1.25, -1.5, -1.75, -2, -2.5, -3, -3.5, -4, -5, -6, 0.1]
VECTOR_F = [0.012329, -0.045654, 0.0078125, 0.031128, -0.020142, 0.0005, 0.063965, -0.009888] * 4

SPEC_VECTORS = {
    # name: (x, {rule: (packed bytes as hex (zero-padded to 16), scale byte)})
    "A ties, amax 7": (VECTOR_A, {
        "vllm": ("00 10 11 22 22 43 44 65 88 98 99 aa aa cb cc 0d", 0x80),
        "triton_kernels": ("00 11 11 22 32 43 54 65 88 99 99 aa ba cb dc 0d", 0x80),
        "ocp": ("00 21 22 43 44 65 66 77 88 a9 aa cb cc ed ee 0f", 0x7F),
    }),
    "B all zero": ([0.0] * 32, {r: ("00" * 16, 0x00) for r in ("vllm", "triton_kernels", "ocp")}),
    "C amax 6": ([6, -3, 1, 0.5], {r: ("d7 12", 127) for r in ("vllm", "triton_kernels", "ocp")}),
    "D amax 5": ([5, 2.5, -0.75, 0.30078125], {
        "vllm": ("46 1a", 127), "triton_kernels": ("57 1a", 127), "ocp": ("46 1a", 127)}),
    "E amax 6.8125": ([6.8125, 3.40625, -1.1015625, 0.2001953125], {
        "vllm": ("57 0a", 127), "triton_kernels": ("35 09", 128), "ocp": ("57 0a", 127)}),
    "F typical weights": (VECTOR_F, {r: ("d2 41 0b 96 " * 4, 121) for r in ("vllm", "triton_kernels", "ocp")}),
}


@pytest.mark.parametrize("name", list(SPEC_VECTORS))
def test_spec_vectors(name):
    x, expected = SPEC_VECTORS[name]
    for rule, (hexbytes, scale) in expected.items():
        packed, scales = quantize_mxfp4(_block(x), rule)
        want = _b(hexbytes) + [0] * (16 - len(_b(hexbytes)))
        assert packed.tolist() == want, f"{name} / {rule}: {bytes(packed.tolist()).hex(' ')}"
        assert scales.tolist() == [scale], f"{name} / {rule}"


def test_vector_f_dequantizes_as_the_spec_says():
    deq = dequantize_mxfp4(*quantize_mxfp4(_block(VECTOR_F)))
    assert deq[:8].tolist() == [0.015625, -0.046875, 0.0078125, 0.03125, -0.0234375, 0.0, 0.0625, -0.0078125]


def test_vector_a_seven_dequantizes_to_eight_under_vllm_and_six_under_ocp():
    assert dequantize_mxfp4(*quantize_mxfp4(_block(VECTOR_A), "vllm"))[15].item() == 8.0
    assert dequantize_mxfp4(*quantize_mxfp4(_block(VECTOR_A), "ocp"))[15].item() == 6.0


@pytest.mark.parametrize(
    "amax, scale",
    # §3.2 spot values: [0.875, 1.75) -> 125, [1.75, 3.5) -> 126, [3.5, 7) -> 127.
    [(0.875, 125), (1.7421875, 125), (1.75, 126), (3.484375, 126), (3.5, 127), (6.96875, 127), (7.0, 128)],
)
def test_vllm_scale_rounds_the_block_max_at_significand_1_75(amax, scale):
    assert quantize_mxfp4(_block([amax, -0.01]))[1].item() == scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllm_s0_blocks_are_all_signed_zeros_like_the_compiled_kernel(dtype):
    """amax < 1.75·2^-125 gives S = 0, and the GPU kernel's quant scale 1/exp2(-127) is then 0."""
    tiny = torch.finfo(dtype).tiny  # 2^-126: E = 1 -> S = 0; under OCP it would be code 4
    packed, scales = quantize_mxfp4(_block([tiny, -tiny / 2, tiny / 4], dtype), "vllm")
    assert scales.item() == 0 and packed[:2].tolist() == [0x80, 0x00]
    assert quantize_mxfp4(_block([tiny, -tiny / 2], dtype), "ocp")[0][0].item() == 0xA4
    # S = 1 (amax = 2^-124) is a normal block again, subnormal elements included
    packed, scales = quantize_mxfp4(_block([4 * tiny, tiny / 2, -tiny * 3 / 8], dtype), "vllm")
    assert scales.item() == 1 and packed[:2].tolist() == [0x16, 0x09]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scale_extremes_and_non_finite_follow_the_engines(dtype):
    """§2.2 step 3 (S = 254 at E = 255), §2.4 (inf -> 255), OCP (non-finite -> NaN scale 255)."""
    inf, nan = float("inf"), float("nan")
    x = torch.stack([_block([inf, 1.0], dtype), _block([-1.0, nan, 0.5], dtype)])
    all_nan = torch.full((32,), nan, dtype=dtype)
    assert quantize_mxfp4(all_nan, "vllm")[1].item() == 0  # 0x7FFFFFFF + 2^21 carries out: E = 0
    assert quantize_mxfp4(all_nan, "vllm")[0].tolist() == [0x77] * 16
    assert quantize_mxfp4(x, "vllm")[1].flatten().tolist() == [254, 127 - 2]
    # vllm: inf saturates with its sign, NaN is skipped in the max and encodes as 6 (code 7)
    assert quantize_mxfp4(x, "vllm")[0][:, 0].tolist() == [0x07, 0x7E]
    # the GPU's NaN is +NaN whatever the input's sign: -NaN encodes as 7 as well
    assert quantize_mxfp4(-x, "vllm")[0][:, 0].tolist() == [0x8F, 0x76]
    assert quantize_mxfp4(x, "triton_kernels")[1].flatten().tolist() == [255, 125]
    assert quantize_mxfp4(x, "ocp")[1].flatten().tolist() == [255, 255]
    if dtype == torch.float16:
        return
    big = torch.finfo(dtype).max  # bf16 / fp32 max has significand >= 1.75 at 2^127
    assert quantize_mxfp4(_block([big], dtype), "vllm")[1].item() == 254


# ==================================================================================================
# 2. The invariants of docs/mxfp4-rounding.md


def _random_weights(shape, dtype, seed, spread=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    blocks = x.view(*shape[:-1], shape[-1] // 32, 32)
    e = torch.randint(-spread, spread + 1, blocks.shape[:-1] + (1,), generator=g)
    return torch.ldexp(blocks, e.float()).view(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_invariants_of_the_vllm_rule(dtype):
    w = _random_weights((4, 48, 256), dtype, seed=1)
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (4, 48, 128) and scales.shape == (4, 48, 8)
    assert packed.dtype == scales.dtype == torch.uint8 and packed.is_contiguous()
    s = scales.int()
    assert int(s.max()) <= 254 and not bool((s == 253).any())
    # for finite input and 1 <= S <= 252 the block's largest |dequant| is exactly 4·X or 6·X
    deq = dequantize_mxfp4(packed, scales).view(4, 48, 8, 32)
    top = deq.abs().amax(-1) / torch.ldexp(torch.ones(()), (s - 127).float())
    inner = (s >= 1) & (s <= 252)
    assert bool(inner.all()) and set(top[inner].unique().tolist()) <= {4.0, 6.0}
    # the largest |q| of every block lies in [3.5, 7)
    q = w.float().view(4, 48, 8, 32).abs().amax(-1) / torch.ldexp(torch.ones(()), (s - 127).float())
    assert bool(((q >= 3.5) & (q < 7)).all())
    # quantization is row-order and expert-split invariant
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(0))
    p2, s2 = quantize_mxfp4(w[:, perm])
    assert torch.equal(p2, packed[:, perm]) and torch.equal(s2, scales[:, perm])
    parts = [quantize_mxfp4(w[i : i + 1]) for i in range(4)]
    assert torch.equal(torch.cat([p for p, _ in parts]), packed)
    assert torch.equal(torch.cat([s for _, s in parts]), scales)


@pytest.mark.parametrize("rule", ["vllm", "ocp", "triton_kernels"])
def test_zero_blocks_are_scale_0_and_negative_zeros_keep_their_sign(rule):
    packed, scales = quantize_mxfp4(torch.zeros(2, 64, dtype=torch.bfloat16), rule)
    assert scales.tolist() == [[0, 0], [0, 0]] and not bool(packed.any())
    # -0.0 -> nibble 8; so is a negative value that rounds to zero
    packed, _ = quantize_mxfp4(_block([-0.0, 0.0, -0.01, 6.0]), rule)
    assert packed[:2].tolist() == [0x08, 0x78]


@pytest.mark.parametrize("rule", ["vllm", "ocp", "triton_kernels"])
def test_low_nibble_is_the_even_element(rule):
    packed, _ = quantize_mxfp4(_block([1.0, 6.0, -4.0, 0.5]), rule)
    assert packed[:2].tolist() == [0x72, 0x1E]


def test_dequantize_decodes_scale_bytes_like_ocp():
    packed = torch.tensor([[0x21] + [0] * 15] * 4, dtype=torch.uint8)  # codes 1 (0.5), 2 (1.0)
    scales = torch.tensor([[0], [1], [254], [255]], dtype=torch.uint8)
    deq = dequantize_mxfp4(packed, scales)
    assert deq[0, :2].tolist() == [2.0**-128, 2.0**-127]  # S = 0 is 2^-127, subnormal products exact
    assert deq[1, :2].tolist() == [2.0**-127, 2.0**-126]
    assert deq[2, :2].tolist() == [2.0**126, 2.0**127]
    assert bool(deq[3].isnan().all())
    # S = 254 with |code value| >= 2 overflows to inf (§3.1)
    assert dequantize_mxfp4(torch.tensor([[0x64] + [0] * 15], dtype=torch.uint8),
                            torch.tensor([[254]], dtype=torch.uint8))[0, :2].tolist() == [float("inf")] * 2
    # and the fp32 values are exact in bf16 for every S the quantizer emits below 254
    s = torch.arange(0, 254, dtype=torch.uint8).view(-1, 1)
    every = torch.tensor([list(range(0, 256, 17))[:16]], dtype=torch.uint8).expand(254, 16)
    full = dequantize_mxfp4(every, s)
    assert torch.equal(dequantize_mxfp4(every, s, torch.bfloat16).float(), full)


# ==================================================================================================
# 3. Round trips


def _representable(shape, seed):
    """Random e2m1 codes times random power-of-two scales, each block reaching the top of the grid."""
    g = torch.Generator().manual_seed(seed)
    lut = torch.tensor(E2M1_VALUES)
    codes = torch.randint(0, 16, shape, generator=g)
    blocks = codes.view(*shape[:-1], shape[-1] // 32, 32)
    # A block is a fixed point only if its own max selects its scale: a max of 6·X or 4·X does
    # under all three rules (vllm: q_max in [3.5, 7); ocp: [4, 8); triton_kernels: (3, 6]).
    top = torch.tensor([7, 15, 6, 14])
    blocks[..., 0] = top[torch.randint(0, len(top), blocks.shape[:-1], generator=g)]
    e = torch.randint(-40, 41, blocks.shape[:-1] + (1,), generator=g).float()
    return torch.ldexp(lut[blocks], e).view(shape)


@pytest.mark.parametrize("rule", ["vllm", "ocp", "triton_kernels"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_representable_values_round_trip_exactly(rule, dtype):
    x = _representable((3, 40, 128), seed=2).to(dtype)
    deq = dequantize_mxfp4(*quantize_mxfp4(x, rule), dtype=dtype)
    assert torch.equal(deq.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # incl. -0.0


@pytest.mark.parametrize("rule", ["vllm", "ocp", "triton_kernels"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_idempotent(rule, dtype):
    spread = 4 if dtype == torch.float16 else 30
    w = _random_weights((3, 32, 256), dtype, seed=3, spread=spread)
    packed, scales = quantize_mxfp4(w, rule)
    deq = dequantize_mxfp4(packed, scales, dtype)
    again = quantize_mxfp4(deq, rule)
    # the values are a fixed point under every rule ...
    assert torch.equal(dequantize_mxfp4(*again, dtype).view(torch.int16 if dtype != torch.float32 else torch.int32),
                       deq.view(torch.int16 if dtype != torch.float32 else torch.int32))
    if rule == "triton_kernels":
        # ... but not the bytes: its q_max lies in (3, 6], a block whose max rounds to 3·X
        # re-quantizes with X/2 (same values, other codes; docs/mxfp4-rounding.md)
        moved = scales != again[1]
        assert bool(moved.any()) and bool((again[1][moved].int() == scales[moved].int() - 1).all())
    else:
        assert torch.equal(again[0], packed) and torch.equal(again[1], scales)


def test_error_is_at_most_half_a_step_where_nothing_saturates():
    w = _random_weights((2, 64, 512), torch.bfloat16, seed=4)
    packed, scales = quantize_mxfp4(w)
    err = (dequantize_mxfp4(packed, scales) - w.float()).abs().view(2, 64, 16, 32)
    x = torch.ldexp(torch.ones(()), (scales.int() - 127).float()).unsqueeze(-1)
    q = w.float().abs().view(2, 64, 16, 32) / x
    step = torch.where(q < 2, 0.5, torch.where(q < 4, 1.0, 2.0))
    assert bool((err[q <= 6] <= (step * x / 2).expand_as(q)[q <= 6]).all())
    stats = mxfp4_error_stats(w, packed, scales)
    assert set(stats) == {"rel_fro_error", "max_abs_error", "saturated_block_fraction"}
    assert 0.05 < stats["rel_fro_error"] < 0.2 and stats["max_abs_error"] == float(err.max())
    clipped = (q > 6).any(-1).float().mean().item()
    assert 0 < stats["saturated_block_fraction"] == pytest.approx(clipped)


# ==================================================================================================
# 4. Refusals and the non-finite report


def test_bad_inputs_raise_moeconvert_errors():
    with pytest.raises(MoeConvertError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48), tensor="layers.0.w2")
    with pytest.raises(MoeConvertError, match="bf16, fp16 or fp32"):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(MoeConvertError, match="unknown MXFP4 rounding"):
        quantize_mxfp4(torch.zeros(4, 32), rounding="nearest")
    with pytest.raises(MoeConvertError, match="do not match"):
        dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def test_non_finite_weights_are_counted_per_expert_and_refused():
    w = torch.zeros(4, 8, 32, dtype=torch.bfloat16)
    w[1, 2, 3] = float("nan")
    w[3, 0, 0] = float("inf")
    w[3, 7, 31] = -float("inf")
    assert count_nonfinite(w) == 3
    assert nonfinite_experts(w) == {1: 1, 3: 2}
    with pytest.raises(MoeConvertError, match=r"expert 9: 1, expert 11: 2") as err:
        require_finite(w, tensor="model.layers.3.mlp.experts.w13", expert_offset=8)
    assert "model.layers.3.mlp.experts.w13" in str(err.value)
    require_finite(torch.ones(2, 32), tensor="fine")


def test_any_leading_shape_and_strided_inputs_give_the_same_bytes():
    w = _random_weights((3, 20, 128), torch.bfloat16, seed=5)
    packed, scales = quantize_mxfp4(w)
    assert torch.equal(quantize_mxfp4(w[1, 7])[0], packed[1, 7])  # 1-D
    assert torch.equal(quantize_mxfp4(w.reshape(60, 128))[0], packed.reshape(60, 64))
    strided = w.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous() and torch.equal(quantize_mxfp4(strided)[1], scales)
    before = w.clone()
    quantize_mxfp4(w)
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))  # the input is not written


def test_empty_input():
    packed, scales = quantize_mxfp4(torch.zeros(0, 7, 64, dtype=torch.bfloat16))
    assert packed.shape == (0, 7, 32) and scales.shape == (0, 7, 2)


# ==================================================================================================
# 5. The engines' own quantizers as oracles (subprocess, TRITON_INTERPRET=1)


def _tie_heavy(shape, dtype, seed, spread):
    """Blocks of grid points, rounding boundaries and their 1-ulp neighbours, times 2^p."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 6.5, 7, 7.5])
    blocks = torch.Size(shape[:-1]) + (shape[-1] // 32, 32)
    v = grid[torch.randint(0, len(grid), blocks, generator=g)]
    v = torch.where(torch.rand(blocks, generator=g) < 0.5, -v, v)
    p = torch.randint(-spread, spread + 1, blocks[:-1] + (1,), generator=g).float()
    x = torch.ldexp(v, p).to(dtype)
    # nudge a quarter of the nonzero elements one ulp up or down in magnitude
    width = 16 if dtype != torch.float32 else 32
    ints = torch.int16 if width == 16 else torch.int32
    step = torch.randint(-1, 2, blocks, generator=g) * (torch.rand(blocks, generator=g) < 0.25)
    bits = x.view(ints).to(torch.int64) & ((1 << width) - 1)
    sign, mag = bits & (1 << (width - 1)), bits & ((1 << (width - 1)) - 1)
    finite_max = torch.tensor(torch.finfo(dtype).max, dtype=dtype).view(ints).item()
    mag = torch.where(mag > 0, (mag + step).clamp(0, finite_max), mag)
    bits = sign | mag
    bits = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)
    return bits.to(ints).view(dtype).view(shape)


def _extremes(dtype):
    """Scale-byte edges: zero/-0 blocks, tiny blocks (S = 0, 1, 2), subnormals, the top of the range."""
    rows = []
    f = torch.finfo(dtype)
    for amax in ([0.0, f.tiny, f.tiny * 1.75, f.tiny * 3.5, f.tiny * 7, f.tiny * 4, f.tiny * 2 ** 5,
                  f.max, f.max / 1.1, f.max / 2, 2.0 ** 127 * 1.75, 2.0 ** 127 * 1.5, 1.0]):
        if amax > f.max:
            continue
        for tail in (0.0, 2.0 ** -8, 0.25, 0.37, 0.75, 1 / 3):
            rows.append([amax] + [amax * tail * (-1) ** i for i in range(31)])
    rows.append([-0.0] * 32)
    rows.append([0.0, -0.0] * 16)
    sub = f.tiny * 2.0 ** -3  # subnormals of the input dtype, alone and under a normal max
    rows.append([sub * (i - 16) / 16 for i in range(32)])
    rows.append([f.tiny * 1.7] + [sub * (i - 16) / 16 for i in range(31)])
    for amax in (f.tiny * 4, f.tiny * 8):  # S = 1 and S = 2 blocks whose subnormals get codes
        rows.append([amax] + [f.tiny * (i - 15) / 16 for i in range(31)])
    for e in range(-127, 128):  # one block per scale byte the dtype can reach
        if f.tiny / 2**4 <= 1.5 * 2.0**e <= f.max:
            rows.append([1.5 * 2.0**e] + [0.77 * 2.0**e * (i - 15) / 16 for i in range(31)])
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


def _oracle_cases() -> dict[str, torch.Tensor]:
    cases = {}
    for dtype, name, spread in ((torch.bfloat16, "bf16", 40), (torch.float16, "fp16", 8), (torch.float32, "fp32", 40)):
        cases[f"randn_{name}"] = (0.02 * torch.randn(2, 130, 256, generator=torch.Generator().manual_seed(10))).to(dtype)
        cases[f"wide_{name}"] = _random_weights((2, 64, 512), dtype, seed=11, spread=spread)
        cases[f"ties_{name}"] = _tie_heavy((2, 96, 256), dtype, seed=12, spread=spread if dtype != torch.float16 else 10)
        cases[f"extremes_{name}"] = _extremes(dtype)
    # non-finite elements among finite ones (not whole-NaN blocks, whose scale depends on the payload)
    nf = _random_weights((1, 8, 256), torch.bfloat16, seed=13).clone()
    nf.view(-1)[::37] = float("inf")
    nf.view(-1)[5::41] = -float("inf")
    nf.view(-1)[9::29] = float("nan")
    cases["nonfinite_bf16"] = nf
    return cases


def _find_vllm_source(version: str) -> tuple[str | None, str]:
    """(path to vLLM ``version``'s wheel or a directory holding its vllm/, or None, why not)."""
    where = vllm_location(version)  # $MOECONVERT_VLLM_SRC, the installed vllm, the plugin tests' (helpers.py)
    if where is None:
        return None, vllm_missing(version)
    src = str(where if where.is_file() else where.parent)
    try:
        ok = (VLLM_QUANTIZER in zipfile.ZipFile(src).namelist()) if src.endswith(".whl") else \
            (Path(src) / VLLM_QUANTIZER).is_file()
    except (OSError, zipfile.BadZipFile):
        ok = False
    return (src, "") if ok else (None, f"{src} (vLLM {version}) has no {VLLM_QUANTIZER}")


def _run_oracles(tmp: Path, cases: dict[str, torch.Tensor], device: str, version: str = VLLM_VERSION) -> dict:
    src, why = _find_vllm_source(version)
    if src is None:
        pytest.skip(why)
    pytest.importorskip("triton", reason="the oracles are Triton kernels")
    torch.save(cases, tmp / "cases.pt")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # only in the child: it changes every Triton kernel
    proc = subprocess.run(
        [sys.executable, __file__, "oracle", "--src", src, "--work", str(tmp), "--device", device],
        env=env, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(f"oracle subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return torch.load(tmp / "results.pt")


def _differences(ours, theirs, x) -> str:
    """Empty when identical, else a count and the first differing block."""
    (p, s), (tp, ts) = ours, theirs
    dp, ds = int((p != tp).sum()), int((s != ts).sum())
    if dp == 0 and ds == 0:
        return ""
    bad = (p != tp).view(*p.shape[:-1], -1, 16).any(-1) | (s != ts)
    idx = tuple(torch.nonzero(bad)[0].tolist())
    blk = x.view(*x.shape[:-1], -1, 32)[idx]
    return (f"{dp}/{p.numel()} packed bytes and {ds}/{s.numel()} scale bytes differ; first at block {idx}: "
            f"x={blk.float().tolist()} ours S={s[idx].item()} "
            f"{bytes(p.view(*p.shape[:-1], -1, 16)[idx].tolist()).hex()} theirs S={ts[idx].item()} "
            f"{bytes(tp.view(*tp.shape[:-1], -1, 16)[idx].tolist()).hex()}")


def _compare(results: dict, cases: dict) -> list[str]:
    problems = []
    for (oracle, case), theirs in sorted(results.items()):
        x = cases[case]
        rule = "vllm" if oracle.startswith("vllm") else "triton_kernels"
        ours = quantize_mxfp4(x.to(theirs[0].device), rule)
        diff = _differences(ours, theirs, x)
        if diff:
            problems.append(f"{oracle} on {case}: {diff}")
    return problems


@pytest.fixture(scope="module", params=VLLM_VERSIONS, ids=lambda v: f"vllm{v}")
def interpreter_results(tmp_path_factory, request):
    """Each vLLM version's quantizer run on the cases (its own mxfp4_utils.py and vendored triton_kernels)."""
    cases = _oracle_cases()
    return cases, _run_oracles(tmp_path_factory.mktemp("mxfp4_oracle"), cases, "cpu", request.param)


def test_vllm_rule_matches_vllms_triton_quantizer(interpreter_results):
    """Each vLLM version's ``mxfp4_utils.downcast_to_mxfp`` (the online MoE quantizer), zero differing bytes.

    bf16/fp16 through vLLM's own wrapper; fp32 (which that wrapper refuses) through a two-line
    kernel that calls vLLM's ``_compute_quant_and_scale`` on fp32 tiles.
    """
    cases, results = interpreter_results
    mine = {k: v for k, v in results.items() if k[0].startswith("vllm")}
    assert {c for _, c in mine} == set(cases)
    assert _compare(mine, cases) == []


def test_triton_kernels_rule_matches_triton_kernels_downcast(interpreter_results):
    cases, results = interpreter_results
    mine = {k: v for k, v in results.items() if k[0] == "triton_kernels"}
    assert {c for _, c in mine} == set(cases) - {"nonfinite_bf16"}
    assert _compare(mine, cases) == []


def test_the_three_rules_really_differ_on_random_weights(interpreter_results):
    """The rules really differ on real data (so the two oracle tests above are not vacuous)."""
    cases, results = interpreter_results
    x = cases["randn_bf16"]
    for oracle, rule in (("vllm", "ocp"), ("triton_kernels", "ocp"), ("triton_kernels", "vllm")):
        theirs = results[(oracle, "randn_bf16")]
        ours = quantize_mxfp4(x, rule)
        assert int((ours[0] != theirs[0]).sum()) > 0.05 * ours[0].numel(), (oracle, rule)


# ==================================================================================================
# 6. GPU: same bytes as on CPU, and vLLM's kernel compiled for the GPU


def _gpu_inputs() -> dict[str, torch.Tensor]:
    inputs = {
        "randn_bf16": (0.02 * torch.randn(8, 256, 1024, generator=torch.Generator().manual_seed(20))).bfloat16(),
        "wide_bf16": _random_weights((4, 128, 1024), torch.bfloat16, seed=21, spread=60),
        "ties_bf16": _tie_heavy((4, 128, 512), torch.bfloat16, seed=22, spread=100),
        "wide_fp16": _random_weights((4, 128, 512), torch.float16, seed=23, spread=12),
        "wide_fp32": _random_weights((4, 128, 512), torch.float32, seed=24, spread=120),
        "ties_fp32": _tie_heavy((4, 128, 512), torch.float32, seed=25, spread=120),
    }
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        inputs[f"extremes_{name}"] = _extremes(dtype)
    nf = _random_weights((2, 16, 256), torch.bfloat16, seed=26).clone()
    for start, step, value in ((0, 37, float("inf")), (5, 41, -float("inf")), (9, 29, float("nan")), (3, 31, -float("nan"))):
        nf.view(-1)[start::step] = value
    nf[1, 3] = float("nan")  # all-NaN blocks: the GPU's max is its canonical NaN (S = 0)
    nf[1, 4, :32] = -float("nan")
    inputs["nonfinite_bf16"] = nf
    return inputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule", ["vllm", "ocp", "triton_kernels"])
def test_cpu_and_cuda_give_identical_bytes(rule):
    for name, x in _gpu_inputs().items():
        cpu = quantize_mxfp4(x, rule)
        gpu = quantize_mxfp4(x.cuda(), rule)
        assert gpu[0].is_cuda
        assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1]), (name, rule)
        d_cpu = dequantize_mxfp4(*cpu).view(torch.int32)
        d_gpu = dequantize_mxfp4(*gpu).cpu().view(torch.int32)
        assert torch.equal(d_cpu, d_gpu), (name, rule)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vllm_rule_matches_vllms_kernel_compiled_for_the_gpu(tmp_path, vllm_version):
    """The same oracle, compiled (no interpreter): settles docs/mxfp4-rounding.md on this GPU."""
    cases = {k: v for k, v in _gpu_inputs().items()}
    results = _run_oracles(tmp_path, cases, "cuda", vllm_version)
    assert _compare(results, cases) == []


# ==================================================================================================
# The oracle subprocess: loads vLLM's quantizer file and triton_kernels unmodified, runs them.
#
# mxfp4_utils.py imports five vllm modules; these stubs stand in for them and nothing else:
#   vllm.logger.init_logger            -> logging.getLogger
#   vllm.platforms.current_platform    -> every is_*() answers False (the path it then takes on
#                                         CUDA is downcast_to_mxfp, which is what we call)
#   vllm.triton_utils.tl / .triton     -> the real triton.language / triton
#   vllm.utils.import_utils            -> get_triton_kernels_version() = "3.5.1", has_triton_kernels() = False
#   vllm.utils.torch_utils             -> direct_register_custom_op registers the op with
#                                         torch.library (the module looks it up right after);
#                                         is_torch_equal_or_newer() = True
# Under TRITON_INTERPRET=1 the child makes two interpreter primitives behave as on the GPU; the
# kernels themselves are untouched:
#   * bf16 -> fp32: the Triton 3.9 interpreter widens bf16 subnormals wrongly (docs/mxfp4-rounding.md
#     §10.3); replaced by the exact 16-bit shift the GPU does, so subnormal inputs can be compared.
#   * tl.exp2 on fp32: compiled for NVIDIA it is ex2.approx.ftz.f32 (Triton's default
#     enable_reflect_ftz), so vLLM's exp2(-127) for S = 0 is 0, not numpy's exact 2^-127 (measured
#     on an H200; docs/mxfp4-rounding.md). The interpreter's exp2 flushes subnormal results likewise.
# triton_kernels needs one module constant as a plain int under the interpreter (§10.2). NaN
# signs are left out of the CPU cases: numpy keeps them, the GPU returns its canonical +NaN.

_FP32_TILES = '''
import triton
import triton.language as tl
from vllm.model_executor.layers.quantization.utils.mxfp4_utils import _compute_quant_and_scale


@triton.jit
def fp32_tiles(src, out, scale, n_rows, BLOCK_ROWS: tl.constexpr):
    # rows of one 32-block each; the quantization itself is vLLM's
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    mask = rows < n_rows
    x = tl.load(src + rows * 32 + tl.arange(0, 32)[None, :], mask=mask)
    q, s = _compute_quant_and_scale(x, mask & (tl.arange(0, 32)[None, :] < 32))
    tl.store(out + rows * 16 + tl.arange(0, 16)[None, :], q, mask=mask)
    tl.store(scale + rows + tl.arange(0, 1)[None, :], s, mask=mask)
'''


def _oracle_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    work = Path(args.work)
    root = work / "src"
    if args.src.endswith(".whl"):
        with zipfile.ZipFile(args.src) as z:
            for name in z.namelist():
                if name == VLLM_QUANTIZER or (name.startswith(TRITON_KERNELS) and name.endswith(".py")):
                    z.extract(name, root)
    else:
        root = Path(args.src)

    import numpy as np
    import triton
    import triton.language as tl

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        from triton.runtime import interpreter

        original = interpreter._convert_float

        def exact_bf16_widening(data, src_dtype, dst_dtype, rounding_mode):
            if src_dtype == tl.bfloat16 and dst_dtype == tl.float32:
                return data.view(np.uint16).astype(np.uint32) << 16
            return original(data, src_dtype, dst_dtype, rounding_mode)

        interpreter._convert_float = exact_bf16_widening

        def exp2_ftz(x):
            r = np.exp2(x)
            if r.dtype == np.float32:
                r = np.where(np.abs(r) < np.finfo(np.float32).tiny, np.float32(0) * r, r).astype(np.float32)
            return r

        interpreter.InterpreterBuilder.create_exp2 = lambda self, arg: self.unary_op(arg, exp2_ftz)

    def stub(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []
        sys.modules[name] = mod

    class _NoPlatform:
        def __getattr__(self, name):
            return lambda *a, **k: False

    libs = []

    def direct_register_custom_op(op_name, op_func, fake_impl=None, mutates_args=(), **_):
        from torch._library.infer_schema import infer_schema

        lib = torch.library.Library("vllm", "FRAGMENT")
        lib.define(op_name + infer_schema(op_func, mutates_args=mutates_args))
        lib.impl(op_name, op_func, "CompositeExplicitAutograd")
        libs.append(lib)

    for name in ("vllm", "vllm.utils", "vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.quantization", "vllm.model_executor.layers.quantization.utils"):
        stub(name)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.platforms", current_platform=_NoPlatform())
    stub("vllm.triton_utils", tl=tl, triton=triton)
    stub("vllm.utils.import_utils", get_triton_kernels_version=lambda: "3.5.1", has_triton_kernels=lambda: False)
    stub("vllm.utils.torch_utils", direct_register_custom_op=direct_register_custom_op,
         is_torch_equal_or_newer=lambda v: True)
    qname = VLLM_QUANTIZER[:-3].replace("/", ".")
    spec = importlib.util.spec_from_file_location(qname, root / VLLM_QUANTIZER)
    vq = importlib.util.module_from_spec(spec)
    sys.modules[qname] = vq
    spec.loader.exec_module(vq)

    (work / "fp32_tiles.py").write_text(_FP32_TILES)
    sys.path.insert(0, str(work))
    from fp32_tiles import fp32_tiles

    sys.path.insert(0, str(root / "vllm/third_party"))
    import triton_kernels.numerics_details.mxfp as tk
    import triton_kernels.numerics_details.mxfp_details._downcast_to_mxfp as tk_kernel

    if interpreted:
        tk_kernel.MXFP_BLOCK_SIZE = 32

    def vllm_fp32(x):
        rows = x.reshape(-1, 32).contiguous()
        out = torch.empty(rows.shape[0], 16, dtype=torch.uint8, device=x.device)
        scale = torch.empty(rows.shape[0], 1, dtype=torch.uint8, device=x.device)
        fp32_tiles[(triton.cdiv(rows.shape[0], 64),)](rows, out, scale, rows.shape[0], BLOCK_ROWS=64)
        return out.view(*x.shape[:-1], -1), scale.view(*x.shape[:-1], -1)

    cases = torch.load(work / "cases.pt")
    results = {}
    for case, x in cases.items():
        x = x.to(args.device)
        if x.dtype == torch.float32:
            results[("vllm_fp32_tiles", case)] = vllm_fp32(x)
        else:
            p, s, _ = vq.downcast_to_mxfp(x, axis=-1)
            results[("vllm", case)] = (p.contiguous(), s.contiguous())
        if args.device != "cpu" or not case.startswith("nonfinite"):
            p, s = tk.downcast_to_mxfp(x, torch.uint8, axis=-1)
            results[("triton_kernels", case)] = (p.contiguous(), s.contiguous())
    torch.save({k: (p.cpu(), s.cpu()) for k, (p, s) in results.items()}, work / "results.pt")
    print(json.dumps({"cases": len(cases), "results": len(results), "interpreted": interpreted}))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "oracle":
    _oracle_main(sys.argv[2:])
