"""One rank of a vLLM parallel shape on the CPU platform, run by tests/test_vllm_parallel.py (N at once).

``python vllm_parallel_child.py RANK WORLD [--humming]``: one rank that runs shape after shape (one vLLM import for every
shape of the test module), each a JSON line ``{"folder", "port", "shape"}`` on stdin: vLLM's process groups
for the shape (``harness.process_group``: TP, PP, DP, EP, expert placement, EPLB's redundant experts; they are
destroyed before the next line is read), then either each MoE layer of the folder's manifest built by vLLM's
``FusedMoEFactory`` and loaded as the model's loader loads it (``"mode": "layers"``), or the whole model
built and loaded by vLLM's default loader (``"mode": "model"``: what ``vllm serve`` does, PP included).
Answers each line with one line ``RESULT {...}`` on stdout (vLLM's own log lines go there too): what this
rank's vLLM holds for each MoE layer it built: the experts its expert map gives it, the placement vLLM
chose, each parameter's sha256 and shape. Errors are reported as ``{"error": "..."}``.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


RESULT = "RESULT "
#: every model and layer this process built, kept alive: vLLM caches facts by ``id(model)`` (models/utils.py
#: ``is_pp_missing_parameter``: the PP layers a model lacks), made for one model per process; a freed model's
#: id given to the next shape's model would hand that model the earlier one's facts
_KEEP: list = []


def main() -> None:
    _setup()
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    if "--humming" in sys.argv[3:]:  # humming's folders: the process answers as an SM90 GPU (no kernel runs)
        from vllm_plugin_child import _humming_on_a_cpu

        _humming_on_a_cpu(90)
    for line in sys.stdin:
        job = json.loads(line)
        print(RESULT + json.dumps(_run(Path(job["folder"]), rank, world, job["port"], job["shape"])), flush=True)


def _setup() -> None:
    import torch

    from vllm.plugins import load_general_plugins

    # this script's folder is on sys.path
    from vllm_plugin_child import _kernels_build_on_the_cpu, _plain_torch_linear_layers

    _kernels_build_on_the_cpu()  # the MoE kernels need CUDA to run, not to be built
    _plain_torch_linear_layers()  # torch's GEMM for plain linear layers, on a CPU with AMX tiles too
    torch.accelerator.empty_cache = lambda: None  # the loader empties the accelerator's cache; a CPU build has none
    load_general_plugins()
    _count_loader_reads()


def _run(folder: Path, rank: int, world: int, port: int, shape: dict) -> dict:
    out: dict = {"rank": rank, "layers": {}}
    group = dict(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                 tensor_parallel_size=shape.get("tp", 1), pipeline_parallel_size=shape.get("pp", 1),
                 data_parallel_size=shape.get("dp", 1), enable_expert_parallel=shape.get("ep", False),
                 expert_placement_strategy=shape.get("placement", "linear"),
                 num_redundant_experts=shape.get("redundant", 0), load_format=shape.get("load_format", "auto"))
    try:
        if shape["mode"] == "model":
            _model(folder, group, out)
        else:
            _layers(folder, group, out, shape)
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _layers(folder: Path, group: dict, out: dict, shape: dict) -> None:
    """Each MoE layer as the model builds it (grouped routing from config.json, EPLB's redundant experts),
    loaded as Qwen's ``AutoWeightsLoader`` (the runner's ``load_weights``) or DeepSeek's loader (each
    parameter's own ``weight_loader``) loads it."""
    import torch

    from moeconvert.integrations.vllm.harness import build_layer, layer_tensors, quant_config_for, process_group

    hf = json.loads((folder / "config.json").read_text())
    cfg = quant_config_for(folder)
    with process_group("cpu", **group):
        for m in cfg.manifest["moe_layers"]:
            routing = {}
            if hf.get("n_group"):
                routing = dict(use_grouped_topk=True, num_expert_group=hf["n_group"], topk_group=hf["topk_group"])
            if group["num_redundant_experts"]:
                routing.update(enable_eplb=True, num_redundant_experts=group["num_redundant_experts"])
            runner = build_layer(cfg, prefix=m["prefix"], num_experts=m["num_experts_global"], top_k=m["top_k"],
                                 hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size_total"],
                                 has_bias=m["has_bias"], dtype=torch.bfloat16, device="cpu", tp_size=None, **routing)
            named = layer_tensors(folder, m["prefix"], cfg)
            if hf.get("model_type", "").startswith("deepseek"):
                params = dict(runner.named_parameters())
                for name, tensor in named:
                    params[name].weight_loader(params[name], tensor)
            else:
                list(runner.load_weights(named))
            _KEEP.append(runner)
            experts = runner.routed_experts
            experts.quant_method.process_weights_after_loading(experts)
            out["layers"][m["prefix"]] = _report(experts)
            if "forward" in shape:
                out["layers"][m["prefix"]]["forward"] = _forward(experts, m, cfg.manifest, Path(shape["forward"]))


def _forward(experts, m: dict, manifest: dict, src: Path) -> dict:
    """This rank's experts on 5 routed tokens (the same on every rank: one seed), through the kernel the
    plugin's method built, without the all-reduce vLLM's layer adds after it: the ranks' outputs must sum to
    ``reference_moe`` on the source's own weights, which each rank reports too. Float16 tokens: the kernel
    runs under Triton's interpreter here (moeconvert's triton-fast experts)."""
    import torch

    from moeconvert.integrations.vllm.harness import run_experts
    from moeconvert.runtime.reference import activation_fn, reference_moe
    from vllm_plugin_child import _reference_weights

    g = torch.Generator().manual_seed(0)
    H, Hp = m["hidden_size"], m.get("hidden_size_padded", m["hidden_size"])
    x = (torch.randn(5, H, generator=g) * 0.5).to(torch.float16)
    logits = torch.randn(5, m["num_experts_global"], generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), m["top_k"], -1)
    y = run_experts(experts, torch.nn.functional.pad(x, (0, Hp - H)), w, ids.to(torch.int32))[:, :H].float()
    want = reference_moe(x.float(), _reference_weights(src, m["prefix"], manifest), w, ids,
                         activation_fn(m["activation"], m.get("activation_params"))).float()
    return {"y": y.tolist(), "want": want.tolist()}


def _model(folder: Path, group: dict, out: dict) -> None:
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.model_loader import get_model

    from moeconvert.integrations.vllm.harness import process_group

    _READ.clear()
    mc = ModelConfig(model=str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=256)
    with process_group("cpu", model_config=mc, **group) as vc:
        model = get_model(vllm_config=vc)
        _KEEP.append(model)
        for name, module in model.named_modules():
            if isinstance(module, RoutedExperts):
                out["layers"][name.removesuffix(".routed_experts")] = _report(module)
    if "bytes" in _READ:
        out["read_bytes"] = _READ["bytes"]


#: what the process read while the last model's weights were loaded (``_count_loader_reads``)
_READ: dict = {}


def _count_loader_reads() -> None:
    """What the process reads while a loader loads the weights, from the OS's own counter (rchar: bytes read
    by read()-family calls; the moeconvert loader reads with preadv, vLLM's default one maps files)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loaders = [cls for cls in DefaultModelLoader.__subclasses__() if cls.__name__ == "MoeconvertModelLoader"]
    for cls in [DefaultModelLoader, *loaders]:
        def counted(self, model, model_config, _load=cls.__dict__["load_weights"]):
            before = _rchar()
            _load(self, model, model_config)
            _READ["bytes"] = _rchar() - before

        cls.load_weights = counted


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def _report(experts) -> dict:
    import torch

    emap = experts.expert_map_manager.expert_map
    owned = None
    if emap is not None:
        idx = torch.nonzero(emap >= 0).flatten()
        owned = idx[torch.argsort(emap[idx])].tolist()
    pc = experts.moe_config.moe_parallel_config
    return {
        "placement": experts.expert_placement_strategy, "physical_experts": owned,
        "global_num_experts": experts.global_num_experts,
        "tp": [pc.tp_size, pc.tp_rank], "ep": [pc.ep_size, pc.ep_rank] if pc.use_ep else [1, 0],
        "loaded": sorted(experts.quant_method.loaded),
        "params": {n: {"sha256": hashlib.sha256(p.data.contiguous().view(torch.uint8).numpy()).hexdigest(),
                       "shape": list(p.shape)} for n, p in experts.named_parameters()},
    }


if __name__ == "__main__":
    main()
