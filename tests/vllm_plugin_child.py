"""Run by tests/test_vllm_plugin.py under a Python that has vLLM 0.33.0 (``MOECONVERT_VLLM_PYTHON``).

On a GPU: ``python vllm_plugin_child.py FOLDER --forward SRC`` (or ``JOBS.json``, a list of ``[mode,
folder, source]``, all in one process) builds each MoE layer with the plugin's
method on CUDA, loads the folder through vLLM's ``load_weights`` and runs vLLM's experts object on routed
tokens against ``runtime/reference.py`` on the source's own weights (decoded from SRC, quantized to MXFP4
the way the folder's manifest says for a bf16 source); ``--bench SRC`` prints ``moeconvert bench
vllm-startup``'s result.

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
if not any(m in sys.argv for m in GPU_MODES) and not sys.argv[1].endswith(".json"):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> None:
    folder = Path(sys.argv[1])
    if "--generate" in sys.argv:
        return _generate(folder)
    if folder.suffix == ".json":  # a list of [mode, folder, source]: many GPU checks in one vLLM process
        print(json.dumps([_gpu(mode, Path(f), Path(s)) for mode, f, s in json.loads(folder.read_text())]))
        return
    for mode in GPU_MODES:
        if mode in sys.argv:
            print(json.dumps(_gpu(mode, folder, Path(sys.argv[sys.argv.index(mode) + 1]))))
            return
    tp_size = int(sys.argv[sys.argv.index("--tp-size") + 1]) if "--tp-size" in sys.argv else 1
    _plain_torch_linear_layers()
    import torch
    import vllm

    if "--pretend-vllm" in sys.argv:  # the version refusal, without a second vLLM
        vllm.__version__ = sys.argv[sys.argv.index("--pretend-vllm") + 1]
    if "--layout-lists" in sys.argv:  # a layout listing fewer vLLM versions (the folder's own list is within it)
        from moeconvert.layouts import get_layout

        get_layout("marlin", "wna16").made_for["vllm"] = sys.argv[sys.argv.index("--layout-lists") + 1].split(",")
    from moeconvert.integrations.vllm.harness import build_layer, layer_tensors, one_process, quant_config_for

    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExpertsBase
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonWNA16Experts

    # Marlin and vLLM's Triton MoE kernel need CUDA to run, not to be built: vLLM's kernel factories check
    # the device, so on the CPU the check is answered here. Nothing runs a kernel in this process.
    MarlinExpertsBase._supports_current_device = staticmethod(lambda: True)
    TritonWNA16Experts._supports_current_device = staticmethod(lambda: True)

    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own plugin loader: it finds our entry point and runs register()
    out: dict = {"layers": {}}
    if "--whole-model" in sys.argv:
        return _whole_model(folder, out)
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
    print(json.dumps(out))


def _report(experts, loaded: list[str], before: dict | None = None) -> dict:
    """What vLLM holds for one MoE layer after processing (parameter names relative to the runner)."""
    import torch

    kernel = experts.quant_method.moe_kernel
    params = {}
    for n, p in experts.named_parameters():
        name = f"routed_experts.{n}"
        params[name] = {"sha256": hashlib.sha256(p.data.contiguous().view(torch.uint8).numpy()).hexdigest(),
                        "shape": list(p.shape)}
        if before is not None:
            params[name]["moved"] = p.data_ptr() != before[name]
    return {"method": type(experts.quant_method).__name__, "loaded": loaded, "params": params,
            "experts_class": type(kernel.fused_experts).__name__,
            "scale_is_param": kernel.fused_experts.quant_config.w1_scale is experts.w13_weight_scale}


def _plain_torch_linear_layers() -> None:
    """The CPU tests build unquantized linear layers on torch's own GEMM, whatever the CPU.

    vLLM 0.33.0's CPU platform packs a small bf16 linear layer's weight for its AMX kernel when
    ``torch.cpu._is_amx_tile_supported()`` says the CPU has AMX tiles (``check_cpu_sgl_kernel`` and
    ``dispatch_cpu_unquantized_gemm`` in vllm/model_executor/layers/utils.py), through
    ``torch.ops._C.convert_weight_packed``, which the CUDA wheel these tests run does not have (its CPU
    library is another build). vLLM has no setting for that choice, so the probe it asks is answered here,
    in this test process only: without oneDNN in the wheel, vLLM then takes torch.nn.functional.linear.

    ``MOECONVERT_TEST_CPU_CAPABILITIES=amx_tile`` makes torch report AMX tiles as a CPU that has them
    does (the test that this pin holds on such a CPU, on any machine).
    """
    import torch

    pretend = [c for c in os.environ.get("MOECONVERT_TEST_CPU_CAPABILITIES", "").split(",") if c]
    if pretend:
        reported = torch.cpu.get_capabilities
        torch.cpu.get_capabilities = lambda: {**reported(), **dict.fromkeys(pretend, True)}
    torch.cpu._is_amx_tile_supported = lambda: False


def _whole_model(folder: Path, out: dict) -> None:
    """What ``vllm serve FOLDER`` does up to its first forward: vLLM's ModelConfig reads config.json (and
    picks the plugin's method from it), vLLM's default loader builds the whole model and loads every
    tensor of the folder through the model's own ``load_weights``, then processes every module."""
    import torch
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.model_loader import get_model

    from moeconvert.integrations.vllm.harness import one_process

    torch.accelerator.empty_cache = lambda: None  # the loader empties the accelerator's cache; a CPU build has none
    try:
        mc = ModelConfig(model=str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=256)
        out["quantization"] = mc.quantization
        with one_process("cpu", model_config=mc) as vc:
            model = get_model(vllm_config=vc)
            for name, module in model.named_modules():
                if isinstance(module, RoutedExperts):
                    loaded = sorted(f"routed_experts.{s}" for s in module.quant_method.loaded)
                    out["layers"][name.removesuffix(".routed_experts")] = _report(module, loaded)
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


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
    from moeconvert.sources import open_source

    source = open_source(str(src))
    layer = next(m for m in map_model(source).layers if m.prefix == prefix)
    block = decode_chunk(source, layer, Partition(), 0, layer.num_experts)
    ref = dequantize_block(block)
    if (manifest["scheme"] or {}).get("kind") == "mxfp4" and (manifest.get("quantization") or {}):
        rounding = manifest["quantization"]["rounding"]
        dt = getattr(torch, manifest["dtype"])
        q = lambda w: dequantize_mxfp4(*quantize_mxfp4(w.to(dt), rounding))
        ref = DequantizedExperts(q(ref.w13), q(ref.w2), ref.w13_bias, ref.w2_bias)
    return ref


def _gpu(mode: str, folder: Path, src: Path) -> dict:
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

        register()
        manifest = check_output(folder).manifest
        dtype = getattr(torch, manifest["dtype"])
        with one_process("cuda", manifest["layout"]["name"]):
            cfg = quant_config_for(folder)
            out["quant_config"] = type(cfg).__name__
            for m in manifest["moe_layers"]:
                timed = build_load_process(
                    cfg, layer_tensors(folder, m["prefix"], cfg), device="cuda", prefix=m["prefix"],
                    num_experts=m["num_experts_global"], top_k=m["top_k"], hidden_size=m["hidden_size"],
                    intermediate_size=m["intermediate_size_total"], has_bias=m["has_bias"], dtype=dtype)
                experts = timed.experts
                ref = _reference_weights(src, m["prefix"], manifest)
                H = m["hidden_size"]
                Hp = m.get("hidden_size_padded", H)  # MXFP4 Marlin: the experts take H zero-padded
                rows = {}
                g = torch.Generator().manual_seed(0)
                for M in (1, 16, 100):
                    x = (torch.randn(M, H, generator=g) * 0.5).to(dtype)
                    logits = torch.randn(M, m["num_experts_global"], generator=g)
                    w, ids = torch.topk(torch.softmax(logits, -1), m["top_k"], -1)
                    w = w / w.sum(-1, keepdim=True)
                    xin = torch.nn.functional.pad(x, (0, Hp - H)).cuda()
                    y = run_experts(experts, xin, w.cuda(), ids.to(torch.int32).cuda())[:, :H].float().cpu()
                    want = reference_moe(x.float(), ref, w, ids, activation_fn("silu")).float()
                    rows[M] = {"rel": float((y - want).norm() / want.norm()), "finite": bool(y.isfinite().all()),
                               "want_norm": float(want.norm())}
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
