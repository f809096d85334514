"""vLLM's own MoE layers, one at a time, outside a model: built, loaded and processed as vLLM's loader does.

vLLM's layer tests build a MoE layer this way (a ``VllmConfig`` in context, a one-process group, then
``FusedMoEFactory``). ``moeconvert bench vllm-startup`` uses it to time vLLM's load-time processing of a
source checkpoint's MoE layers beside the plugin's loading of the converted folder, and the plugin's tests
use it to look at what vLLM holds after loading.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def quant_config_for(folder: Path):
    """The quantization config vLLM builds from a folder's config.json, through vLLM's own registry (so a
    converted folder gets the plugin's); ``None`` for an unquantized checkpoint."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not qc:
        return None
    cfg = get_quantization_config(qc["quant_method"]).from_config(qc)
    cfg.maybe_update_config(str(folder))
    return cfg


@contextlib.contextmanager
def one_process(device: str, moe_backend: str = "auto", model_config=None, load_format: str = "auto"):
    """A ``VllmConfig`` for ``device`` in context, vLLM's model-parallel groups for one process and, on a
    GPU, vLLM's workspace manager (what vLLM's model runner sets up before it builds a model).

    ``model_config`` (a vLLM ``ModelConfig``) is for the methods that read the model's settings while
    they are built (vLLM's online MXFP4); the config then also holds the quantization config vLLM makes
    for that model (``VllmConfig.quant_config``). ``load_format`` is ``--load-format`` (``"moeconvert"``:
    the plugin's model loader, which a gpt-oss folder needs)."""
    from vllm.config import DeviceConfig, KernelConfig, LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    model = {"model_config": model_config} if model_config is not None else {}
    vc = VllmConfig(device_config=DeviceConfig(device=torch.device(device).type),
                    kernel_config=KernelConfig(moe_backend=moe_backend), load_config=LoadConfig(load_format=load_format),
                    **model)
    with set_current_vllm_config(vc):
        if not model_parallel_is_initialized():
            with tempfile.TemporaryDirectory() as tmp:
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"file://{tmp}/init")
                initialize_model_parallel(1, 1)
        if torch.device(device).type == "cuda":
            from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

            if not is_workspace_manager_initialized():
                init_workspace_manager(torch.device(device))
        yield vc


@contextlib.contextmanager
def process_group(device: str, *, rank: int, world_size: int, init_method: str, tensor_parallel_size: int = 1,
                  pipeline_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                  expert_placement_strategy: str = "linear", num_redundant_experts: int = 0,
                  moe_backend: str = "auto", model_config=None, load_format: str = "auto"):
    """:func:`one_process` for rank ``rank`` of ``world_size`` = TP x PP x DP processes on one gloo group.

    vLLM's parallel config is made as for its ``external_launcher`` executor (each rank started by its
    caller, as torchrun does): vLLM then keeps its DP ranks in the one world group and reads the DP rank
    from ``RANK`` (config/parallel.py), so ``RANK`` is set here; ``initialize_model_parallel`` cuts that
    group into vLLM's own TP, PP, DP and EP groups. Every process must enter with the same arguments but
    its rank, and the same ``init_method`` (``tcp://127.0.0.1:PORT``). On leaving, the groups are destroyed
    (error or not), so that the process can enter again for another shape."""
    import os

    from vllm.config import (DeviceConfig, EPLBConfig, KernelConfig, LoadConfig, ParallelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    os.environ["RANK"] = str(rank)
    # vLLM 0.34.0 refuses PP > 1 with external_launcher (config/vllm.py, _get_model_runner_unsupported_features:
    # its model runner does not broadcast PP outputs between torchrun ranks); no model runner runs here, and
    # without DP the executor only names who started the ranks, so PP takes vLLM's own "mp" executor's config
    if pipeline_parallel_size > 1 and data_parallel_size > 1:
        raise ValueError(f"PP {pipeline_parallel_size} with DP {data_parallel_size}: this harness builds DP ranks "
                         "as vLLM's external_launcher does, which vLLM 0.34.0 refuses with PP; run them apart")
    executor = "mp" if pipeline_parallel_size > 1 else "external_launcher"
    parallel = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size, enable_expert_parallel=enable_expert_parallel,
        expert_placement_strategy=expert_placement_strategy, distributed_executor_backend=executor)
    if parallel.world_size != world_size:
        raise ValueError(f"{world_size} processes for TP {tensor_parallel_size} x PP {pipeline_parallel_size} x DP "
                         f"{data_parallel_size} = {parallel.world_size}")
    model = {"model_config": model_config} if model_config is not None else {}
    vc = VllmConfig(device_config=DeviceConfig(device=torch.device(device).type), parallel_config=parallel,
                    kernel_config=KernelConfig(moe_backend=moe_backend), load_config=LoadConfig(load_format=load_format),
                    **model)
    if num_redundant_experts:
        # vLLM's config validation refuses EPLB off CUDA / ROCm / XPU; set after it, the MoE layers are built
        # as there (the flag and the redundant-expert count are all the layer reads at build and load time)
        vc.parallel_config.enable_eplb = True
        vc.parallel_config.eplb_config = EPLBConfig(num_redundant_experts=num_redundant_experts)
    with set_current_vllm_config(vc):
        try:
            init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=init_method)
            initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)
            yield vc
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def build_layer(cfg, *, prefix: str, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                has_bias: bool, dtype: torch.dtype, device: str, tp_size: int | None = 1, **routing):
    """vLLM's MoE module (a ``MoERunner``) for one layer, its parameters made on ``device`` by ``cfg``'s method.

    ``tp_size`` None: vLLM's own groups decide (TP, DP, EP, as in a model); ``routing``: more of
    ``FusedMoEFactory``'s arguments (``use_grouped_topk``, ``num_expert_group``, ``topk_group``,
    ``enable_eplb``, ``num_redundant_experts``). vLLM registers each MoE layer by name in the current
    config; building a layer of the same name again (vLLM's own and ours, one after the other) replaces
    the earlier one there."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    cc = get_current_vllm_config().compilation_config
    if cc.static_forward_context.pop(prefix, None) is not None:
        cc.static_all_moe_layers.remove(prefix)
    with torch.device(device):
        return FusedMoEFactory(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                               intermediate_size=intermediate_size, params_dtype=dtype, quant_config=cfg,
                               prefix=prefix, tp_size=tp_size, has_bias=has_bias, **routing)


def layer_tensors(folder: Path, prefix: str, cfg=None, names: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The folder's tensors under ``prefix.`` (or exactly ``names``), memory-mapped, named relative to the
    layer after ``cfg``'s checkpoint name mapper, as vLLM's loader hands them to the layer."""
    from safetensors import safe_open

    from moeconvert.sources import open_source

    mapper = cfg.get_checkpoint_weight_mapper() if cfg is not None else None
    where = {n: info.file for n, info in open_source(str(folder)).tensors.items()}  # shards, index or not
    wanted = sorted(names) if names is not None else sorted(n for n in where if n.startswith(prefix + "."))
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(where[n], []).append(n)
    out = []
    for f, ns in by_file.items():
        with safe_open(f, "pt") as h:
            for n in ns:
                mapped = mapper._map_name(n) if mapper is not None else n
                if mapped is None:  # the mapper drops it (activation-order metadata)
                    continue
                out.append((mapped[len(prefix) + 1:], h.get_tensor(n)))
    return out


@dataclass
class Timed:
    """One layer built, loaded and processed, with the time (s) and accelerator memory (bytes) of each step."""

    runner: object
    build_s: float
    load_s: float
    process_s: float
    loaded: list[str] = field(default_factory=list)
    resident_bytes: int = 0  # held by the layer after processing
    peak_extra_bytes: int = 0  # the most held during processing beyond what the layer holds after it

    @property
    def experts(self):
        return self.runner.routed_experts


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated(device) if torch.device(device).type == "cuda" else 0


def build_load_process(cfg, tensors: list[tuple[str, torch.Tensor]], *, device: str, **layer) -> Timed:
    """Build one layer, load ``tensors`` through the runner's ``load_weights`` (what vLLM's
    ``AutoWeightsLoader`` calls for Qwen / Mixtral / GLM MoE blocks) and run ``process_weights_after_loading``,
    timing each step with the device synchronised."""
    cuda = torch.device(device).type == "cuda"
    _sync(device)
    base = _allocated(device)
    t0 = time.perf_counter()
    runner = build_layer(cfg, device=device, **layer)
    _sync(device)
    t1 = time.perf_counter()
    loaded = sorted(runner.load_weights(tensors))
    _sync(device)
    t2 = time.perf_counter()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    experts = runner.routed_experts
    experts.quant_method.process_weights_after_loading(experts)
    _sync(device)
    t3 = time.perf_counter()
    timed = Timed(runner, t1 - t0, t2 - t1, t3 - t2, loaded)
    if cuda:
        timed.resident_bytes = _allocated(device) - base
        timed.peak_extra_bytes = max(0, torch.cuda.max_memory_allocated(device) - _allocated(device))
    return timed


def run_experts(experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                router_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's experts on routed tokens, through the kernel its quantization method built; a monolithic
    kernel (it routes itself: triton_kernels' for vLLM's TRITON backend) gets ``router_logits`` instead, which
    must route to ``topk_ids`` / ``topk_weights`` under the layer's routing.

    Outside a model's forward, vLLM's forward context is set for the call (as vLLM's model runner sets it
    around each forward): some experts read it (humming's, for the number of routed pairs)."""
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import is_forward_context_available, set_forward_context

    if is_forward_context_available():
        return _run_experts(experts, x, topk_weights, topk_ids, router_logits)
    with set_forward_context(None, get_current_vllm_config(), num_tokens=x.shape[0]):
        return _run_experts(experts, x, topk_weights, topk_ids, router_logits)


def _run_experts(experts, x, topk_weights, topk_ids, router_logits):
    method = experts.quant_method
    if method.is_monolithic:
        if router_logits is None:
            raise ValueError(f"{type(method.moe_kernel.fused_experts).__name__} routes itself: pass router_logits")
        y = method.apply_monolithic(layer=experts, x=x, router_logits=router_logits)
    else:
        y = method.apply(layer=experts, x=x, topk_weights=topk_weights, topk_ids=topk_ids, shared_experts=None,
                         shared_experts_input=None)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"vLLM's MoE kernel returned {type(y).__name__}, not a finished output")
    return y
