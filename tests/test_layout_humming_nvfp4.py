"""The ``humming`` layout for NVFP4 experts (docs/layouts/humming.md, "NVFP4"): what vLLM holds on SM90 for a
compressed-tensors ``nvfp4-pack-quantized`` MoE layer served by humming.

CPU, once per vLLM version: vLLM's own ``CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading``
with its HUMMING backend, and every function it calls down to humming (``convert_to_nvfp4_moe_kernel_format``,
``convert_to_humming_moe_kernel_format`` and its sublayer steps, the input-schema fallback, the parameter
replacement helpers), lifted out of that version's files and run on a CPU layer holding the checkpoint's
tensors, over humming-kernels 0.1.19's own Python (``humming_cpu``: its one CUDA op, the weight repack,
replaced by test_layout_humming.py's scalar transcription of the kernel). decode(encode(x)) and the rest
every layout owes: test_layout_contract.py. GPU (``-m gpu``): humming's CUDA transform and kernel.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import re
import sys
import types

import pytest
import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout
from moeconvert.layouts import humming as hl
from moeconvert.layouts import humming_nvfp4 as hn
from moeconvert.schemes import NVFP4Scheme

from helpers import exec_nodes, lift, same_bits, top_level, vllm_reader
from test_layout_humming import humming_cpu  # noqa: F401 (a fixture)
from test_layout_humming_mxfp4 import _fake_repack

LAYOUT = get_layout("humming", "nvfp4")
SCHEME = NVFP4Scheme()
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def layer(E: int, H: int, I: int, dtype: str = "bfloat16") -> LayerShape:
    return LayerShape(num_experts=E, hidden_size=H, intermediate_size=I, dtype=dtype)


def checkpoint(E: int, H: int, I: int, seed: int) -> dict[str, torch.Tensor]:
    """The tensors vLLM's compressed-tensors NVFP4 MoE method holds after loading, stacked over experts: any
    e2m1 pair, any finite e4m3 scale byte (negatives and subnormals too), one weight global scale per expert
    shared by gate and up (llm-compressor fuses them), far from 1, and input global scales."""
    gen = torch.Generator().manual_seed(seed)
    u8 = lambda high, *s: torch.randint(0, high, s, generator=gen, dtype=torch.uint8)  # noqa: E731

    def e4m3(*s):
        b = u8(256, *s)
        b[(b & 0x7F) == 0x7F] = 0x7E
        return b.view(torch.float8_e4m3fn)

    gs = torch.rand(E, 1, generator=gen) * 3000 + 100  # a divisor: the value is e2m1 * scale / gs
    return {"w13_weight_packed": u8(256, E, 2 * I, H // 2), "w2_weight_packed": u8(256, E, H, I // 2),
            "w13_weight_scale": e4m3(E, 2 * I, H // 16), "w2_weight_scale": e4m3(E, H, I // 16),
            "w13_weight_global_scale": gs.expand(-1, 2).contiguous(),
            "w2_weight_global_scale": torch.rand(E, generator=gen) * 3000 + 100,
            "w13_input_global_scale": torch.rand(E, 2, generator=gen) + 1,
            "w2_input_global_scale": torch.rand(E, generator=gen) + 1}


def canonical(t: dict[str, torch.Tensor]) -> ExpertBlock:
    """The block moeconvert's reader makes of them: the multipliers are ``1 / weight_global_scale`` in fp32."""
    return ExpertBlock(scheme=SCHEME, w13=t["w13_weight_packed"], w2=t["w2_weight_packed"],
                       w13_scale=t["w13_weight_scale"], w2_scale=t["w2_weight_scale"],
                       w13_global=1.0 / t["w13_weight_global_scale"], w2_global=1.0 / t["w2_weight_global_scale"])


# ---------------------------------------------------------------------------------------------------
# vLLM's own Python, each version's, down to humming

_LIFTED = {
    "model_executor/utils.py": (["replace_parameter", "set_weight_attrs"],
                                ["_extent", "storage_view", "_in_own_storage", "refill_derived", "move_parameter",
                                 "retire_parameter", "set_kernel_parameter", "_is_live", "get_live_param",
                                 "kernel_parameters"]),
    "model_executor/layers/quantization/utils/humming/schema.py":
        (["check_and_fallback_input_schema", "resolve_humming_layer_config", "humming_is_layer_skipped"], []),
    "model_executor/layers/quantization/utils/humming/linear.py":
        ([], ["_KEEP_UNUSED_FRACTION", "_nbytes", "replace_layer_parameters"]),
    "model_executor/layers/quantization/utils/humming/moe.py":
        (["_extract_sublayer_tensors", "_replace_layer_parameters", "_convert_sublayer_to_humming",
          "_prepare_and_transform_sublayer", "_process_single_sublayer", "convert_to_humming_moe_kernel_format"],
         []),
    "model_executor/layers/fused_moe/oracle/nvfp4.py":
        (["NvFp4MoeBackend", "FLASHINFER_NVFP4_MOE_BACKENDS", "_use_a16", "convert_to_nvfp4_moe_kernel_format"], []),
}
CT_METHOD = ("model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
             "compressed_tensors_moe_w4a4_nvfp4.py")


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def vllm_humming_nvfp4(version: str, mods: dict, monkeypatch) -> types.SimpleNamespace:
    """vLLM ``version``'s NVFP4 MoE processing with its HUMMING backend, as functions over humming's Python.

    What is stood in: vLLM's platform (an SM90 CUDA GPU, as on H100 / H200), its environment variables
    (unset), its logger, and the kernel object the method builds after the conversion (whose experts'
    ``process_weights_after_loading`` is the base class's, which does nothing)."""
    import humming.config
    import humming.schema

    read = vllm_reader(version)
    quiet = types.SimpleNamespace(warning_once=lambda *a, **k: None, info_once=lambda *a, **k: None,
                                  debug_once=lambda *a, **k: None, warning=lambda *a, **k: None)
    sm90 = types.SimpleNamespace(get_device_capability=lambda *a: types.SimpleNamespace(to_int=lambda: 90),
                                 is_cuda=lambda: True, use_sync_weight_loader=lambda: False)
    ns: dict = {"torch": torch, "re": re, "Enum": enum.Enum, "logger": quiet, "current_platform": sm90,
                "envs": types.SimpleNamespace(VLLM_HUMMING_INPUT_QUANT_CONFIG=None, VLLM_B12X_MOE_FP4_FORCE_A16=False),
                "Any": object}
    # 0.33.0's schema.py imports humming's dtypes at module level (``if has_humming()``)
    schema_ns: dict = dict(ns, humming_dtypes=mods["dtypes"])
    for rel, (names, optional) in _LIFTED.items():
        into = schema_ns if rel.endswith("humming/schema.py") else ns
        lift(read, rel, names, into, optional=optional)
    ns["humming_schema"] = types.SimpleNamespace(**schema_ns)
    ns.update({k: schema_ns[k] for k in ("humming_is_layer_skipped",)})
    facade = _module("vllm.utils.humming", BaseWeightSchema=humming.schema.BaseWeightSchema,
                     HummingInputSchema=humming.schema.HummingInputSchema,
                     HummingWeightSchema=humming.schema.HummingWeightSchema,
                     InputQuantizationMode=humming.config.InputQuantizationMode, dtypes=mods["dtypes"],
                     prepare_and_transform_humming_tensors=mods["transform"].prepare_and_transform_humming_tensors)
    # the functions import these inside their bodies: vLLM's humming facade, the humming utils package, and
    # 0.34.0's direct-reload switch (off unless the user asks for it)
    convert = ns["convert_to_humming_moe_kernel_format"]
    fakes = {"vllm.utils.humming": facade,
             "vllm.model_executor.layers.quantization.utils.humming":
                 _module("humming_utils", convert_to_humming_moe_kernel_format=convert),
             "vllm.model_executor.model_loader.reload.direct": _module("direct", direct_reload_enabled=lambda: False)}
    for name, module in fakes.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), sys.modules.get(".".join(parts[:i]))
                                or _module(".".join(parts[:i]), __path__=[]))
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "device", lambda device=None: __import__("contextlib").nullcontext())
    cls = top_level(read(CT_METHOD))["CompressedTensorsW4A4Nvfp4MoEMethod"]
    method = next(n for n in cls.body if getattr(n, "name", "") == "process_weights_after_loading")
    kernel = types.SimpleNamespace(fused_experts=types.SimpleNamespace(
        process_weights_after_loading=lambda layer: None, keep_constants=lambda layer: None))
    ns.update(make_nvfp4_moe_kernel=lambda **kw: kernel, trtllm_nvfp4_hidden_alignment=lambda **kw: 256)
    exec_nodes([method], f"vllm/{CT_METHOD}", ns)
    ns["process_weights_after_loading"] = ns.pop(method.name)
    return types.SimpleNamespace(read=read, **ns)


class _Layer(torch.nn.Module):
    def _expert_routing_tables(self):
        return None


def vllm_holds(ref, t: dict[str, torch.Tensor], shape: LayerShape) -> tuple[dict[str, torch.Tensor], dict]:
    """The parameters the kernels read after vLLM's processing of a layer holding the checkpoint tensors ``t``
    (live ones only, as 0.34.0's ``kernel_parameters`` reports them), and each sublayer's ``LayerConfig``."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    mod = _Layer()
    for name, tensor in t.items():
        mod.register_parameter(name, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    mod.params_dtype = DTYPES[shape.dtype]
    mod.layer_name = "model.layers.0.mlp.experts"
    mod.moe_config = types.SimpleNamespace(has_bias=False, num_local_experts=E, hidden_dim=H,
                                           intermediate_size_per_partition=I,
                                           activation=types.SimpleNamespace(is_gated=True))
    method = types.SimpleNamespace(moe=types.SimpleNamespace(is_act_and_mul=True), use_a16=False,
                                   per_token_activation=False, nvfp4_backend=ref.NvFp4MoeBackend.HUMMING,
                                   experts_cls=object, get_fused_moe_quant_config=lambda layer: None)
    ref.process_weights_after_loading(method, mod)
    live = ref.kernel_parameters(mod) if "kernel_parameters" in dir(ref) else dict(mod._parameters)
    return {n: p.data for n, p in live.items()}, mod.humming_configs


CASES = [  # E, H, I, dtype: I = 80 and H = 144 leave humming padding N and K; H = 256, I = 128 do not pad K
    (2, 256, 128, "bfloat16"),
    (3, 144, 80, "bfloat16"),
    (2, 144, 80, "float16"),
]


@pytest.mark.parametrize("E,H,I,dtype", CASES)
def test_bytes_equal_vllm_humming_nvfp4(humming_cpu, monkeypatch, vllm_version, E, H, I, dtype):  # noqa: F811
    calls: list = []
    monkeypatch.setattr(humming_cpu["transform"].ops, "repack_weight", _fake_repack(calls), raising=False)
    ref = vllm_humming_nvfp4(vllm_version, humming_cpu, monkeypatch)
    shape = layer(E, H, I, dtype)
    t = checkpoint(E, H, I, seed=E * H + I)
    block = canonical(t)
    theirs, configs = vllm_holds(ref, t, shape)
    ours = LAYOUT.encode(block, shape)
    assert calls == [dict(weight_bits=4, activation_bits=16, packed=True, int2fp=False, zp=False, interleave_mode=3,
                          fused_e8m0=False, packed_k=False, native=False, group_size_zp=0)] * 2
    assert sorted(theirs) == sorted(ours)
    for name in ours:
        assert same_bits(ours[name], theirs[name]), name
    # the manifest's LayerConfig fields are those vLLM's conversion made, and a loader rebuilds the same config
    meta = LAYOUT.layer_metadata(shape, SCHEME)
    for sub, cfg in configs.items():
        for key in hl.CONFIG_FIELDS + ("num_experts",):
            assert meta[sub][key] == hl.config_value(cfg, key), (sub, key)
        assert str(cfg.weight_scale_2_type.value) == "tensor" and cfg.weight_scale_group_size == 16
    rebuilt = LAYOUT.humming_sublayers(meta, SCHEME, hidden_size=H, intermediate_size=I, num_experts=E,
                                       has_bias=False, dtype=DTYPES[dtype])
    for sub, cfg in configs.items():
        assert rebuilt[sub].config == cfg, sub
    assert not LAYOUT.decode(ours, shape, SCHEME).differences(LAYOUT.expected_block(block, shape))


def test_vllm_picks_humming_ahead_of_marlin_on_sm90_only(vllm_version):
    """The backend order of vLLM's NVFP4 oracle, and its reordering by compute capability (priority.py)."""
    read = vllm_reader(vllm_version)
    ns = lift(read, "model_executor/layers/quantization/utils/humming/priority.py",
              ["_HUMMING_PREFERRED_CAPABILITIES", "prefers_humming", "prioritize_humming"],
              {"Enum": enum.Enum, "TypeVar": lambda *a, **k: None, "_KernelT": None})
    select = ast.unparse(top_level(read("model_executor/layers/fused_moe/oracle/nvfp4.py"))["select_nvfp4_moe_backend"])
    listed = re.search(r"AVAILABLE_BACKENDS = \[(.*?)\]", select, re.S)[1]
    order = re.findall(r"NvFp4MoeBackend\.(\w+)", listed)
    assert order == ["FLASHINFER_TRTLLM", "FLASHINFER_CUTEDSL", "FLASHINFER_CUTEDSL_BATCHED", "FLASHINFER_CUTLASS",
                     "VLLM_CUTLASS", "MARLIN", "HUMMING", "EMULATION"]
    assert "AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)" in select
    Backend = enum.Enum("NvFp4MoeBackend", order)
    as_listed = [Backend[n] for n in order]
    assert [b.name for b in ns["prioritize_humming"](as_listed, 90)].index("HUMMING") == order.index("MARLIN")
    for cc in (80, 89, 100, 120):
        assert ns["prioritize_humming"](as_listed, cc) == as_listed, cc


def test_split_gate_and_up_global_scales_are_refused_naming_the_expert():
    """humming makes per-channel secondary scales of such a layer (a shape the layout does not hold)."""
    t = checkpoint(3, 128, 64, seed=1)
    t["w13_weight_global_scale"][2, 1] *= 2
    with pytest.raises(MoeConvertError, match=r"w13 global scales of local expert 2: gate and up NVFP4 global "
                                              r"scales differ.*--backend marlin"):
        LAYOUT.encode(canonical(t), layer(3, 128, 64))


def test_repack_refuses_split_global_scales_in_one_line_writing_nothing(example_ckpt, tmp_path):
    from helpers import assert_refused, damaged_copy

    name = "model.layers.1.mlp.experts.3.up_proj.weight_global_scale"
    src = damaged_copy(example_ckpt("qwen3-moe", scheme="nvfp4", intermediate_size=80), tmp_path,
                       replace=lambda t: {name: t[name] * 2})
    assert_refused(src, tmp_path / "out", "w13 global scales of local expert 3",
                   "gate and up NVFP4 global scales differ", backend="humming")


def test_check_states_what_vllm_holds():
    assert LAYOUT.check(layer(2, 144, 80), SCHEME) == []
    problems = LAYOUT.check(dataclasses.replace(layer(2, 136, 40, "float32"), has_bias=True, activation="swigluoai"),
                            SCHEME)
    for needle in ("hidden_size H = 136", "intermediate_size I = 40", "float32", "swigluoai", "biases"):
        assert sum(needle in p for p in problems) == 1, needle
    assert len(problems) == 5


# ---------------------------------------------------------------------------------------------------
# GPU: humming's CUDA transform, called as vLLM's convert_to_humming_moe_kernel_format calls it


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,dtype", CASES + [(4, 2048, 768, "bfloat16")])
def test_encode_equals_hummings_cuda_transform(E, H, I, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (humming's weight repack is a CUDA kernel)")
    pytest.importorskip("humming")
    from humming.schema import BaseWeightSchema, HummingInputSchema
    from humming.transform import prepare_and_transform_humming_tensors

    shape = layer(E, H, I, dtype)
    t = checkpoint(E, H, I, seed=E + H + I)
    ours = LAYOUT.encode(canonical(t), shape)
    meta = LAYOUT.layer_metadata(shape, SCHEME)
    for sub, d in hn.sublayers(shape).items():
        tensors = {k.removeprefix(f"{sub}_"): v.cuda() for k, v in t.items() if k.startswith(f"{sub}_")}
        ws = BaseWeightSchema.from_config(dict(hn.VLLM_QUANT_CONFIG))
        stacks = [d.N // 2] * 2 if sub == "w13" else [d.N]
        hs, converted = ws.convert_humming(tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[d.K],
                                           param_dtype=DTYPES[dtype], num_experts=E)
        converted.pop("input_global_scale", None)
        cfg, out = prepare_and_transform_humming_tensors(
            tensors=converted, shape_n=d.N, shape_k=d.K, pad_n_to_multiple=256, pad_k_to_multiple=128,
            input_schema=HummingInputSchema(), weight_schema=hs, has_bias=False, num_experts=E,
            torch_dtype=DTYPES[dtype], device=torch.device("cuda"))
        if cfg.sm_version != 90:
            pytest.skip(f"the layout holds humming's SM90 bytes; this GPU is SM{cfg.sm_version}")
        for key in hl.CONFIG_FIELDS:
            assert meta[sub][key] == hl.config_value(cfg, key), (sub, key)
        pairs = {"weight": f"{sub}_weight", "weight_scale": f"{sub}_weight_scale", "weight_scale_2": hn.GLOBAL[sub]}
        assert set(out) == set(pairs), (sub, set(out))
        for theirs, mine in pairs.items():
            assert same_bits(out[theirs].cpu(), ours[mine]), (sub, theirs)
