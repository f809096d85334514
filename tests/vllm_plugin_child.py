"""Run by tests/test_vllm_plugin.py under a Python that has vLLM 0.33.0 (``MOECONVERT_VLLM_PYTHON``).

On a GPU: ``python vllm_plugin_child.py FOLDER --forward SRC`` (or ``JOBS.json``, a list of ``[mode,
folder, source]``, all in one process) builds each MoE layer with the plugin's
method on CUDA, loads the folder through vLLM's ``load_weights`` and runs vLLM's experts object on routed
tokens against ``runtime/reference.py`` on the source's own weights (decoded from SRC, quantized to MXFP4
the way the folder's manifest says for a bf16 source); ``--bench SRC`` prints ``moeconvert bench
vllm-startup``'s result.

``python vllm_plugin_child.py FOLDERS.json --whole-models``: ``--whole-model`` for each ``[folder, load
format]`` of the list, in this one process, printed as a JSON list (``[folder, load format, family]``: as if the
plugin were not proven on that family).

``python vllm_plugin_child.py FOLDERS.json --layers-jobs``: the MoE layers of each folder of the list, as below,
in this one process, printed as a JSON list.

``python vllm_plugin_child.py FOLDER [--tp-size N] [--pretend-vllm VERSION] [--layout-lists V1,V2] [--skip SUFFIX] [--direct] [--whole-model]``: builds every MoE layer the folder's manifest holds
with vLLM's own ``FusedMoEFactory`` on the CPU platform (one-process gloo group), the quantization config
taken from the folder's config.json through vLLM's registry (after the plugin's ``register``), loads the
folder's tensors through vLLM's own ``MoERunner.load_weights`` with the config's checkpoint name mapper,
runs ``process_weights_after_loading`` and prints, as JSON, what vLLM then holds: each parameter's sha256,
whether its storage moved, the kernel it built. Errors are printed as ``{"error": "..."}``.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

GPU_MODES = ("--forward", "--bench", "--generate")
if "--sources" in sys.argv or "--whole-models" in sys.argv or "--layers-jobs" in sys.argv or not any(m in sys.argv for m in GPU_MODES) and not sys.argv[1].endswith(".json"):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:  # tests/vllm_stubs/torchvision says why
        stubs = str(Path(__file__).parent / "vllm_stubs")
        sys.path.insert(0, stubs)
        # vLLM inspects model classes in a subprocess of its own (registry.py's _run_in_subprocess)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [stubs, os.environ.get("PYTHONPATH")]))


def main() -> None:
    folder = Path(sys.argv[1])
    if "--generate" in sys.argv:
        return _generate(folder)
    if folder.suffix == ".json" and not {"--sources", "--whole-models", "--layers-jobs"} & set(sys.argv):  # a list of [mode, folder, source]: many GPU checks in one vLLM process
        print(json.dumps([_gpu(mode, Path(f), Path(s)) for mode, f, s in json.loads(folder.read_text())]))
        return
    for mode in GPU_MODES:
        if mode in sys.argv:
            print(json.dumps(_gpu(mode, folder, Path(sys.argv[sys.argv.index(mode) + 1]))))
            return
    if "--cpu-forward" in sys.argv:  # triton-fast under TRITON_INTERPRET=1: our kernel runs on the CPU
        _plain_torch_linear_layers()
        src = Path(sys.argv[sys.argv.index("--cpu-forward") + 1])
        print(json.dumps(_gpu("--forward", folder, src, device="cpu", tokens=(1, 5))))
        return
    tp_size = int(sys.argv[sys.argv.index("--tp-size") + 1]) if "--tp-size" in sys.argv else 1
    _plain_torch_linear_layers()
    import vllm

    if "--pretend-vllm" in sys.argv:  # the version refusal, without a second vLLM
        vllm.__version__ = sys.argv[sys.argv.index("--pretend-vllm") + 1]
    if "--layout-lists" in sys.argv:  # a layout listing fewer vLLM versions (the folder's own list is within it)
        from moeconvert.layouts import get_layout

        get_layout("marlin", "wna16").made_for["vllm"] = sys.argv[sys.argv.index("--layout-lists") + 1].split(",")
    # Marlin, vLLM's Triton MoE kernel and triton_kernels' need CUDA to run, not to be built: vLLM's kernel
    # factories check the device, so on the CPU the check is answered here. Nothing runs a kernel in this process.
    _kernels_build_on_the_cpu()

    if "--humming" in sys.argv:
        return _humming_cpu(folder)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own plugin loader: it finds our entry point and runs register()
    if "--whole-models" in sys.argv:  # FOLDERS.json, a list of [folder, load format]: each whole model in turn
        _sparse_attention_builds_on_the_cpu()
        print(json.dumps([_whole_model_as_unproven(Path(f), fmt, *unproven)
                          for f, fmt, *unproven in json.loads(folder.read_text())]))
        return
    if "--whole-model" in sys.argv:
        load_format = sys.argv[sys.argv.index("--load-format") + 1] if "--load-format" in sys.argv else "auto"
        print(json.dumps(_whole_model(folder, {"layers": {}}, load_format)))
        return
    if "--layers-jobs" in sys.argv:  # FOLDER is a JSON list of folders: each one's MoE layers in turn
        print(json.dumps([_layers(Path(f), tp_size) for f in json.loads(folder.read_text())]))
        return
    if "--sources" in sys.argv:  # FOLDER is a JSON list of [folder, source, linear prefixes]
        print(json.dumps([_served_source(Path(f), Path(src), prefixes)
                          for f, src, prefixes in json.loads(folder.read_text())]))
        return
    out = _layers(folder, tp_size)
    print(json.dumps(out))


def _layers(folder: Path, tp_size: int = 1) -> dict:
    """Every MoE layer of the folder built, loaded and processed on the CPU (the module docstring)."""
    import torch

    from moeconvert.integrations.vllm.harness import build_layer, layer_tensors, one_process, quant_config_for

    out: dict = {"layers": {}}
    skip = "." + sys.argv[sys.argv.index("--skip") + 1] if "--skip" in sys.argv else None
    try:
        cfg = quant_config_for(folder)  # vLLM's registry, from config.json; then our manifest is read
        with one_process("cpu"):
            for m in cfg.manifest["moe_layers"]:
                prefix = m["prefix"]
                runner = build_layer(cfg, prefix=prefix, num_experts=m["num_experts_global"], top_k=m["top_k"],
                                     hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size_total"],
                                     has_bias=m["has_bias"], dtype=torch.bfloat16, device="cpu", tp_size=tp_size)
                experts = runner.routed_experts
                before = {n: p.data_ptr() for n, p in runner.named_parameters()}
                named = [(n, t) for n, t in layer_tensors(folder, prefix, cfg) if not (skip and n.endswith(skip))]
                if "--direct" in sys.argv:  # as DeepSeek's loader does: the parameter's own weight_loader
                    params = dict(runner.named_parameters())
                    for name, tensor in named:
                        params[name].weight_loader(params[name], tensor)
                    loaded = sorted(name for name, _ in named)
                else:  # as AutoWeightsLoader does for Qwen / Mixtral / GLM: the runner's load_weights
                    loaded = sorted(runner.load_weights(named))
                experts.quant_method.process_weights_after_loading(experts)
                out["layers"][prefix] = _report(experts, loaded, before)
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _method_or_refusal(cfg, layer, prefix: str) -> str:
    """The class of the method ``cfg`` gives the layer, or what it raises (vLLM's CPU platform has no kernel for
    some quantized linear layers, e.g. NVFP4's: the same refusal from both configs is the same path taken)."""
    try:
        return type(cfg.get_quant_method(layer, prefix)).__name__
    except Exception as e:  # noqa: BLE001 - reported to the test, which compares them
        return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _vllm_marlin_nvfp4(src: Path, manifest: dict) -> dict:
    """What vLLM's own compressed-tensors NVFP4 MoE method holds for each layer of the source after its
    processing with the MARLIN backend (``--moe-backend marlin``, what Hopper gets): its parameters' sha256.
    Run on the CPU: the one CUDA op there, ``gptq_marlin_repack``, is stood in by vLLM's own Python reference
    of it (``marlin_utils_test.marlin_weights``, which vLLM's kernel tests hold the op to)."""
    import torch
    from vllm import _custom_ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_cols

    from moeconvert.integrations.vllm.harness import build_load_process, layer_tensors, one_process, quant_config_for
    from moeconvert.modelmap import map_model
    from moeconvert.sources import open_source

    def gptq_marlin_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        assert not is_a_8bit
        q = unpack_cols(b_q_weight.T.contiguous(), num_bits, size_n, size_k).T.contiguous()
        return marlin_weights(q, size_k, size_n, num_bits, get_weight_perm(num_bits))

    _custom_ops.gptq_marlin_repack = gptq_marlin_repack
    held = {}
    with one_process("cpu", moe_backend="marlin"):
        cfg = quant_config_for(src)
        layers = {x.prefix: x for x in map_model(open_source(str(src))).layers}
        for m in manifest["moe_layers"]:
            names = layers[m["prefix"]].source_tensors()
            timed = build_load_process(cfg, layer_tensors(src, m["prefix"], cfg, names), device="cpu",
                                       prefix=m["prefix"], num_experts=m["num_experts_global"], top_k=m["top_k"],
                                       hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size_total"],
                                       has_bias=m["has_bias"], dtype=getattr(torch, manifest["dtype"]))
            q = timed.experts.quant_method
            held[m["prefix"]] = {"method": type(q).__name__, "backend": q.nvfp4_backend.name,
                                 "params": {n: hashlib.sha256(p.data.contiguous().view(torch.uint8).numpy()).hexdigest()
                                            for n, p in timed.experts.named_parameters()}}
    return held


def _served_source(folder: Path, src: Path, prefixes: list[str], layers=_layers) -> dict:
    """A folder converted from a GPTQ / AWQ / FP8 / compressed-tensors source: its MoE layers as ``_layers``
    reports them, and for each of ``prefixes`` (layers that are not routed experts) the method the plugin's
    config gives a linear layer of that name beside the one vLLM's own config of the source gives it (the
    config vLLM's ModelConfig picks for the source, updated from the source folder as vLLM updates it)."""
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization import get_quantization_config

    from moeconvert.integrations.vllm.harness import one_process, quant_config_for

    out = layers(folder)
    if "error" in out:
        return out
    try:
        mc = ModelConfig(model=str(src), dtype="bfloat16", enforce_eager=True, max_model_len=256)
        picked = mc.quantization
        qc = json.loads((src / "config.json").read_text())["quantization_config"]
        theirs = get_quantization_config(picked).from_config(qc)
        theirs.maybe_update_config(str(src))
        ours = quant_config_for(folder)
        out["vllm_picks"] = picked
        out["inner"] = [type(ours.inner).__name__, ours.inner.get_name()]
        out["theirs"] = [type(theirs).__name__, theirs.get_name()]
        out["linear"] = {}
        manifest = json.loads((folder / "moeconvert.json").read_text())
        if (manifest["scheme"] or {}).get("kind") == "nvfp4":
            out["source"] = _vllm_marlin_nvfp4(src, manifest)
        with one_process("cpu", model_config=mc):
            for prefix in prefixes:
                layer = ReplicatedLinear(256, 256, bias=False, prefix=prefix)
                out["linear"][prefix] = [_method_or_refusal(c, layer, prefix) for c in (ours, theirs)]
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    return out


def _kernels_build_on_the_cpu() -> None:
    """vLLM's MoE kernel factories ask each experts class whether the current device runs it; the CPU tests
    build (never run) Marlin's, vLLM's Triton WNA16 and triton_kernels' MXFP4 experts, so they answer yes."""
    from vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe import (
        BaseOAITritonExperts, OAITritonMxfp4ExpertsMonolithic)
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExpertsBase
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonWNA16Experts

    for cls in (MarlinExpertsBase, TritonWNA16Experts, BaseOAITritonExperts, OAITritonMxfp4ExpertsMonolithic):
        cls._supports_current_device = staticmethod(lambda: True)


def _sparse_attention_builds_on_the_cpu() -> None:
    """Stand in, in this process only, for the CPU pieces GLM-5's and DeepSeek-V4's attention lack on vLLM
    0.33.0's CPU platform with the wheel these tests run, so that vLLM's own model classes build the whole
    model and load the folder. Nothing here is run: no forward pass happens in this process.

    * GLM-5's DeepSeek sparse attention (``use_sparse`` MLA): ``CpuPlatform.get_attn_backend_cls`` raises
      "Sparse Attention is not supported on CPU"; here it answers with vLLM's FlashMLA sparse backend class
      (one a CUDA platform picks), whose constructor reserves its buffers from vLLM's workspace manager,
      which vLLM's GPU worker initialises before it builds the model (gpu_worker.py
      ``_init_workspace_and_model_runner``): initialised here on the CPU.
    * FP8 block linear layers (DeepSeek-V4's attention and shared experts, quantized by the source's own fp8
      config): vLLM's CPU kernels for them need AMX tiles and the ``fp8_scaled_mm_cpu`` op of vLLM's CPU build,
      which this wheel lacks; a last-resort kernel on vLLM's own ``Fp8BlockScaledMMLinearKernel`` base
      (its generic weight processing) is added to the CPU platform's list, and its GEMM raises.
    * ``torch.ops._C.convert_weight_packed`` (the CPU build's AMX weight packing, which DeepSeek-V4's CPU
      attention calls on its ``wo_a`` weight after loading): a copy of the weight.

    No MoE byte depends on them: the routed experts are built by ``FusedMoEFactory`` with the plugin's method
    (the plugin's quant config answers for every ``RoutedExperts``), their tensors are read into that
    method's parameters and processed by it; these pieces are asked only for attention and for linear layers
    outside the routed experts."""
    import torch
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import PlatformEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.workspace import init_workspace_manager

    picks = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            return AttentionBackendEnum.FLASHMLA_SPARSE.get_path()
        return picks(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    init_workspace_manager(torch.device("cpu"))

    class NeverRunFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise NotImplementedError("the CPU test's stand-in FP8 block kernel is never run")

    linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU].append(NeverRunFp8BlockKernel)
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        global _PACKING
        _PACKING = torch.library.Library("_C", "FRAGMENT")  # kept alive: dropping it unregisters the op
        _PACKING.define("convert_weight_packed(Tensor weight) -> Tensor")
        _PACKING.impl("convert_weight_packed", lambda weight: weight.clone(), "CPU")


def _report(experts, loaded: list[str], before: dict | None = None) -> dict:
    """What vLLM holds for one MoE layer after processing (parameter names relative to the runner)."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig

    kernel = experts.quant_method.moe_kernel
    qc = kernel.fused_experts.quant_config
    scale = qc.w1_precision if type(experts.quant_method).__name__ == "TritonMXFP4Method" else qc.w1_scale  # a PrecisionConfig
    params = {}
    for n, p in experts.named_parameters():
        name = f"routed_experts.{n}"
        params[name] = {"sha256": hashlib.sha256(p.data.contiguous().view(torch.uint8).numpy()).hexdigest(),
                        "shape": list(p.shape)}
        if before is not None:
            params[name]["moved"] = p.data_ptr() != before[name]
    return {"method": type(experts.quant_method).__name__, "loaded": loaded, "params": params,
            "experts_class": type(kernel.fused_experts).__name__,
            "scale_is_param": _over(scale, experts.w13_weight_scale),
            # what vLLM's activation gets: swigluoai's alpha, beta, clamp limit (None: the kernel's own)
            "activation": [experts.activation.value, qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit],
            # the clamp vLLM's activation applies (the quant config's, else the model's swiglu_limit)
            "clamp_limit": ApplyMoEActivationConfig.from_configs(experts.moe_config, qc).clamp_limit,
            "weight_dtype": str(qc.weight_quant_dtype), "a16": qc.quant_dtype is None,
            # NVFP4: the kernel's per-expert global scales (g1 / g2 alphas) are the parameters themselves
            "global_scales_are_params": [qc.g1_alphas is getattr(experts, "w13_weight_scale_2", None),
                                         qc.g2_alphas is getattr(experts, "w2_weight_scale_2", None)],
            # what the model class set on its layer (vLLM's Llama4MoE: True); the plugin's methods pass it on
            "router_weight_on_input": getattr(experts, "apply_router_weight_on_input", None),
            "weights_are_params": all(_over(w, p) for w, p in zip(experts.quant_method._kernel_weights(experts),
                                                                  (experts.w13_weight, experts.w2_weight)))}


def _over(x, param) -> bool:
    """``x`` is the parameter itself, or a triton_kernels object (a Tensor, a PrecisionConfig's scale) whose
    storage is a view of the parameter's bytes (no copy)."""
    if x is param:
        return True
    data = getattr(getattr(getattr(x, "weight_scale", x), "storage", None), "data", None)
    return (data is not None and data.data_ptr() == param.data_ptr() and data.numel() == param.numel()
            and data.dtype == param.dtype)


def _humming_on_a_cpu(sm: int) -> None:
    """Answer, in this process, the few questions humming's path asks the GPU, as an SM ``sm`` GPU would.

    vLLM's and humming's schema and config code asks the device its compute capability (vLLM's
    ``check_and_fallback_input_schema``, humming's ``prepare_layer_config`` and ``is_humming_schema_compatible``
    through humming's ``DeviceInfo``, and whether it is a PPU); vLLM's humming experts check the platform, and
    their constructor sizes its lock buffer by the device's SM count and asks humming for tuning heuristics of
    the device. Those two are the only steps left out here (no kernel runs in this process); everything else
    (schemas, LayerConfigs, the quant config, the experts class vLLM's oracle picks, the modular kernel) runs
    as on the GPU."""
    import torch
    import humming.device
    import humming.transform
    from vllm.model_executor.layers.fused_moe.experts import fused_humming_moe
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    class Info:
        sm_version, sm_major, sm_minor, is_ppu = sm, sm // 10, sm % 10, False

    humming.device.current_device._value = Info()
    humming.transform.DeviceInfo = lambda device=None: Info()
    current_platform.get_device_capability = lambda device_id=0: DeviceCapability(sm // 10, sm % 10)
    fused_humming_moe.HummingExpertsBase._supports_current_device = staticmethod(lambda: True)
    fused_humming_moe.create_humming_locks = lambda device: torch.zeros(0, dtype=torch.int32)
    fused_humming_moe.HummingExpertsBase.init_humming_moe = lambda self: None


def _humming_report(experts) -> dict:
    """The schemas and humming LayerConfigs a layer holds after processing, field by field (as strings), and
    what vLLM's humming quant config takes from the layer."""
    import dataclasses

    def fields(obj) -> dict:
        return {f.name: str(getattr(obj, f.name)) for f in dataclasses.fields(obj)}

    out = {sub: {"config": fields(c), "config_str": c.to_str(), "weight_schema": fields(experts.weight_schemas[sub]),
                 "input_schema": fields(experts.input_schemas[sub])} for sub, c in experts.humming_configs.items()}
    qc = experts.quant_method.moe_quant_config
    out["quant_config"] = {"type": type(qc).__name__, "w1": fields(qc._w1) | {"scale": None, "zp": None, "bias": None},
                           "a1": str(qc._a1.dtype), "w1_config_is_layers": qc.w1_humming_config is
                           experts.humming_configs["w13"], "w2_config_is_layers": qc.w2_humming_config is
                           experts.humming_configs["w2"]}
    out["experts_class"] = type(experts.quant_method.moe_kernel.fused_experts).__name__
    return out


def _humming_cpu(folder: Path) -> None:
    """A humming folder on vLLM's CPU platform: the plugin's layers, and with ``--against SRC`` vLLM's own
    compressed-tensors method over the source layer with ``--moe-backend humming``, up to the CUDA weight
    repack (``transform_humming_weight``, which leaves the weight as it gets it here: every other step of
    humming's transform, of the scales, zero points and bias, runs). ``--refusals``: the plugin's refusals
    (:func:`_humming_refusals`); ``--hide-humming``: a Python without humming."""
    import torch

    if "--hide-humming" in sys.argv:
        import importlib.abc

        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "humming" or name.startswith("humming."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, Hide())
    out: dict = {"layers": {}, "source": {}}
    try:
        if "--hide-humming" not in sys.argv:
            _humming_on_a_cpu(90)
        from vllm.plugins import load_general_plugins

        from moeconvert.integrations.vllm.harness import (build_layer, build_load_process, layer_tensors, one_process,
                                                          quant_config_for)

        load_general_plugins()
        if "--refusals" in sys.argv:
            return _humming_refusals(folder, out)
        if "--sources" in sys.argv:  # FOLDER is a JSON list of [folder, source, linear prefixes], as without --humming
            print(json.dumps([_served_source(Path(f), Path(s), prefixes, layers=_humming_layers)
                              for f, s, prefixes in json.loads(folder.read_text())]))
            return
        src = Path(sys.argv[sys.argv.index("--against") + 1]) if "--against" in sys.argv else None
        with one_process("cpu", moe_backend="humming"):
            cfg = quant_config_for(folder)
            for m in cfg.manifest["moe_layers"]:
                kw = dict(prefix=m["prefix"], num_experts=m["num_experts_global"], top_k=m["top_k"],
                          hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size_total"],
                          has_bias=m["has_bias"], dtype=getattr(torch, cfg.manifest["dtype"]), device="cpu")
                runner = build_layer(cfg, **kw)
                before = {n: p.data_ptr() for n, p in runner.named_parameters()}
                loaded = sorted(runner.load_weights(layer_tensors(folder, m["prefix"], cfg)))
                runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)
                out["layers"][m["prefix"]] = (_report(runner.routed_experts, loaded, before)
                                              | {"humming": _humming_report(runner.routed_experts)})
                if "--mxfp4-vllm" in sys.argv:
                    out["source"][m["prefix"]] = _vllm_mxfp4_humming(folder, m, kw)
                if src is None:
                    continue
                import humming.transform

                import contextlib

                import humming.ops

                from moeconvert.packing import pack_int32, unpack_int32

                humming.transform.transform_humming_weight = lambda weight, **_: weight  # the CUDA repack
                # humming's bit (un)packing of int32 words is a CUDA op; the same LSB-first packing in torch
                # (tests/test_layout_humming.py checks humming's schema code over it)
                humming.ops.pack_weight = lambda x, b: pack_int32(x, b)
                humming.ops.unpack_weight = lambda x, b: unpack_int32(x, b, x.shape[-1] * 32 // b).to(torch.int32)
                # humming's schema conversion selects the layer's CUDA device around it (``with
                # torch.cuda.device(None)``), which a CPU build of torch cannot enter: nothing to select here
                torch.cuda.device = lambda device=None: contextlib.nullcontext()
                theirs_cfg = quant_config_for(src)
                from moeconvert.modelmap import map_model
                from moeconvert.sources import open_source

                names = next(x for x in map_model(open_source(str(src))).layers if x.prefix == m["prefix"]).source_tensors()
                theirs = build_load_process(theirs_cfg, layer_tensors(src, m["prefix"], theirs_cfg, names), **kw)
                held = {n: hashlib.sha256(p.data.contiguous().view(torch.uint8).numpy()).hexdigest()
                        for n, p in theirs.experts.named_parameters()}
                out["source"][m["prefix"]] = {"method": type(theirs.experts.quant_method).__name__, "params": held,
                                              "humming": _humming_report(theirs.experts)}
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    print(json.dumps(out))


def _humming_layers(folder: Path) -> dict:
    """Every MoE layer of a humming folder built, loaded and processed on the CPU answering as an SM90 GPU
    (``_humming_on_a_cpu``, called once before), as ``_layers`` reports them."""
    import torch

    from moeconvert.integrations.vllm.harness import build_layer, layer_tensors, one_process, quant_config_for

    out: dict = {"layers": {}}
    try:
        with one_process("cpu", moe_backend="humming"):
            cfg = quant_config_for(folder)
            for m in cfg.manifest["moe_layers"]:
                runner = build_layer(cfg, prefix=m["prefix"], num_experts=m["num_experts_global"], top_k=m["top_k"],
                                     hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size_total"],
                                     has_bias=m["has_bias"], dtype=getattr(torch, cfg.manifest["dtype"]), device="cpu")
                before = {n: p.data_ptr() for n, p in runner.named_parameters()}
                loaded = sorted(runner.load_weights(layer_tensors(folder, m["prefix"], cfg)))
                runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)
                out["layers"][m["prefix"]] = _report(runner.routed_experts, loaded, before)
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _vllm_mxfp4_humming(folder: Path, m: dict, kw: dict) -> dict:
    """vLLM's own ``Mxfp4MoEMethod`` (``quant_method: mxfp4`` checkpoints) with ``--moe-backend humming`` over
    the MXFP4 block the humming folder decodes to: its uint8 parameters filled as vLLM's loader leaves them
    (``[gate | 0 | up | 0]`` in I rounded up to 64, zeros beyond), then its own ``process_weights_after_loading``
    (``convert_to_humming_moe_kernel_format``), run on the CPU up to humming's CUDA weight repack
    (``transform_humming_weight``, which leaves the padded weight words as it gets them here)."""
    import contextlib
    import types

    import humming.transform
    import torch
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config

    from moeconvert.canonical import LayerShape
    from moeconvert.layouts import get_layout
    from moeconvert.layouts.output import parse_scheme
    from moeconvert.integrations.vllm.harness import build_layer, layer_tensors

    humming.transform.transform_humming_weight = lambda weight, **_: weight  # the CUDA repack
    torch.cuda.device = lambda device=None: contextlib.nullcontext()  # convert_humming's device context
    layout = get_layout("humming", "mxfp4")
    shape = LayerShape(num_experts=m["num_experts"], hidden_size=m["hidden_size_padded"],
                       intermediate_size=m["intermediate_size_padded"], has_bias=m["has_bias"])
    tensors = dict(layer_tensors(folder, m["prefix"]))
    block = layout.decode(tensors, shape, parse_scheme(m["scheme"], "scheme"))
    runner = build_layer(Mxfp4Config(), **kw)
    experts = runner.routed_experts
    for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
        value = getattr(block, name)
        if value is not None:
            param = getattr(experts, name.replace("_scale", "_weight_scale") if "scale" in name
                            else name if "bias" in name else f"{name}_weight")
            assert param.shape == value.shape, (name, tuple(param.shape), tuple(value.shape))
            param.data.copy_(value)
    # vLLM's MXFP4 oracle reads the model's --quantization-config override (none here) from the model config,
    # which this one-layer build has not made
    from vllm.config import get_current_vllm_config

    vc = get_current_vllm_config()
    model_config, vc.model_config = vc.model_config, types.SimpleNamespace(quantization_config=None)
    try:
        experts.quant_method.process_weights_after_loading(experts)
    finally:
        vc.model_config = model_config
    held = {n: hashlib.sha256(p.data.contiguous().view(torch.uint8).numpy()).hexdigest()
            for n, p in experts.named_parameters()}
    return {"method": type(experts.quant_method).__name__, "backend": experts.quant_method.mxfp4_backend.value,
            "params": held, "shapes": {n: list(p.shape) for n, p in experts.named_parameters()},
            "humming": _humming_report(experts)}


def _humming_refusals(folder: Path, out: dict) -> None:
    """The plugin's humming refusals, one case after the other in this process (each undone after it):
    another humming version, another GPU, no GPU, humming activations that are not 16-bit."""
    import humming
    import torch
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from moeconvert.integrations.vllm.harness import build_layer, one_process, quant_config_for

    sm90 = current_platform.get_device_capability
    cases = {"version": lambda: setattr(humming, "__version__", "0.1.20"),
             "sm80": lambda: setattr(current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(8, 0)),
             "no-gpu": lambda: setattr(current_platform, "get_device_capability", lambda device_id=0: None),
             "int8-input": lambda: os.environ.update(VLLM_HUMMING_INPUT_QUANT_CONFIG='{"a_dtype": "int8"}')}
    out["refusals"] = {}
    with one_process("cpu", moe_backend="humming"):
        cfg = quant_config_for(folder)
        m = cfg.manifest["moe_layers"][0]
        for name, apply in cases.items():
            version = humming.__version__
            apply()
            try:
                build_layer(cfg, prefix=m["prefix"], num_experts=m["num_experts_global"], top_k=m["top_k"],
                            hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size_total"],
                            has_bias=m["has_bias"], dtype=torch.bfloat16, device="cpu")
                out["refusals"][name] = None
            except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
                out["refusals"][name] = f"{type(e).__name__}: {e}"
            humming.__version__ = version
            current_platform.get_device_capability = sm90
            os.environ.pop("VLLM_HUMMING_INPUT_QUANT_CONFIG", None)
    print(json.dumps(out))


def _plain_torch_linear_layers() -> None:
    """The CPU tests build unquantized linear layers on torch's own GEMM, whatever the CPU.

    vLLM 0.33.0's CPU platform packs a small bf16 linear layer's weight for its AMX kernel when
    ``torch.cpu._is_amx_tile_supported()`` says the CPU has AMX tiles (``check_cpu_sgl_kernel`` and
    ``dispatch_cpu_unquantized_gemm`` in vllm/model_executor/layers/utils.py), through
    ``torch.ops._C.convert_weight_packed``, which the CUDA wheel these tests run does not have (its CPU
    library is another build). vLLM has no setting for that choice, so the probe it asks is answered here,
    in this test process only: without oneDNN in the wheel, vLLM then takes torch.nn.functional.linear.
    Likewise on a CPU with AVX-512 BF16 (AMD Zen 4 and later, Intel since Cooper Lake), vLLM packs the
    causal-conv1d weights of linear-attention layers (Qwen3.5-MoE's Gated DeltaNet) through
    ``torch.ops._C.causal_conv1d_weight_pack`` (``dispatch_cpu_unquantized_gemm``), which that library
    lacks too: ``torch.cpu._is_avx512_bf16_supported`` is answered False here, and the weights stay plain.

    ``MOECONVERT_TEST_CPU_CAPABILITIES=amx_tile`` makes torch report AMX tiles as a CPU that has them
    does (the test that this pin holds on such a CPU, on any machine).
    """
    import torch

    pretend = [c for c in os.environ.get("MOECONVERT_TEST_CPU_CAPABILITIES", "").split(",") if c]
    if pretend:
        reported = torch.cpu.get_capabilities
        torch.cpu.get_capabilities = lambda: {**reported(), **dict.fromkeys(pretend, True)}
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False


def _whole_model(folder: Path, out: dict, load_format: str = "auto") -> dict:
    """What ``vllm serve FOLDER [--load-format F]`` does up to its first forward: vLLM's ModelConfig reads
    config.json (and picks the plugin's method from it), vLLM's loader for ``load_format`` (its default one,
    or the plugin's ``moeconvert``) builds the whole model and loads every tensor of the folder (through the
    model's own ``load_weights``, the experts straight into their parameters with ``moeconvert``), then
    processes every module."""
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.model_loader import get_model

    from moeconvert.integrations.vllm.harness import one_process

    # what vLLM's CPU worker imports first (cpu_worker.py): CUDA events and streams (DeepSeek-V4's attention
    # makes some), the accelerator's cache the loader empties, ... answered as on the CPU
    import vllm.v1.worker.cpu.shm  # noqa: F401
    try:
        mc = ModelConfig(model=str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=256)
        out["quantization"] = mc.quantization
        with one_process("cpu", model_config=mc, load_format=load_format) as vc:
            model = get_model(vllm_config=vc)
            out["model_class"] = type(model).__name__
            for name, module in model.named_modules():
                if isinstance(module, RoutedExperts):
                    loaded = sorted(f"routed_experts.{s}" for s in module.quant_method.loaded)
                    out["layers"][name.removesuffix(".routed_experts")] = _report(module, loaded)
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _whole_model_as_unproven(folder: Path, load_format: str, family: str | None = None) -> dict:
    """:func:`_whole_model`; with ``family``, as if the family table did not say the plugin is proven on it
    (the start-up refusal, in this same process)."""
    import dataclasses

    from moeconvert.format.families import BY_NAME

    if family is None:
        return _whole_model(folder, {"layers": {}}, load_format)
    was = BY_NAME[family]
    BY_NAME[family] = dataclasses.replace(was, plugin_proven=False)
    try:
        return _whole_model(folder, {"layers": {}}, load_format)
    finally:
        BY_NAME[family] = was


def _reference_weights(src: Path, prefix: str, manifest: dict):
    """Float32 experts of one layer from the source checkpoint itself: decoded by moeconvert's source
    reader (checked against compressed-tensors in tests/test_decode.py), and for a float source quantized to
    MXFP4 with the manifest's rounding rule."""
    import torch

    from moeconvert.canonical import Partition
    from moeconvert.decode import decode_chunk
    from moeconvert.modelmap import map_model
    from moeconvert.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from moeconvert.runtime.reference import DequantizedExperts, dequantize_block
    from moeconvert.schemes import MXFP4Scheme
    from moeconvert.sources import open_source

    source = open_source(str(src))
    layer = next(m for m in map_model(source).layers if m.prefix == prefix)
    block = decode_chunk(source, layer, Partition(), 0, layer.num_experts)
    ref = dequantize_block(block)
    if (manifest["scheme"] or {}).get("kind") == "mxfp4" and (manifest.get("quantization") or {}) and \
            not isinstance(layer.scheme, MXFP4Scheme):  # an MXFP4 source (gpt-oss's own) is relaid out, not quantized
        rounding = manifest["quantization"]["rounding"]
        dt = getattr(torch, manifest["dtype"])
        q = lambda w: dequantize_mxfp4(*quantize_mxfp4(w.to(dt), rounding))
        ref = DequantizedExperts(q(ref.w13), q(ref.w2), ref.w13_bias, ref.w2_bias)
    return ref


def _gpu(mode: str, folder: Path, src: Path, device: str = "cuda", tokens: tuple[int, ...] = (1, 16, 100)) -> dict:
    """``--forward`` / ``--bench`` on ``device`` (the CPU only for a kernel that runs there: moeconvert's
    Triton kernel under ``TRITON_INTERPRET=1``)."""
    import torch

    out: dict = {"layers": {}}
    try:
        if mode == "--bench":
            from moeconvert.bench.vllm_startup import bench_vllm_startup

            return bench_vllm_startup(src, folder, device="cuda", tokens=32)
        from moeconvert.layouts.output import check_output
        from moeconvert.integrations.vllm import register
        from moeconvert.integrations.vllm.harness import build_load_process, layer_tensors, one_process, quant_config_for, run_experts
        from moeconvert.runtime.reference import activation_fn, reference_moe

        from moeconvert.integrations.vllm.scope import load_format

        register()
        manifest = check_output(folder).manifest
        dtype = getattr(torch, manifest["dtype"])
        # a gpt-oss folder is served with the plugin's loader only (the method refuses any other)
        # the WNA16 oracle's backend names (MARLIN, TRITON, ...); the plugin's methods name theirs themselves
        backend = manifest["layout"]["name"] if manifest["layout"]["name"] != "triton-fast" else "auto"
        with one_process(device, backend, load_format=load_format(manifest["family"]) or "auto"):
            cfg = quant_config_for(folder)
            out["quant_config"] = type(cfg).__name__
            for m in manifest["moe_layers"]:
                timed = build_load_process(
                    cfg, layer_tensors(folder, m["prefix"], cfg), device=device, prefix=m["prefix"],
                    num_experts=m["num_experts_global"], top_k=m["top_k"], hidden_size=m["hidden_size"],
                    intermediate_size=m["intermediate_size_total"], has_bias=m["has_bias"], dtype=dtype,
                    activation=m["activation"])
                experts = timed.experts
                ref = _reference_weights(src, m["prefix"], manifest)
                H = m["hidden_size"]
                Hp = m.get("hidden_size_padded", H)  # MXFP4 Marlin: the experts take H zero-padded
                rows = {}
                g = torch.Generator().manual_seed(0)
                # Triton's interpreter (moeconvert's kernel on the CPU) gets bf16 dots wrong: float16 tokens there
                x_dtype = dtype if device == "cuda" or dtype != torch.bfloat16 else torch.float16
                for M in tokens:
                    x = (torch.randn(M, H, generator=g) * 0.5).to(x_dtype)
                    logits = torch.randn(M, m["num_experts_global"], generator=g).to(dtype)
                    w, ids = torch.topk(torch.softmax(logits.float(), -1), m["top_k"], -1)
                    w = w / w.sum(-1, keepdim=True)  # what a monolithic kernel's own routing gives (renormalized)
                    xin = torch.nn.functional.pad(x, (0, Hp - H)).to(device)
                    y = run_experts(experts, xin, w.to(device), ids.to(torch.int32).to(device),
                                    router_logits=logits.to(device))[:, :H].float().cpu()
                    act = activation_fn(m["activation"], m.get("activation_params"))
                    want = reference_moe(x.float(), ref, w, ids, act).float()
                    rows[M] = {"rel": float((y - want).norm() / want.norm()), "finite": bool(y.isfinite().all()),
                               "want_norm": float(want.norm()), "x_dtype": str(x.dtype)}
                out["layers"][m["prefix"]] = {
                    "experts_class": type(experts.quant_method.moe_kernel.fused_experts).__name__,
                    "loaded": timed.loaded, "tokens": rows}
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
    return out


def _generate(folder: Path) -> None:
    """``vllm.LLM`` on the folder, in this process, through ``moeconvert bench vllm-serve``'s own run."""
    from moeconvert.bench import vllm_engine

    sys.argv = [sys.argv[0], str(folder)]
    vllm_engine.main()


if __name__ == "__main__":
    main()
