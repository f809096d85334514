"""The ``marlin`` layout for NVFP4 experts (docs/layouts/marlin-nvfp4.md), against each vLLM version's own
load-time Python (``prepare_nvfp4_moe_layer_for_marlin`` and the functions it calls), lifted out of its
files and run on CPU. The CUDA ``gptq_marlin_repack`` is stood in by vLLM's own Python reference
(``marlin_weights``), which its ``test_gptq_marlin_repack`` holds the CUDA op to, as in
tests/test_layout_marlin_mxfp4.py. decode(encode(x)) and the rest every layout owes: test_layout_contract.py.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import types

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout
from moeconvert.layouts.base import CHOICES
from moeconvert.layouts.marlin_nvfp4 import ScaleScan, max_scale_bytes, scale_factor
from moeconvert.schemes import NVFP4Scheme

from helpers import lift, same_bits, top_level, vllm_reader

LAYOUT = get_layout("marlin", "nvfp4")
SCHEME = NVFP4Scheme()


def layer(E: int, H: int, I: int, dtype: str = "bfloat16") -> LayerShape:
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, dtype=dtype)


def make_block(E: int, H: int, I: int, seed: int, top: int = 0x7E) -> ExpertBlock:
    """Any e2m1 pair; e4m3 scales of every non-negative finite byte up to ``top`` (subnormals included, which
    Marlin's S0E5M3 coding drops); gate and up global multipliers that differ (vLLM keeps the gate's)."""
    gen = torch.Generator().manual_seed(seed)
    u8 = lambda high, *s: torch.randint(0, high, s, generator=gen, dtype=torch.uint8)
    e4m3 = lambda *s: u8(top + 1, *s).view(torch.float8_e4m3fn)
    return ExpertBlock(scheme=SCHEME, w13=u8(256, E, 2 * I, H // 2), w2=u8(256, E, H, I // 2),
                       w13_scale=e4m3(E, 2 * I, H // 16), w2_scale=e4m3(E, H, I // 16),
                       w13_global=torch.rand(E, 2, generator=gen) * 1e-3 + 1e-5,
                       w2_global=torch.rand(E, generator=gen) * 1e-3 + 1e-5)


def scanned(block: ExpertBlock, shape: LayerShape) -> LayerShape:
    """The shape with the layer's scale factors, as the job sets them after its scan."""
    scan = LAYOUT.layer_scan(shape, SCHEME, 0)
    scan.add(block, 0)
    return dataclasses.replace(shape, extra={CHOICES: scan.choices()})


# ---------------------------------------------------------------------------------------------------
# vLLM's own Python

_VLLM_DEFS = {
    "model_executor/layers/quantization/utils/marlin_utils_fp4.py":
        ["_nvfp4_compute_scale_factor", "nvfp4_marlin_process_scales", "nvfp4_marlin_process_global_scale",
         "_repack_marlin_experts", "prepare_nvfp4_moe_layer_for_marlin"],
    "model_executor/layers/quantization/utils/marlin_utils.py": ["get_scale_perms", "marlin_permute_scales"],
    "model_executor/layers/quantization/utils/quant_utils.py": ["get_pack_factor", "unpack_cols"],
    "model_executor/layers/quantization/utils/marlin_utils_test.py":
        ["marlin_permute_weights", "marlin_weights", "get_weight_perm"],
    "utils/math_utils.py": ["round_up"],
}


@functools.lru_cache(maxsize=None)
def vllm_reference(version: str):
    import numpy

    read = vllm_reader(version)
    quiet = types.SimpleNamespace(warning_once=lambda *a, **k: None, warning=lambda *a, **k: None)
    ns: dict = {"torch": torch, "numpy": numpy, "np": numpy, "logger": quiet, "GPTQ_MARLIN_TILE": 16,
                "get_marlin_input_dtype": lambda *a, **k: None,
                "current_platform": types.SimpleNamespace(is_xpu=lambda: False, is_rocm=lambda: False)}
    for path, names in _VLLM_DEFS.items():
        lift(read, path, names, ns)

    def gptq_marlin_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        assert not is_a_8bit
        q = ns["unpack_cols"](b_q_weight.T.contiguous(), num_bits, size_n, size_k).T.contiguous()
        return ns["marlin_weights"](q, size_k, size_n, num_bits, ns["get_weight_perm"](num_bits))

    ns["ops"] = types.SimpleNamespace(gptq_marlin_repack=gptq_marlin_repack)
    return types.SimpleNamespace(read=read, **ns)


def vllm_marlin(ref, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
    """What vLLM holds: ``CompressedTensorsW4A4Nvfp4MoEMethod`` hands the MARLIN branch the gate's global
    scale reciprocal (here the canonical multiplier, which is that reciprocal) and the loaded tensors."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[shape.dtype]
    stub = types.SimpleNamespace(num_experts=block.num_experts, hidden_size=shape.hidden_size,
                                 intermediate_size_per_partition=shape.intermediate_size, params_dtype=dtype)
    out = ref.prepare_nvfp4_moe_layer_for_marlin(
        stub, w13=block.w13, w13_scale=block.w13_scale, w13_scale_2=block.w13_global[:, 0].contiguous(),
        w2=block.w2, w2_scale=block.w2_scale, w2_scale_2=block.w2_global, is_act_and_mul=True)
    names = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
             "w2_weight_scale_2")
    return dict(zip(names, out))


def assert_equal_to_vllm(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name in ours:
        assert same_bits(ours[name], theirs[name]), name


@pytest.mark.parametrize("E,H,I,dtype,top", [
    (2, 256, 128, "bfloat16", 0x7E),  # largest scale 448: sf 1
    (3, 192, 96, "bfloat16", 0x60),  # H % 128 != 0 (I padded to 128); scales <= 64: sf 4
    (2, 128, 80, "bfloat16", 0x3A),  # I padded to 128 (64-multiple); scales <= 0.8: sf 256
    (2, 256, 64, "float16", 0x50),  # fp16: never rescaled, global * 2^7
])
def test_bytes_equal_vllm_marlin_nvfp4(E, H, I, dtype, top, vllm_version):
    ref = vllm_reference(vllm_version)
    shape = layer(E, H, I, dtype)
    block = make_block(E, H, I, seed=E * H + I, top=top)
    shape = scanned(block, shape)
    assert_equal_to_vllm(LAYOUT.encode(block, shape), vllm_marlin(ref, block, shape))
    assert LAYOUT.decode(LAYOUT.encode(block, shape), shape, SCHEME).differences(
        LAYOUT.expected_block(block, shape)) == []


def test_scale_factor_equals_vllm_for_every_largest_scale(vllm_version):
    """Every positive finite e4m3 byte as a sublayer's largest scale, in both model dtypes."""
    ref = vllm_reference(vllm_version)
    for byte in range(1, 0x7F):
        s = torch.tensor([[byte]], dtype=torch.uint8).view(torch.float8_e4m3fn)
        for name, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            assert scale_factor(byte, name) == ref._nvfp4_compute_scale_factor(s.to(dt), dt), (byte, name)


def test_the_scan_takes_the_largest_scale_of_every_expert():
    """The scale factor is a fact of the whole layer: one expert with a large scale settles it to 1."""
    shape = layer(4, 256, 128)
    small, big = make_block(3, 256, 128, seed=1, top=0x50), make_block(1, 256, 128, seed=2)
    scan = ScaleScan(4, "bfloat16")
    scan.add(small, 0)
    assert not scan.settled()
    scan.add(big, 3)
    assert scan.settled() and scan.choices() == {"w13": 1, "w2": 1}
    assert scan.facts()["w2"]["max_scale_byte"] == max_scale_bytes(small.w2_scale) + max_scale_bytes(big.w2_scale)
    # without the scan, a chunk that cannot settle it alone is not encoded
    with pytest.raises(Exception, match="scan"):
        LAYOUT.encode(small, layer(3, 256, 128))
    assert LAYOUT.experts_problem(LAYOUT.layer_metadata(shape, SCHEME, scan.facts()), [0, 1, 2])
    assert LAYOUT.experts_problem(LAYOUT.layer_metadata(shape, SCHEME, scan.facts()), [2, 3]) is None


def test_nan_scale_is_refused_naming_the_expert():
    block = make_block(2, 256, 128, seed=3)
    block.w2_scale.view(torch.uint8)[1, 5, 2] = 0x7F
    with pytest.raises(MoeConvertError, match="w2 scales of local expert 1: NaN NVFP4 scale"):
        LAYOUT.encode(block, scanned(block, layer(2, 256, 128)))


def test_check_states_vllms_limits():
    assert LAYOUT.check(layer(2, 256, 128), SCHEME) == []
    problems = LAYOUT.check(dataclasses.replace(layer(2, 96, 40, "float32"), has_bias=True,
                                                activation="swigluoai"), SCHEME)
    for needle in ("multiple of 64", "multiple of 16", "float32", "swigluoai", "biases"):
        assert sum(needle in p for p in problems) == 1, needle
    assert len(problems) == 5


def test_vllm_ct_nvfp4_method_gives_marlin_the_gate_global_scale_reciprocal(vllm_version):
    """What the canonical block's multipliers stand for: vLLM passes ``1 / weight_global_scale`` of the
    gate shard (``[:, 0]``) to the kernel-format conversion, whose MARLIN branch is
    ``prepare_nvfp4_moe_layer_for_marlin`` with the arguments as given."""
    ref = vllm_reference(vllm_version)
    rel = ("model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
           "compressed_tensors_moe_w4a4_nvfp4.py")
    cls = top_level(ref.read(rel))["CompressedTensorsW4A4Nvfp4MoEMethod"]
    body = ast.unparse(next(n for n in cls.body if getattr(n, "name", "") == "process_weights_after_loading"))
    assert "w13_weight_global_scale = layer.w13_weight_global_scale[:, 0].contiguous()" in body
    assert "w13_scale_2=1.0 / w13_weight_global_scale" in body
    assert "w2_scale_2=1.0 / layer.w2_weight_global_scale" in body
    oracle = ast.unparse(top_level(ref.read("model_executor/layers/fused_moe/oracle/nvfp4.py"))[
        "convert_to_nvfp4_moe_kernel_format"])
    assert ("prepare_nvfp4_moe_layer_for_marlin(layer=layer, w13=w13, w13_scale=w13_scale, w13_scale_2=w13_scale_2, "
            "w2=w2, w2_scale=w2_scale, w2_scale_2=w2_scale_2, is_act_and_mul=is_act_and_mul)") in oracle


# ---------------------------------------------------------------------------------------------------
# GPU: vLLM's compiled Marlin MoE kernel on our bytes, as vLLM's fused_marlin_moe calls it for NVFP4
# (its quant config's g1/g2 alphas, i.e. w13/w2_weight_scale_2, passed as the kernel's global_scale)

FLOAT4_E2M1F = 0x2000000010102  # vllm/scalar_type.py: scalar_types.float4_e2m1f.id (test_layout_marlin_mxfp4)


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,top", [(4, 256, 128, 0x7E), (4, 512, 160, 0x58)])  # the second: I padded, sf > 1
def test_vllm_marlin_kernel_computes_right_on_our_nvfp4_bytes(E, H, I, top):
    from moeconvert.mxfp4 import dequantize_nvfp4
    from moeconvert.runtime import vllm_marlin

    from helpers import rel, vllm_moe_ops

    ops = vllm_moe_ops()
    dev = "cuda"
    block = make_block(E, H, I, seed=7, top=top)
    block.w13_global[:, 1] = block.w13_global[:, 0]  # one global scale for gate and up, as checkpoints have
    shape = scanned(block, layer(E, H, I))
    t = {k: v.to(dev) for k, v in LAYOUT.encode(block, shape).items()}
    Np = t["w13_weight"].shape[2] // 4
    want = LAYOUT.expected_block(block, shape)  # the values vLLM's bytes hold
    w13 = dequantize_nvfp4(want.w13, want.w13_scale, want.w13_global[:, :1, None]).to(dev)
    w2 = dequantize_nvfp4(want.w2, want.w2_scale, want.w2_global.view(-1, 1, 1)).to(dev)

    M, top_k = 16, 2
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, H, device=dev, generator=gen).to(torch.bfloat16)
    topk_w, topk_ids = torch.topk(torch.softmax(torch.randn(M, E, device=dev, generator=gen), -1), top_k, -1)
    r = vllm_marlin.prepare(topk_w, topk_ids, E)

    def gemm(a, sub, size_n, size_k, first):
        return ops.moe_wna16_marlin_gemm(
            a, None, t[f"{sub}_weight"], None, t[f"{sub}_weight_scale"], None, t[f"{sub}_weight_scale_2"], None,
            vllm_marlin._workspace(a.device), r.sorted_ids, r.expert_ids, r.num_tokens_past_padded, r.topk_weights,
            r.block_size, top_k if first else 1, not first, FLOAT4_E2M1F, a.shape[0], size_n, size_k,
            False, True, False, -1, -1, -1).view(-1, size_n)

    c1 = gemm(x, "w13", 2 * Np, H, True)
    ids = topk_ids.flatten().long()
    ref1 = torch.einsum("rk,rnk->rn", x.float().repeat_interleave(top_k, 0), w13[ids])
    keep = torch.cat([torch.arange(I), Np + torch.arange(I)]).to(dev)  # our real rows; padded rows are zero
    a = (torch.nn.functional.silu(c1[:, :Np].float()) * c1[:, Np:].float()).to(torch.bfloat16)
    c2 = gemm(a.contiguous(), "w2", H, Np, False)
    ref2 = torch.einsum("rk,rnk->rn", a[:, :I].float(), w2[ids]) * topk_w.flatten()[:, None]
    errs = rel(c1[:, keep], ref1), rel(c2, ref2)
    print(f"\nmarlin nvfp4 kernel E{E} H{H} I{I}: rel err gemm1 {errs[0]:.2e} gemm2 {errs[1]:.2e}")
    assert max(errs) < 1e-2
