"""The ``flashinfer-trtllm`` and ``flashinfer-cutlass`` layouts for NVFP4 experts (docs/layouts/flashinfer-nvfp4.md):
what vLLM holds on SM100 for a compressed-tensors ``nvfp4-pack-quantized`` W4A4 MoE layer served by FlashInfer.

CPU, once per vLLM version: vLLM's own ``CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading`` with
its FLASHINFER_TRTLLM backend and every function it calls (``convert_to_nvfp4_moe_kernel_format``,
``prepare_nvfp4_moe_layer_for_fi_or_cutlass``, the padding and w1/w3 swap,
``prepare_static_weights_for_trtllm_fp4_moe``, ``make_nvfp4_moe_quant_config``, the experts'
``TrtLlmNvFp4ExpertsBase.process_weights_after_loading``), and the same with FLASHINFER_CUTLASS (vLLM's
``swizzle_blockscale``, ``FlashInferExperts.process_weights_after_loading``), lifted out of that version's
files and run on a CPU layer holding the checkpoint's tensors, over FlashInfer 0.7.2.post1's own row-permutation
Python. FlashInfer's one compiled step, ``nvfp4_block_scale_interleave``, is stood in by
FlashInfer's own pure-torch 128x4 swizzle (``_swizzle_sf_128x4``), which the ``gpu`` test holds to the real op.
decode(encode(x)) and the rest every layout owes: test_layout_contract.py.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
from typing import Union

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout
from moeconvert.layouts.base import CHOICES
from moeconvert.layouts import flashinfer_trtllm_nvfp4 as fn
from moeconvert.schemes import NVFP4Scheme

from helpers import FLASHINFER_SRC, exec_nodes, lift, package_reader, same_bits, top_level, undecorated, vllm_reader

LAYOUT = get_layout("flashinfer-trtllm", "nvfp4")
CUTLASS = get_layout("flashinfer-cutlass", "nvfp4")
SCHEME = NVFP4Scheme()
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def layer(E: int, H: int, I: int, dtype: str = "bfloat16") -> LayerShape:
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, dtype=dtype)


def checkpoint(E: int, H: int, I: int, seed: int) -> dict[str, torch.Tensor]:
    """The tensors vLLM's compressed-tensors NVFP4 MoE method holds after loading a W4A4 checkpoint, stacked over
    experts: any e2m1 pair, any finite e4m3 scale byte, weight global scales far from 1 whose gate and up
    differ (vLLM keeps the gate's), and input global scales that differ per expert and projection."""
    gen = torch.Generator().manual_seed(seed)
    u8 = lambda high, *s: torch.randint(0, high, s, generator=gen, dtype=torch.uint8)  # noqa: E731

    def e4m3(*s):
        b = u8(256, *s)
        b[(b & 0x7F) == 0x7F] = 0x7E
        return b.view(torch.float8_e4m3fn)

    pos = lambda lo, span, *s: torch.rand(*s, generator=gen) * span + lo  # noqa: E731
    return {"w13_weight_packed": u8(256, E, 2 * I, H // 2), "w2_weight_packed": u8(256, E, H, I // 2),
            "w13_weight_scale": e4m3(E, 2 * I, H // 16), "w2_weight_scale": e4m3(E, H, I // 16),
            "w13_weight_global_scale": pos(100, 3000, E, 2), "w2_weight_global_scale": pos(100, 3000, E),
            "w13_input_global_scale": pos(0.3, 7, E, 2), "w2_input_global_scale": pos(0.3, 7, E)}


def canonical(t: dict[str, torch.Tensor]) -> ExpertBlock:
    """The block moeconvert's reader makes of them: the multipliers are ``1 / global_scale`` in fp32."""
    return ExpertBlock(scheme=SCHEME, w13=t["w13_weight_packed"], w2=t["w2_weight_packed"],
                       w13_scale=t["w13_weight_scale"], w2_scale=t["w2_weight_scale"],
                       w13_global=1.0 / t["w13_weight_global_scale"], w2_global=1.0 / t["w2_weight_global_scale"],
                       w13_input_global=1.0 / t["w13_input_global_scale"],
                       w2_input_global=1.0 / t["w2_input_global_scale"])


def scanned(block: ExpertBlock, shape: LayerShape) -> LayerShape:
    """The shape with the layer's choices, as the job sets them after its scan."""
    scan = LAYOUT.layer_scan(shape, SCHEME, 0)
    scan.add(block, 0)
    return dataclasses.replace(shape, extra={CHOICES: scan.choices()})


# ---------------------------------------------------------------------------------------------------
# FlashInfer's and vLLM's own Python


@functools.lru_cache(maxsize=1)
def flashinfer_python():
    read = package_reader(FLASHINFER_SRC, "flashinfer")
    if read is None:
        pytest.skip("FlashInfer sources not found (set MOECONVERT_FLASHINFER_SRC to a flashinfer-python wheel or "
                    "its unpacked folder)")
    ns: dict = {"torch": torch, "Union": Union, "Optional": __import__("typing").Optional}
    fi = dict(package="flashinfer", edit=undecorated)
    lift(read, "utils.py", ["srcToDstBlk16RowMap", "srcToDstBlk32RowMap", "get_shuffle_block_size",
                            "get_shuffle_matrix_a_row_indices", "get_shuffle_matrix_sf_a_row_indices"], ns,
         optional=["_unaligned_rows_message"], **fi)
    lift(read, "fused_moe/core.py", ["get_reorder_rows_for_gated_act_gemm_row_indices",
                                     "_maybe_get_cached_w3_w1_permute_indices", "get_w2_permute_indices_with_cache"],
         ns, **fi)
    lift(read, "diffusion_ops/minimax_h3_fc1_swiglu.py", ["_SF_TILE_ROWS", "_swizzle_sf_128x4"], ns, **fi)
    return types.SimpleNamespace(**ns)


_LIFTED = {
    "model_executor/utils.py": (["replace_parameter", "set_weight_attrs"],
                                ["_extent", "storage_view", "_in_own_storage", "refill_derived", "move_parameter",
                                 "retire_parameter", "set_kernel_parameter", "_is_live", "get_live_param",
                                 "kernel_parameters"]),
    "utils/math_utils.py": (["round_up"], []),
    "model_executor/layers/quantization/utils/quant_utils.py": (["amax_for_moe_activation_quant"], []),
    "model_executor/layers/quantization/utils/flashinfer_utils.py":
        (["align_fp4_moe_weights_for_fi", "align_fp4_moe_hidden_dim_for_fi"], ["trtllm_nvfp4_hidden_alignment"]),
    "model_executor/layers/quantization/utils/flashinfer_fp4_moe.py":
        (["reorder_w1w3_to_w3w1", "prepare_static_weights_for_trtllm_fp4_moe",
          "prepare_nvfp4_moe_layer_for_fi_or_cutlass"], []),
    "model_executor/layers/fused_moe/oracle/nvfp4.py":
        (["NvFp4MoeBackend", "FLASHINFER_NVFP4_MOE_BACKENDS", "is_global_sf_supported_for_nvfp4_backend", "_use_a16",
          "convert_to_nvfp4_moe_kernel_format", "make_nvfp4_moe_quant_config"], []),
    "model_executor/layers/quantization/utils/nvfp4_utils.py": (["swizzle_blockscale"], []),
    "model_executor/layers/fused_moe/experts/trtllm_nvfp4_moe.py": (["TrtLlmNvFp4ExpertsBase"], []),
}
CUTLASS_EXPERTS = "model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py"
CT_METHOD = ("model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
             "compressed_tensors_moe_w4a4_nvfp4.py")


@functools.lru_cache(maxsize=None)
def vllm_trtllm_nvfp4(version: str) -> types.SimpleNamespace:
    """vLLM ``version``'s NVFP4 MoE processing with its FLASHINFER_TRTLLM backend, as functions.

    What is stood in: its logger, environment (unset), the quant-config constructor (a record of its
    arguments), and the kernel object the method builds, whose experts are ``TrtLlmNvFp4ExpertsBase``
    with the config ``make_nvfp4_moe_quant_config`` made (its constructor reads the GPU; the attributes
    ``process_weights_after_loading`` reads are set as it sets them for SiLU without a clamp)."""
    read = vllm_reader(version)
    quiet = types.SimpleNamespace(warning_once=lambda *a, **k: None, info_once=lambda *a, **k: None,
                                  debug_once=lambda *a, **k: None, warning=lambda *a, **k: None)
    ns: dict = {"torch": torch, "Enum": enum.Enum, "logger": quiet, "Any": object,
                "envs": types.SimpleNamespace(VLLM_B12X_MOE_FP4_FORCE_A16=False,
                                              VLLM_FLASHINFER_CUTEDSL_MOE_LOCALIZE_FREE_FULL_WEIGHTS=False),
                "is_weights_pre_processed": lambda: False,
                # an NVFP4 W4A4 config (``use_nvfp4_w4a4``), recording what it is given
                "nvfp4_moe_quant_config": lambda **kw: types.SimpleNamespace(use_nvfp4_w4a4=True, **kw)}
    for rel, (names, optional) in _LIFTED.items():
        lift(read, rel, names, ns, optional=optional)
    cls = top_level(read(CT_METHOD))["CompressedTensorsW4A4Nvfp4MoEMethod"]
    methods = [n for n in cls.body if getattr(n, "name", "") in ("process_weights_after_loading",
                                                                  "get_fused_moe_quant_config")]
    exec_nodes(methods, f"vllm/{CT_METHOD}", ns)
    # FlashInferExperts' own process_weights_after_loading, as a function of (experts, layer)
    cutlass = top_level(read(CUTLASS_EXPERTS))["FlashInferExperts"]
    pwal = next(n for n in cutlass.body if getattr(n, "name", "") == "process_weights_after_loading")
    ns["cutlass_experts_pwal"] = exec_nodes([pwal], f"vllm/{CUTLASS_EXPERTS}", {"torch": torch})[pwal.name]
    return types.SimpleNamespace(read=read, **ns)


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs, __path__=[])
    return m


def _fake_imports(ref, monkeypatch) -> None:
    """The imports inside vLLM's functions: FlashInfer's own Python, with its pure-torch 128x4 swizzle for the
    compiled ``nvfp4_block_scale_interleave`` (held to it by the gpu test below); the lifted oracle module;
    0.34.0's direct-reload and locality switches, both off by default."""
    fi = flashinfer_python()
    fakes = {
        "flashinfer": _module("flashinfer", nvfp4_block_scale_interleave=fi._swizzle_sf_128x4),
        "flashinfer.fused_moe.core": _module(
            "flashinfer.fused_moe.core", get_w2_permute_indices_with_cache=fi.get_w2_permute_indices_with_cache,
            _maybe_get_cached_w3_w1_permute_indices=fi._maybe_get_cached_w3_w1_permute_indices),
        "vllm.model_executor.layers.fused_moe.oracle.nvfp4": _module(
            "nvfp4", NvFp4MoeBackend=ref.NvFp4MoeBackend,
            is_global_sf_supported_for_nvfp4_backend=ref.is_global_sf_supported_for_nvfp4_backend),
        "vllm.model_executor.model_loader.reload.direct": _module("direct", direct_reload_enabled=lambda: False),
        "vllm.distributed.localization": _module("localization", get_localized_resources=lambda: None),
    }
    for name, module in fakes.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), sys.modules.get(".".join(parts[:i]))
                                or _module(".".join(parts[:i])))
        monkeypatch.setitem(sys.modules, name, module)


class _Layer(torch.nn.Module):
    def _expert_routing_tables(self):
        return None


def vllm_holds(ref, t: dict[str, torch.Tensor], shape: LayerShape, monkeypatch,
               backend: str = "FLASHINFER_TRTLLM") -> dict[str, torch.Tensor]:
    """The layer's tensors after vLLM's processing of a layer holding the checkpoint tensors ``t`` with
    ``backend``: its parameters and the activation scales it keeps as attributes."""
    _fake_imports(ref, monkeypatch)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # swizzle_blockscale's .cuda()
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    mod = _Layer()
    for name, tensor in t.items():
        mod.register_parameter(name, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    gated = types.SimpleNamespace(is_gated=True)
    mod.activation = gated
    moe_config = types.SimpleNamespace(hidden_dim=H, hidden_dim_unpadded=None, intermediate_size_per_partition=I,
                                       num_local_experts=E, is_act_and_mul=True, activation=gated,
                                       moe_parallel_config=types.SimpleNamespace(enable_eplb=False))
    mod.moe_config = moe_config
    method = types.SimpleNamespace(moe=moe_config, use_a16=False, per_token_activation=False,
                                   nvfp4_backend=ref.NvFp4MoeBackend[backend], experts_cls=object)
    method.get_fused_moe_quant_config = lambda layer: ref.get_fused_moe_quant_config(method, layer)

    def make_kernel(moe_quant_config, **kw):
        if backend == "FLASHINFER_CUTLASS":
            cutlass = types.SimpleNamespace(quant_config=moe_quant_config, keep_constants=lambda layer: None)
            cutlass.process_weights_after_loading = lambda layer: ref.cutlass_experts_pwal(cutlass, layer)
            return types.SimpleNamespace(fused_experts=cutlass)
        experts = object.__new__(ref.TrtLlmNvFp4ExpertsBase)
        experts.__dict__.update(quant_config=moe_quant_config, moe_config=moe_config, is_situ=False,
                                gemm1_alpha=None, _gemm1_clamp_limit_unfolded=None, _gemm1_beta_unfolded=None)
        experts.keep_constants = lambda layer: None  # 0.34.0: aliases of what the layer now holds
        return types.SimpleNamespace(fused_experts=experts)

    exec_ns = ref.process_weights_after_loading.__globals__
    exec_ns["make_nvfp4_moe_kernel"] = make_kernel
    ref.process_weights_after_loading(method, mod)
    live = ref.kernel_parameters(mod) if hasattr(ref, "kernel_parameters") else dict(mod._parameters)
    held = {n: p.data for n, p in live.items()}
    held.update(w13_input_scale=mod.w13_input_scale, w2_input_scale=mod.w2_input_scale)
    # the quant config the kernel reads: the same tensors, and the input quantization scales derived from them
    qc = method.moe_kernel.fused_experts.quant_config
    assert qc.g1_alphas is mod.w13_weight_scale_2 and qc.g2_alphas is mod.w2_weight_scale_2
    assert same_bits(qc.a1_gscale, 1.0 / mod.w13_input_scale)
    if backend == "FLASHINFER_TRTLLM":
        assert qc.is_scale_swizzled is False
        assert same_bits(method.moe_kernel.fused_experts.g1_scale_c, mod.g1_scale_c)
        assert moe_config.hidden_dim == fn.padded_sizes(H, I)[0]
        assert moe_config.intermediate_size_per_partition == fn.padded_sizes(H, I)[1]
    else:
        assert qc.is_scale_swizzled is True and (moe_config.hidden_dim, moe_config.intermediate_size_per_partition) \
            == (H, I)
    return held


CASES = [  # E, H, I, dtype: H = 256, I = 128 pad nothing; H = 144, I = 80 pad H to 256 and I to 128
    (2, 256, 128, "bfloat16"),
    (3, 144, 80, "float16"),
]


@pytest.mark.parametrize("E,H,I,dtype", CASES)
def test_bytes_equal_vllm_flashinfer_trtllm_nvfp4(monkeypatch, vllm_version, E, H, I, dtype):
    ref = vllm_trtllm_nvfp4(vllm_version)
    shape = layer(E, H, I, dtype)
    t = checkpoint(E, H, I, seed=E * H + I)
    block = canonical(t)
    shape = scanned(block, shape)
    theirs = vllm_holds(ref, t, shape, monkeypatch)
    ours = LAYOUT.encode(block, shape)
    # every tensor the kernel reads, bit for bit; the checkpoint's loaded parameters (0.33.0 keeps them
    # registered, 0.34.0 retires the global scales) are not the kernel's
    kernel_reads = set(ours) - set(fn.WEIGHT_GLOBALS.values())
    assert kernel_reads <= set(theirs), kernel_reads - set(theirs)
    for name in kernel_reads:
        assert same_bits(ours[name], theirs[name]), name
    assert not LAYOUT.decode(ours, shape, SCHEME).differences(LAYOUT.expected_block(block, shape))


CUTLASS_CASES = [  # E, H, I, dtype: H = 144 pads w13's scale columns (9 -> 12) and w2's scale rows (144 -> 256)
    (2, 256, 128, "bfloat16"),
    (3, 144, 64, "float16"),
]


@pytest.mark.parametrize("E,H,I,dtype", CUTLASS_CASES)
def test_bytes_equal_vllm_flashinfer_cutlass_nvfp4(monkeypatch, vllm_version, E, H, I, dtype):
    ref = vllm_trtllm_nvfp4(vllm_version)
    t = checkpoint(E, H, I, seed=E * H + I + 1)
    block = canonical(t)
    shape = scanned(block, layer(E, H, I, dtype))
    theirs = vllm_holds(ref, t, shape, monkeypatch, backend="FLASHINFER_CUTLASS")
    ours = CUTLASS.encode(block, shape)
    kernel_reads = set(ours) - set(fn.WEIGHT_GLOBALS.values())
    assert kernel_reads <= set(theirs) and "g1_scale_c" not in theirs
    for name in kernel_reads:
        assert same_bits(ours[name], theirs[name]), name
    assert not CUTLASS.decode(ours, shape, SCHEME).differences(CUTLASS.expected_block(block, shape))


def test_cutlass_refuses_an_intermediate_size_vllm_would_have_to_pad():
    """vLLM raises NotImplementedError for a gated layer whose 2I is not a multiple of 128."""
    assert any("2I must be a multiple of 128" in p for p in CUTLASS.check(layer(2, 256, 80), SCHEME))
    assert CUTLASS.check(layer(2, 144, 64), SCHEME) == []


def test_vllm_picks_flashinfer_trtllm_first_for_nvfp4(vllm_version):
    """The order of vLLM's NVFP4 MoE oracle: FlashInfer TRT-LLM is tried first (it runs on SM100 only)."""
    import ast
    import re

    read = vllm_reader(vllm_version)
    select = ast.unparse(top_level(read("model_executor/layers/fused_moe/oracle/nvfp4.py"))["select_nvfp4_moe_backend"])
    listed = re.findall(r"NvFp4MoeBackend\.(\w+)", re.search(r"AVAILABLE_BACKENDS = \[(.*?)\]", select, re.S)[1])
    assert listed[0] == "FLASHINFER_TRTLLM"
    experts = read("model_executor/layers/fused_moe/experts/trtllm_nvfp4_moe.py")
    assert "p.is_device_capability_family(100)" in experts


def test_w13_rows_and_scale_swizzle_follow_flashinfer():
    """A one-hot probe: gate row j lands on FlashInfer's GEMM1 row for interleaved row 2j + 1, its scale at
    the 128x4 swizzle's offset of that row."""
    fi = flashinfer_python()
    E, H, I = 1, 256, 128
    t = checkpoint(E, H, I, seed=5)
    block = canonical(t)
    block.w13_scale = torch.zeros_like(block.w13_scale.view(torch.uint8))
    block.w13_scale[0, 5, 3] = 0x38  # gate row 5, scale group 3
    block.w13_scale = block.w13_scale.view(torch.float8_e4m3fn)
    out = LAYOUT.encode(block, scanned(block, layer(E, H, I)))["w13_weight_scale"].view(torch.uint8).flatten()
    perm = fi._maybe_get_cached_w3_w1_permute_indices({}, torch.zeros(2 * I, H // 16, dtype=torch.uint8), 128,
                                                       num_elts_per_sf=16)
    d = int((perm == I + 5).nonzero())  # [up; gate] row I + 5 is gate 5
    linear = torch.zeros(2 * I, H // 16, dtype=torch.uint8)
    linear[d, 3] = 0x38
    assert torch.equal(out, fi._swizzle_sf_128x4(linear))


def test_w4a16_checkpoints_are_refused_naming_marlin():
    t = checkpoint(2, 256, 128, seed=1)
    block = dataclasses.replace(canonical(t), w13_input_global=None, w2_input_global=None)
    with pytest.raises(MoeConvertError, match=r"without input_global_scale.*--backend marlin"):
        LAYOUT.layer_scan(layer(2, 256, 128), SCHEME, 0).add(block, 0)


def test_an_ep_rank_whose_largest_input_scale_differs_is_refused():
    meta = LAYOUT.layer_metadata(layer(2, 256, 128), SCHEME,
                                 {"w13": {fn.MAX_INPUT: [1.5, 3.0]}, "w2": {fn.MAX_INPUT: [2.0, 2.0]}})
    assert meta["w13"]["input_scale"] == 3.0
    assert LAYOUT.experts_problem(meta, [1]) is None
    assert "convert for this rank" in LAYOUT.experts_problem(meta, [0])


def test_check_states_what_vllm_holds():
    assert LAYOUT.check(layer(2, 144, 80), SCHEME) == []
    problems = LAYOUT.check(dataclasses.replace(layer(2, 136, 40, "float32"), has_bias=True, activation="swigluoai"),
                            SCHEME)
    for needle in ("hidden_size H = 136", "intermediate_size I = 40", "float32", "swigluoai", "biases"):
        assert sum(needle in p for p in problems) == 1, needle
    assert len(problems) == 5


# ---------------------------------------------------------------------------------------------------
# GPU: FlashInfer's compiled scale interleave, which the CPU oracle stands in by its pure-torch twin


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(256, 16), (128, 8), (512, 176)])
def test_flashinfers_nvfp4_block_scale_interleave_equals_its_torch_swizzle(rows, cols):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    flashinfer = pytest.importorskip("flashinfer")
    s = torch.randint(0, 256, (rows, cols), generator=torch.Generator().manual_seed(rows + cols)).to(torch.uint8)
    real = flashinfer.nvfp4_block_scale_interleave(s.cuda()).cpu().view(torch.uint8).flatten()
    assert torch.equal(real, flashinfer_python()._swizzle_sf_128x4(s))


def test_repack_then_verify_a_w4a4_checkpoint(example_ckpt, tmp_path):
    """End to end on a compressed-tensors NVFP4 W4A4 checkpoint whose H and I vLLM pads (the example's, shared
    with test_layout_humming_nvfp4.py): repack writes the padded layout, verify decodes it back to the source."""
    import json

    from helpers import cli

    src = example_ckpt("qwen3-moe", scheme="nvfp4", intermediate_size=80)
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "flashinfer-trtllm", expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    entry = manifest["moe_layers"][0]
    H, Ip = entry["layout_metadata"]["padded_hidden_size"], entry["layout_metadata"]["padded_intermediate_size"]
    assert (H % 256, Ip) == (0, 128)
    assert entry["tensors"]["w13_weight"]["shape"][1:] == [2 * Ip, H // 2]
    assert "identical" in cli("verify", out, "--against", src, expect=0).out


def test_repack_flashinfer_cutlass_refuses_an_intermediate_size_vllm_cannot_hold(example_ckpt, tmp_path):
    from helpers import assert_refused

    src = example_ckpt("qwen3-moe", scheme="nvfp4", intermediate_size=80)
    assert_refused(src, tmp_path / "out", "2I must be a multiple of 128", backend="flashinfer-cutlass")


def test_repack_refuses_a_w4a16_checkpoint_in_one_line_writing_nothing(example_ckpt, tmp_path):
    """The example without its input global scales and input activations: a W4A16 NVFP4 checkpoint."""
    from safetensors import safe_open

    from helpers import assert_refused, damaged_copy, resave

    def a16(qc):
        for group in qc["config_groups"].values():
            group["input_activations"] = None

    src = damaged_copy(example_ckpt("qwen3-moe", scheme="nvfp4", intermediate_size=80), tmp_path,
                       quantization_config=a16)
    with safe_open(src / "model.safetensors", "pt") as f:
        resave(src, drop=[k for k in f.keys() if k.endswith(".input_global_scale")])
    assert_refused(src, tmp_path / "out", "input_global_scale", "W4A16", "--backend marlin",
                   backend="flashinfer-trtllm")
