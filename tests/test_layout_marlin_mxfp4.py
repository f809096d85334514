"""The ``marlin`` layout for MXFP4 experts: what vLLM 0.33.0's Marlin MoE kernel reads (docs/layouts/marlin-mxfp4.md).

Proved three ways (decode(encode(x)) == x and the rest every layout owes: tests/test_layout_contract.py):
the spec's closed forms (§6.2), written out by hand here and read back out of our bytes; vLLM's own
load-time Python (``prepare_moe_mxfp4_layer_for_marlin``,
the gpt-oss loader's ``weight_loader``, its reference repack ``marlin_weights``), run on CPU when its
source is at hand (MOECONVERT_VLLM_SRC = a vllm-0.33.0 wheel or a folder holding ``vllm/``); and, on a
GPU, vLLM's compiled ``moe_wna16_marlin_gemm`` run on our bytes (MOECONVERT_VLLM_MOE_LIB).
"""

from __future__ import annotations

import ast
import enum
import functools
import mmap
import sys
import types

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import get_layout
from moeconvert.layouts.marlin import MarlinLayout
from moeconvert.layouts.marlin_mxfp4 import (
    MarlinMXFP4Layout,
    permute_scales,
    repack_fp4,
    unpermute_scales,
    unrepack_fp4,
)
from moeconvert.mxfp4 import dequantize_mxfp4
from moeconvert.schemes import MXFP4Scheme

from helpers import exec_nodes, lift, rel, same_bits, top_level, vllm_moe_ops, vllm_reader
from factories import mxfp4_block

LAYOUT = get_layout("marlin", "mxfp4")
SCHEME = MXFP4Scheme()


def layer(E, Hp, Ip, bias=False, activation="silu", dtype="bfloat16"):
    return LayerShape(num_experts=E, hidden_size=Hp, intermediate_size=Ip, has_bias=bias,
                      activation=activation, dtype=dtype)


def hex_words(t: torch.Tensor) -> list[str]:
    return [f"{int(x) & 0xFFFFFFFF:08x}" for x in t.flatten()]


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------------
# The spec's closed forms (§6.2), written from its text


def spec_kernel_row(r: torch.Tensor, Ip: int, activation: str) -> torch.Tensor:
    """Canonical w13 row held at kernel row r: the same for silu; gate r/2 or up (r-1)/2 for swigluoai."""
    return r if activation == "silu" else r // 2 + Ip * (r % 2)


def spec_codes_kn(packed: torch.Tensor) -> torch.Tensor:
    """One expert's packed [N, K/2] bytes -> e2m1 codes [K, N] (element 2j in the low nibble of byte j)."""
    N, Kb = packed.shape
    codes = torch.empty(N, 2 * Kb, dtype=torch.int64)
    codes[:, 0::2] = packed.long() & 0xF
    codes[:, 1::2] = packed.long() >> 4
    return codes.T


def spec_marlin_words(codes_kn: torch.Tensor) -> torch.Tensor:
    """§6.2: word (kt, c) with g = c//128, w = c%128, i = w//4, j = w%4, col = i//4, t = i%4, nt = 4g + j
    holds at bits 4·slot the codes of (b, a), (b+8, a), (b, a+8), (b+8, a+8), (b+1, a), (b+9, a),
    (b+1, a+8), (b+9, a+8), with b = 16kt + 2t and a = 16nt + col."""
    K, N = codes_kn.shape
    kt = torch.arange(K // 16).view(-1, 1)
    c = torch.arange(2 * N).view(1, -1)
    g, w = c // 128, c % 128
    i, j = w // 4, w % 4
    col, t = i // 4, i % 4
    nt = 4 * g + j
    b, a = 16 * kt + 2 * t, 16 * nt + col
    slots = [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)]
    word = torch.zeros(K // 16, 2 * N, dtype=torch.int64)
    for slot, (dk, dn) in enumerate(slots):
        word |= codes_kn[b + dk, a + dn] << (4 * slot)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def spec_scale_src(n: int) -> torch.Tensor:
    """Source column of each output column: 8x8 transpose in runs of 64, then [0, 2, 1, 3] in runs of 4."""
    c = torch.arange(n)
    s = 4 * ((c % 64) // 4) + torch.tensor([0, 2, 1, 3])[c % 4]
    return 64 * (c // 64) + 8 * (s % 8) + s // 8


def spec_bias_src(n: int) -> torch.Tensor:
    """marlin_permute_bias: output p of each run of 32 takes input 2·(p//8) + [0,1,8,9,16,17,24,25][p%8]."""
    c = torch.arange(n)
    return 32 * (c // 32) + 2 * ((c % 32) // 8) + torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])[c % 8]


# ---------------------------------------------------------------------------------------------------
# hand-written vectors


def test_word_zero_for_code_equal_k_reads_as_the_b_fragment():
    # code(k, n) = k for one 16x64 tile: thread 0 holds k = 0,8,0,8,1,9,1,9 for n = 0, 8
    k = torch.arange(16)
    packed = (k[0::2] | (k[1::2] << 4)).to(torch.uint8).expand(64, 8)[None]
    words = repack_fp4(packed)
    assert words.shape == (1, 1, 128)
    assert hex_words(words)[:4] == ["91918080"] * 4
    assert hex_words(words)[4:8] == ["b3b3a2a2"] * 4  # t = 1: k = 2,10,2,10,3,11,3,11


def test_scale_permutation_by_hand():
    s = torch.arange(128).to(torch.uint8).view(1, 1, 128)  # [E, K/32, N], value = column
    out = permute_scales(s)[0, 0].tolist()
    assert out[:16] == [0, 16, 8, 24, 32, 48, 40, 56, 1, 17, 9, 25, 33, 49, 41, 57]
    assert out[56:64] == [7, 23, 15, 31, 39, 55, 47, 63]
    assert out[64:68] == [64, 80, 72, 88]  # runs of 64 are independent
    assert torch.equal(permute_scales(s)[0, 0], s[0, 0, spec_scale_src(128)])
    assert torch.equal(unpermute_scales(permute_scales(s)), s)


@pytest.mark.parametrize("activation,scales16,bias8", [
    ("silu", [0, 16, 8, 24, 32, 48, 40, 56, 1, 17, 9, 25, 33, 49, 41, 57], [0, 1, 8, 9, 16, 17, 24, 25]),
    # swigluoai: kernel row r is canonical gate r/2 (r even) or up Ip + (r-1)/2, Ip = 128
    ("swigluoai", [0, 8, 4, 12, 16, 24, 20, 28, 128, 136, 132, 140, 144, 152, 148, 156],
     [0, 128, 4, 132, 8, 136, 12, 140]),
])
def test_w13_scale_and_bias_columns_by_hand(activation, scales16, bias8):
    E, Hp, Ip = 1, 256, 128
    block = mxfp4_block(E, Hp, Ip, bias=True)
    block.w13_scale[0, :, 0] = torch.arange(2 * Ip).to(torch.uint8)  # K-block 0: value = canonical row
    block.w13_bias = torch.arange(2 * Ip, dtype=torch.bfloat16).view(1, -1)  # exact in bf16
    t = LAYOUT.encode(block, layer(E, Hp, Ip, bias=True, activation=activation))
    assert u8(t["w13_weight_scale"])[0, 0, :16].tolist() == scales16
    assert t["w13_bias"][0, :8].tolist() == bias8


def test_w2_bias_by_hand():
    block = mxfp4_block(1, 256, 128, bias=True)
    block.w2_bias = torch.arange(256, dtype=torch.bfloat16).view(1, -1)
    t = LAYOUT.encode(block, layer(1, 256, 128, bias=True))
    assert t["w2_bias"][0, :16].tolist() == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27]
    assert t["w2_bias"][0, 32:36].tolist() == [32, 33, 40, 41]


# ---------------------------------------------------------------------------------------------------
# every byte against the closed forms


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("Hp,Ip", [(256, 128), (512, 384)])
def test_every_tensor_equals_the_spec_closed_forms(Hp, Ip, activation):
    E = 2
    block = mxfp4_block(E, Hp, Ip, bias=True, seed=Hp + Ip)
    t = LAYOUT.encode(block, layer(E, Hp, Ip, bias=True, activation=activation))
    rows = spec_kernel_row(torch.arange(2 * Ip), Ip, activation)
    for e in range(E):
        assert torch.equal(t["w13_weight"][e], spec_marlin_words(spec_codes_kn(block.w13[e][rows])))
        assert torch.equal(t["w2_weight"][e], spec_marlin_words(spec_codes_kn(block.w2[e])))
        assert torch.equal(u8(t["w13_weight_scale"])[e], block.w13_scale[e][rows].T[:, spec_scale_src(2 * Ip)])
        assert torch.equal(u8(t["w2_weight_scale"])[e], block.w2_scale[e].T[:, spec_scale_src(Hp)])
        assert torch.equal(t["w13_bias"][e], block.w13_bias[e][rows][spec_bias_src(2 * Ip)])
        assert torch.equal(t["w2_bias"][e], block.w2_bias[e][spec_bias_src(Hp)])


def test_dequantized_gemm1_columns_follow_the_activation():
    """Read back with the spec's forms: GEMM1 output column 2j is gate j and 2j+1 is up j for swigluoai."""
    E, Hp, Ip = 1, 256, 128
    block = mxfp4_block(E, Hp, Ip, scales=(118, 126), seed=4)
    canon = dequantize_mxfp4(block.w13[0], block.w13_scale[0])  # [2Ip, Hp]
    for activation in ("silu", "swigluoai"):
        t = LAYOUT.encode(block, layer(E, Hp, Ip, activation=activation))
        codes = unrepack_fp4(t["w13_weight"], 2 * Ip, Hp)[0]
        src = torch.empty(2 * Ip, dtype=torch.long)
        src[spec_scale_src(2 * Ip)] = torch.arange(2 * Ip)
        scales = u8(t["w13_weight_scale"])[0][:, src].T.contiguous()  # undo the column permutation
        kernel = dequantize_mxfp4(codes, scales)
        if activation == "silu":
            assert torch.equal(kernel, canon)
        else:
            assert torch.equal(kernel[0::2], canon[:Ip]) and torch.equal(kernel[1::2], canon[Ip:])


# ---------------------------------------------------------------------------------------------------
# decode of the scale bytes, the bias cast, plans


def test_decode_takes_scale_bytes_as_uint8_too():
    shape, block = layer(2, 256, 128), mxfp4_block(2, 256, 128, seed=9)
    tensors = {k: (u8(v) if v.dtype == torch.float8_e8m0fnu else v) for k, v in LAYOUT.encode(block, shape).items()}
    assert LAYOUT.decode(tensors, shape, SCHEME).differences(block) == []


def test_biases_are_cast_to_bf16_and_expected_so():
    shape = layer(2, 256, 128, bias=True)
    block = mxfp4_block(2, 256, 128, bias=True, bias_dtype=torch.float32, seed=3)
    block.w13_bias[0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # ties: RNE -> 1, 1+2^-6, -1
    decoded = LAYOUT.decode(LAYOUT.encode(block, shape), shape, SCHEME)
    assert decoded.w13_bias.dtype == torch.bfloat16
    assert decoded.w13_bias[0, :3].tolist() == [1.0, 1 + 2**-6, -1.0]
    assert decoded.differences(LAYOUT.expected_block(block, shape)) == []
    assert decoded.differences(block)  # the cast is a real value change


def test_plan_shapes_and_dtypes_equal_spec_section_9():
    E, Hp, Ip = 3, 3072, 2944  # gpt-oss-20b at TP 1: H = I = 2880
    assert [(s.suffix, s.shape, s.dtype) for s in LAYOUT.plan(layer(E, Hp, Ip, bias=True), SCHEME)] == [
        ("w13_weight", (3, 192, 11776), torch.int32),
        ("w2_weight", (3, 184, 6144), torch.int32),
        ("w13_weight_scale", (3, 96, 5888), torch.float8_e8m0fnu),
        ("w2_weight_scale", (3, 92, 3072), torch.float8_e8m0fnu),
        ("w13_bias", (3, 5888), torch.bfloat16),
        ("w2_bias", (3, 3072), torch.bfloat16),
    ]


# ---------------------------------------------------------------------------------------------------
# registry, check, metadata


def test_registry_finds_one_marlin_layout_per_scheme_kind():
    assert isinstance(get_layout("marlin", "mxfp4"), MarlinMXFP4Layout)
    assert isinstance(get_layout("marlin", "wna16"), MarlinLayout)
    assert LAYOUT.pad_multiples == (256, 128)
    assert LAYOUT.name == "marlin" and LAYOUT.version == 1 and LAYOUT.schemes == ("mxfp4",)


def test_check_reports_every_violated_constraint_at_once():
    problems = LAYOUT.check(layer(2, 200, 100, dtype="float16", activation="gelu"), MXFP4Scheme(block_size=16))
    text = "\n".join(problems)
    assert len(problems) == 5, text
    for needle in ("MXFP4 block size = 16", "hidden_size Hp = 200 must be a multiple of 256",
                   "intermediate_size Ip = 100 (per TP partition) must be a multiple of 128",
                   "model dtype = float16", "activation = gelu"):
        assert needle in text
    fp16 = next(p for p in problems if "float16" in p)
    assert "no Marlin MoE kernel" in fp16 and "--dtype bfloat16" in fp16 and "NaN" in fp16
    assert any("model dtype = float32" in p for p in LAYOUT.check(layer(2, 256, 128, dtype="float32"), SCHEME))
    assert LAYOUT.check(layer(2, 256, 128), SCHEME) == []
    assert LAYOUT.check(layer(2, 512, 384, activation="swigluoai"), SCHEME) == []


def test_metadata_names_the_w13_row_order():
    assert LAYOUT.layer_metadata(layer(2, 256, 128), SCHEME) == {"w13_rows": "gate_up", "is_a_8bit": False}
    assert LAYOUT.layer_metadata(layer(2, 256, 128, activation="swigluoai"), SCHEME)["w13_rows"] == "interleaved"


# ---------------------------------------------------------------------------------------------------
# Oracle: each vLLM version's own Python, lifted out of its files with ast and run on CPU

_VLLM_DEFS = {
    "model_executor/layers/quantization/utils/marlin_utils_fp4.py":
        ["_repack_marlin_experts", "mxfp4_marlin_process_scales", "prepare_moe_mxfp4_layer_for_marlin",
         "prepare_moe_fp4_layer_for_marlin"],
    "model_executor/layers/quantization/utils/marlin_utils.py":
        ["get_scale_perms", "marlin_permute_scales", "marlin_permute_bias"],
    "model_executor/layers/quantization/utils/quant_utils.py": ["get_pack_factor", "unpack_cols"],
    "model_executor/layers/quantization/utils/marlin_utils_test.py":
        ["marlin_permute_weights", "marlin_weights", "get_weight_perm"],
    "utils/math_utils.py": ["round_up"],
    "model_executor/layers/fused_moe/oracle/mxfp4.py":
        ["Mxfp4MoeBackend", "B12X_BACKENDS", "FLASHINFER_MOE_EP_MXFP4_BACKENDS", "TRTLLM_BACKENDS",
         "mxfp4_round_up_hidden_size_and_intermediate_size"],
}
ORACLE_MXFP4 = "model_executor/layers/fused_moe/oracle/mxfp4.py"


@functools.lru_cache(maxsize=None)
def vllm_reference(version: str):
    """vLLM ``version``'s functions run with torch/numpy only. The CUDA ``gptq_marlin_repack`` is stood in by vLLM's
    own Python reference (``get_weight_perm`` + ``marlin_weights``), which its ``test_gptq_marlin_repack``
    holds the CUDA op to; ``VLLM_MARLIN_INPUT_DTYPE`` is unset (``get_marlin_input_dtype() -> None``)."""
    import numpy

    read = vllm_reader(version)
    ns: dict = {"torch": torch, "numpy": numpy, "np": numpy, "Enum": enum.Enum, "GPTQ_MARLIN_TILE": 16,
                "get_marlin_input_dtype": lambda *a, **k: None,
                "current_platform": types.SimpleNamespace(is_xpu=lambda: False, is_rocm=lambda: False)}
    for path, names in _VLLM_DEFS.items():
        lift(read, path, names, ns)

    # The gpt-oss MXFP4 checkpoint goes through RoutedExperts.weight_loader (its non-overload definition).
    rel = "model_executor/layers/fused_moe/routed_experts.py"
    cls = top_level(read(rel))["RoutedExperts"]
    loaders = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "weight_loader"
               and not any("overload" in ast.unparse(d) for d in n.decorator_list)]
    assert len(loaders) == 1, f"vllm/{rel}: RoutedExperts.weight_loader changed"
    # 0.34.0's loader copies through copy_weight_ (a plain copy_ off integrated GPUs, as here: CPU tensors)
    if "copy_weight_" in top_level(read("model_executor/utils.py")):
        ns.update(functools=functools, mmap=mmap)
        lift(read, "model_executor/utils.py", ["copy_weight_", "_is_integrated_gpu"], ns)
    exec_nodes(loaders, f"vllm/{rel}", ns)

    def gptq_marlin_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        # 0.33.0 passes is_a_8bit (False: 16-bit activations); 0.34.0 dropped the 8-bit activation path
        assert not is_a_8bit
        q = ns["unpack_cols"](b_q_weight.T.contiguous(), num_bits, size_n, size_k).T.contiguous()
        return ns["marlin_weights"](q, size_k, size_n, num_bits, ns["get_weight_perm"](num_bits))

    ns["ops"] = types.SimpleNamespace(gptq_marlin_repack=gptq_marlin_repack)
    ns["replace_parameter"] = lambda layer, name, t: setattr(layer, name, t)  # vllm/model_executor/utils.py's
    return types.SimpleNamespace(read=read, **ns)


def vllm_marlin(ref, w13, w2, s13, s2, b13, b2, params_dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    out = ref.prepare_moe_mxfp4_layer_for_marlin(types.SimpleNamespace(params_dtype=params_dtype),
                                                 w13, w2, s13, s2, b13, b2)
    names = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias")
    return {n: t for n, t in zip(names, out) if t is not None}


def _assert_equal_to_vllm(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name in ours:
        assert same_bits(ours[name], theirs[name]), name


@pytest.mark.parametrize("E,Hp,Ip,bias", [(2, 256, 128, False), (3, 256, 384, True), (1, 512, 256, True)])
def test_bytes_equal_vllm_online_marlin_path(E, Hp, Ip, bias, vllm_version):
    """Online path (silu): vLLM quantizes its padded [gate; 0; up; 0] params and hands them straight to
    prepare_moe_mxfp4_layer_for_marlin; our canonical block is those params."""
    ref = vllm_reference(vllm_version)
    shape, block = layer(E, Hp, Ip, bias), mxfp4_block(E, Hp, Ip, bias, seed=E + Hp + Ip)
    theirs = vllm_marlin(ref, block.w13, block.w2, block.w13_scale, block.w2_scale, block.w13_bias, block.w2_bias)
    _assert_equal_to_vllm(LAYOUT.encode(block, shape), theirs)


@pytest.mark.parametrize("E,H,I,bias", [(2, 192, 96, True), (1, 256, 128, True), (2, 480, 320, False)])
def test_bytes_equal_vllm_gpt_oss_checkpoint_marlin_path(E, H, I, bias, vllm_version):
    """gpt-oss MXFP4 checkpoint (swigluoai): its interleaved rows are copied into the zeroed padded params
    by vLLM's own weight_loader, then prepared for Marlin as they are."""
    ref = vllm_reference(vllm_version)
    Hp, Ip = -(-H // 256) * 256, -(-I // 128) * 128
    gen = torch.Generator().manual_seed(H + I)
    rnd = lambda *s: torch.randint(0, 256, s, generator=gen).to(torch.uint8)
    # the checkpoint, unpadded: w13 rows 2j = gate j, 2j+1 = up j
    ck = dict(w13=rnd(E, 2 * I, H // 2), w13_scale=rnd(E, 2 * I, H // 32), w2=rnd(E, H, I // 2),
              w2_scale=rnd(E, H, I // 32))
    if bias:
        ck.update(w13_bias=torch.randn(E, 2 * I, generator=gen).bfloat16(), w2_bias=torch.randn(E, H, generator=gen).bfloat16())

    # vLLM: GptOssMxfp4MoEMethod.create_weights' zero params (bias always bf16), filled by weight_loader
    stub = types.SimpleNamespace(quant_config=types.SimpleNamespace(get_name=lambda: "gpt_oss_mxfp4"))
    params = dict(w13=torch.zeros(E, 2 * Ip, Hp // 2, dtype=torch.uint8),
                  w13_scale=torch.zeros(E, 2 * Ip, Hp // 32, dtype=torch.uint8),
                  w2=torch.zeros(E, Hp, Ip // 2, dtype=torch.uint8), w2_scale=torch.zeros(E, Hp, Ip // 32, dtype=torch.uint8))
    if bias:
        params.update(w13_bias=torch.zeros(E, 2 * Ip, dtype=torch.bfloat16), w2_bias=torch.zeros(E, Hp, dtype=torch.bfloat16))
    for name, p in params.items():
        ref.weight_loader(stub, torch.nn.Parameter(p, requires_grad=False), ck[name], weight_name=name,
                          shard_id=None, expert_id=None)
    theirs = vllm_marlin(ref, params["w13"], params["w2"], params["w13_scale"], params["w2_scale"],
                         params.get("w13_bias"), params.get("w2_bias"))

    # ours: the canonical padded block ([gate; 0; up; 0] rows, zero K padding), built here by hand
    def gate_up(t):  # [E, 2I, ...] interleaved -> [E, 2Ip, ...]
        out = torch.zeros(E, 2 * Ip, *t.shape[2:], dtype=t.dtype)
        out[:, :I], out[:, Ip:Ip + I] = t[:, 0::2], t[:, 1::2]
        return out

    def pad(t, *sizes):  # zeros appended to the trailing dims
        out = torch.zeros(*t.shape[:t.dim() - len(sizes)], *sizes, dtype=t.dtype)
        out[tuple(slice(0, n) for n in t.shape)] = t
        return out

    kw = dict(w13=pad(gate_up(ck["w13"]), Hp // 2), w13_scale=pad(gate_up(ck["w13_scale"]), Hp // 32),
              w2=pad(ck["w2"], Hp, Ip // 2), w2_scale=pad(ck["w2_scale"], Hp, Ip // 32))
    if bias:
        kw.update(w13_bias=gate_up(ck["w13_bias"]), w2_bias=pad(ck["w2_bias"], Hp))
    block = ExpertBlock(scheme=SCHEME, **kw)
    _assert_equal_to_vllm(LAYOUT.encode(block, layer(E, Hp, Ip, bias, activation="swigluoai")), theirs)


@pytest.mark.parametrize("E,H,I", [(2, 256, 128), (3, 512, 384)])
def test_bytes_equal_vllm_compressed_tensors_mxfp4_marlin_path(E, H, I, vllm_version):
    """compressed-tensors ``mxfp4-pack-quantized`` (``CompressedTensorsW4A4Mxfp4MoEMethod`` on Hopper): the
    loaded ``weight_packed`` / ``weight_scale`` go through ``prepare_moe_fp4_layer_for_marlin`` unpadded,
    [gate; up] rows, no bias. Where H and I are multiples of 256 and 128 the layout pads nothing, and its
    bytes are vLLM's."""
    ref = vllm_reference(vllm_version)
    block = mxfp4_block(E, H, I, seed=E + H + I)
    stub = types.SimpleNamespace(
        moe_config=types.SimpleNamespace(num_local_experts=E, hidden_dim=H, intermediate_size_per_partition=I),
        params_dtype=torch.bfloat16, w13_weight=block.w13, w2_weight=block.w2, w13_weight_scale=block.w13_scale,
        w2_weight_scale=block.w2_scale)
    ref.prepare_moe_fp4_layer_for_marlin(stub)
    theirs = {n: getattr(stub, n) for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")}
    _assert_equal_to_vllm(LAYOUT.encode(block, layer(E, H, I)), theirs)


def test_vllm_marlin_branches_pass_the_loaded_tensors_through(vllm_version):
    """Both routes into Marlin (gpt-oss checkpoint, online) reorder nothing: the layout's row order is
    the loader's, i.e. interleaved for gpt-oss and [gate; up] for per-expert checkpoints."""
    ref = vllm_reference(vllm_version)
    found = top_level(ref.read(ORACLE_MXFP4))
    for fn in ("convert_gpt_oss_weight_to_mxfp4_moe_kernel_format", "convert_weight_to_mxfp4_moe_kernel_format"):
        branches = [n for n in ast.walk(found[fn]) if isinstance(n, ast.If) and "Mxfp4MoeBackend.MARLIN" in ast.unparse(n.test)]
        assert len(branches) == 1, fn
        ret = branches[0].body[-1]
        assert isinstance(ret, ast.Return) and ast.unparse(ret.value) == (
            "prepare_moe_mxfp4_layer_for_marlin(layer, w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, "
            "w13_bias, w2_bias)"), fn


@pytest.mark.parametrize("H,I", [(2880, 2880), (256, 128), (300, 100), (4096, 1536)])
def test_pad_multiples_equal_vllm_round_up(H, I, vllm_version):
    ref = vllm_reference(vllm_version)
    for backend in (ref.Mxfp4MoeBackend.MARLIN, ref.Mxfp4MoeBackend.BATCHED_MARLIN):
        Hp, Ip = ref.mxfp4_round_up_hidden_size_and_intermediate_size(backend, H, I)
        m_h, m_i = LAYOUT.pad_multiples
        assert (Hp, Ip) == (-(-H // m_h) * m_h, -(-I // m_i) * m_i)


def test_vllm_fp16_path_corrupts_scale_bytes_outside_103_142(vllm_version):
    """The evidence for refusing fp16 models (besides the missing kernel): vLLM's own processing."""
    ref = vllm_reference(vllm_version)
    E, Hp, Ip = 1, 256, 128
    block = mxfp4_block(E, Hp, Ip, seed=2)
    block.w2_scale.view(-1)[:256] = torch.arange(256).to(torch.uint8)
    args = (block.w13, block.w2, block.w13_scale, block.w2_scale, None, None)
    bf16, fp16 = vllm_marlin(ref, *args), vllm_marlin(ref, *args, params_dtype=torch.float16)
    assert same_bits(LAYOUT.encode(block, layer(E, Hp, Ip))["w2_weight_scale"], bf16["w2_weight_scale"])
    src = u8(bf16["w2_weight_scale"]).flatten()
    changed = set(src[u8(fp16["w2_weight_scale"]).flatten() != src].tolist())
    assert changed == set(range(1, 103)) | set(range(143, 255))


# ---------------------------------------------------------------------------------------------------
# GPU: vLLM's compiled Marlin MoE kernel on our bytes (run on the device machine with -s)

FLOAT4_E2M1F = 0x2000000010102  # vllm/scalar_type.py: scalar_types.float4_e2m1f.id
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # SwigluOAIAndMul defaults (gpt-oss)


def test_float4_e2m1f_id_equals_vllms(vllm_version):
    ref = vllm_reference(vllm_version)
    mod = types.ModuleType("_vllm_scalar_type")
    sys.modules[mod.__name__] = mod
    try:
        exec(compile(ref.read("scalar_type.py"), "vllm/scalar_type.py", "exec"), mod.__dict__)
    finally:
        del sys.modules[mod.__name__]
    assert mod.scalar_types.float4_e2m1f.id == FLOAT4_E2M1F


GPU_CASES = [
    # E, Hp, Ip, bias, activation
    (4, 256, 128, False, "silu"),
    (4, 512, 256, True, "silu"),
    (4, 256, 384, True, "swigluoai"),
    (2, 3072, 2944, True, "swigluoai"),  # gpt-oss-20b at TP 1
]


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The model's gated activation: SiLU-and-mul, or gpt-oss' clamped swiglu (SwigluOAIAndMul)."""
    gate, up = gate.float(), up.float()
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate, up = gate.clamp(max=SWIGLUOAI_LIMIT), up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate)


def _vllm_activation(c1: torch.Tensor, activation: str, Ip: int) -> torch.Tensor:
    """What vLLM's activation op reads from GEMM1's output: halves for silu_and_mul, even/odd columns
    for swigluoai_and_mul (``x[..., ::2]``, ``x[..., 1::2]``)."""
    if activation == "silu":
        return _glu(c1[:, :Ip], c1[:, Ip:], activation)
    return _glu(c1[:, 0::2], c1[:, 1::2], activation)


def run_marlin_moe(tensors, shape, x, topk_w, topk_ids):
    """Both Marlin GEMMs as the runtime (and vLLM's ``_fused_marlin_moe``) calls them; returns (gemm1 out,
    act, gemm2 out)."""
    from moeconvert.runtime import vllm_marlin

    vllm_moe_ops()
    E, Hp, Ip = shape.num_experts, shape.hidden_size, shape.intermediate_size
    M, topk = topk_ids.shape
    assert vllm_marlin.weight_type_id("mxfp4") == FLOAT4_E2M1F
    t = {k: v.to(x.device) for k, v in tensors.items()}
    r = vllm_marlin.prepare(topk_w, topk_ids, E)
    c1 = vllm_marlin.gemm(x, t, True, r, type_id=FLOAT4_E2M1F, size_n=2 * Ip, size_k=Hp)
    act = _vllm_activation(c1, shape.activation, Ip).to(x.dtype)
    c2 = vllm_marlin.gemm(act, t, False, r, type_id=FLOAT4_E2M1F, size_n=Hp, size_k=Ip)
    return c1, act, c2.view(M, topk, Hp)


def gpu_errors(block, shape, tensors, M=32, topk=2, seed=0, dev="cuda"):
    """Relative errors (gemm1, gemm2, whole MoE) of the kernel on ``tensors`` vs dequantize-then-matmul."""
    E, Hp, Ip = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, Hp, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    logits = torch.randn(M, E, device=dev, generator=gen)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, -1), topk, -1)
    topk_w, topk_ids = topk_w.float().contiguous(), topk_ids.to(torch.int32).contiguous()

    w13 = dequantize_mxfp4(block.w13.to(dev), block.w13_scale.to(dev))  # canonical [E, 2Ip, Hp], exact
    w2 = dequantize_mxfp4(block.w2.to(dev), block.w2_scale.to(dev))  # [E, Hp, Ip]
    b13 = block.w13_bias.to(dev).float() if block.w13_bias is not None else torch.zeros(E, 2 * Ip, device=dev)
    b2 = block.w2_bias.to(dev).float() if block.w2_bias is not None else torch.zeros(E, Hp, device=dev)
    rows = spec_kernel_row(torch.arange(2 * Ip, device=dev), Ip, shape.activation)  # kernel column -> canonical row

    c1, act, c2 = run_marlin_moe(tensors, shape, x, topk_w, topk_ids)
    ids = topk_ids.flatten().long()
    xr = x.float().repeat_interleave(topk, 0)  # row m*topk + j is token m's j-th expert
    ref1 = torch.einsum("rk,rnk->rn", xr, w13[ids]) + b13[ids]  # canonical [gate | up] columns
    w = topk_w.flatten()[:, None]
    ref2 = (torch.einsum("rk,rnk->rn", act.float(), w2[ids]) + b2[ids]) * w
    a_ref = _glu(ref1[:, :Ip], ref1[:, Ip:], shape.activation)  # the model: gate rows first, then up
    ref_moe = ((torch.einsum("rk,rnk->rn", a_ref, w2[ids]) + b2[ids]) * w).view(M, topk, Hp)
    return rel(c1, ref1[:, rows]), rel(c2.reshape(M * topk, Hp), ref2), rel(c2.sum(1), ref_moe.sum(1))


@pytest.mark.gpu
@pytest.mark.parametrize("E,Hp,Ip,bias,activation", GPU_CASES)
def test_vllm_marlin_kernel_computes_right_on_our_mxfp4_bytes(E, Hp, Ip, bias, activation):
    vllm_moe_ops()
    shape = layer(E, Hp, Ip, bias=bias, activation=activation)
    block = mxfp4_block(E, Hp, Ip, bias, seed=5, scales=(116, 122))
    errs = gpu_errors(block, shape, LAYOUT.encode(block, shape))
    print(f"\nmarlin mxfp4 kernel E{E} Hp{Hp} Ip{Ip} bias={bias} {activation}: "
          f"rel err gemm1 {errs[0]:.2e} gemm2 {errs[1]:.2e} moe {errs[2]:.2e}")
    assert max(errs) < 1e-2
