"""The runtime kernel ``humming``: humming-kernels' own Python API on ``humming`` folders (WNA16 int4 / int8,
symmetric, group scales, unsigned or sign-magnitude codes; MXFP4; NVFP4 with its fp32 secondary scale per
expert), on the SM90 GPUs the bytes are laid out for.

The computation is the one vLLM 0.33.0's ``HummingIndexedExperts`` runs (what it picks without expert
parallelism), called through humming's ``humming.forward`` (never vLLM's Python):

1. routing: each (token, slot) route goes to its expert; routes are sorted by expert and each expert's run
   padded to a multiple of the block size humming's tuning for w13 gives the route count
   (``humming.tune.get_heuristics_config``, ``block_shape[0]``), as ``moe_align_block_size`` lays them out;
2. w13: humming's indexed grouped GEMM (``humming_forward``, ``top_k = k``) -> ``[M*k, 2I]`` in the model dtype;
3. the gated activation in humming's input processing (``may_process_input``, ``binary_split``: the first I
   columns are the gate, the next I the up values; the expression is the runtime's own, runtime/reference.py);
4. w2: the indexed GEMM again (``top_k = 1``; the routes re-aligned if w2's tuning picks another block size);
5. the weighted sum over the k slots, in float32, cast to the model dtype.

The schemas and LayerConfigs come from the layout's ``humming_sublayers`` (``moeconvert.layouts.humming``,
``humming_mxfp4``, ``humming_nvfp4``; the vLLM plugin builds its own there too) and are checked against the
manifest's; the tensors are ``layer.tensors`` as the folder holds them (docs/layouts/humming.md).
"""

from __future__ import annotations

import importlib.util
import json

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.layouts.base import PARAMS_DTYPES
from moeconvert.layouts.humming import NAMES
from moeconvert.runtime.dispatch import Kernel, register_kernel

NAME = "humming"
INSTALL = "pip install 'moeconvert[humming]'"
#: vLLM's compute config for its humming experts with its defaults (VLLM_BATCH_INVARIANT and
#: VLLM_HUMMING_USE_F16_ACCUM unset: float32 accumulation) and the indexed GEMM
COMPUTE = {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"}
DEFAULT_BLOCK = 64  # what vLLM takes when no tuning interval holds the route count


def _float(v: float) -> str:
    return f"({float(v)!r}f)"


def activation_impl(name: str, params: dict | None) -> str | None:
    """The gated activation as humming's ``binary_split`` expression of ``a`` (gate) and ``b`` (up): the same
    function as the runtime's reference (runtime/reference.py), None for an activation it has none of."""
    from moeconvert.runtime.reference import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

    if name == "silu":
        raw = float((params or {}).get("limit", 0.0))
        if raw > 0:  # DeepSeek-V4's swiglu_limit (runtime/reference.py silu_and_mul)
            limit = _float(raw)
            gate = f"fminf(a, {limit})"
            return f"{gate} / (1.f + expf(-{gate})) * fmaxf(fminf(b, {limit}), -{limit})"
        return "a / (1.f + expf(-a)) * b"
    if name == "swigluoai":
        p = params or {}
        alpha, limit = _float(p.get("alpha", SWIGLUOAI_ALPHA)), _float(p.get("limit", SWIGLUOAI_LIMIT))
        gate = f"fminf(a, {limit})"
        return f"(fmaxf(fminf(b, {limit}), -{limit}) + 1.f) * {gate} / (1.f + expf(-{alpha} * {gate}))"
    if name == "swiglustep":  # Step-3.5: the SiLU clamped after it, as vLLM's humming SWIGLUSTEP expression
        limit = _float((params or {}).get("limit", 7.0))
        return f"fminf(a / (1.f + expf(-a)), {limit}) * fmaxf(fminf(b, {limit}), -{limit})"
    if name == "situ":  # vLLM's SituAndMul; the expression vLLM gives humming for SITU (humming/activation.py)
        p = params or {}
        beta = _float(p.get("beta", 1.0))
        up = "b" if p.get("linear_beta") is None else f"{_float(p['linear_beta'])} * tanhf(b / {_float(p['linear_beta'])})"
        return f"{beta} * tanhf(a / {beta}) / (1.f + expf(-a)) * {up}"
    return None


def _humming():
    """(the humming module, None) or (None, why it cannot be imported)."""
    if importlib.util.find_spec("humming") is None:
        return None, "humming-kernels is not installed"
    try:
        import humming
    except Exception as e:  # noqa: BLE001 - any import failure means the kernel cannot run
        return None, f"import humming fails ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return humming, None


def _gpu_sm(device: torch.device) -> int | None:
    """The device's SM version (90 for H100 / H200), None when it is not a CUDA device."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def unavailable_reason(layer, device: torch.device) -> str | None:
    """Why humming cannot run this layer here (None: it can)."""
    e = layer.entry
    made_for = e.layout.made_for
    want = made_for.get("humming-kernels")
    humming, why = _humming()
    if humming is None:
        return f"{why}: {INSTALL} (humming-kernels=={want}, the version the folder was made for)"
    have = getattr(humming, "__version__", None)
    if have != want:
        return (f"the installed humming-kernels is {have}, the folder was made for humming-kernels {want}, whose "
                f"weight layout it holds: pip install humming-kernels=={want}")
    sm = _gpu_sm(device)
    if sm is None:
        return f"it needs a CUDA device (device is {device})"
    if str(sm) != made_for.get("sm"):
        return (f"the folder holds humming's SM{made_for.get('sm')} bytes (H100 / H200; humming lays weights out per "
                f"GPU architecture) and this GPU is SM{sm}: convert with --backend marlin for it")
    problem = e.layout.vllm_state_problem(e.scheme)
    if problem:
        return f"{problem}; the humming kernel runs what vLLM runs"
    if activation_impl(e.activation, e.activation_params) is None:
        return f"humming's input processing has no expression here for the activation {e.activation!r}"
    return None


# ---------------------------------------------------------------------------------------------------
# routing: the layout of moe_align_block_size, in torch


def align(ids: torch.Tensor, num_experts: int, block: int):
    """``ids`` ``[M, k]`` local expert ids, -1 for routes this folder does not hold -> (sorted route ids,
    expert of each block, padded route count ``[1]``): each expert's routes (``token * k + slot``) in order,
    its run padded to a multiple of ``block`` with ``M * k`` (no route), runs in expert order. Sized for the
    worst case, without a host sync; the GEMMs stop at the padded count."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    mine = flat >= 0
    expert = torch.where(mine, flat, num_experts)  # foreign routes sort last and are dropped
    counts = torch.bincount(expert, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(expert, stable=True).indices
    sorted_expert = expert[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    keep = sorted_expert < num_experts
    e_kept = sorted_expert.clamp(max=num_experts - 1)
    rank = torch.arange(n, device=ids.device) - first_of_expert[e_kept]
    size = n + num_experts * (block - 1)
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=ids.device)
    at = torch.where(keep, starts[e_kept] + rank, size)  # dropped routes land in the spare last slot
    sorted_ids.scatter_(0, at, order.to(torch.int32))
    blocks = torch.arange((size + block - 1) // block, device=ids.device) * block
    expert_ids = torch.searchsorted(ends, blocks, right=True).clamp(max=num_experts - 1).to(torch.int32)
    return sorted_ids[:size], expert_ids, ends[-1:].to(torch.int32)


def _block(tuning: list, valid_m: int) -> int:
    """The block size humming's tuning gives ``valid_m`` routes (vLLM's choice; 64 where none holds it)."""
    for lower, upper, config in tuning:
        if lower < valid_m <= upper:
            return int(config["block_shape"][0])
    return DEFAULT_BLOCK


# ---------------------------------------------------------------------------------------------------
# the runtime's adapter


def _state(layer, device: torch.device) -> dict:
    """The layer's humming configs, tuning, activation and locks, made once and kept with the layer."""
    st = layer.kernel_state
    if "humming" in st:
        return st["humming"]
    from humming.config import GemmType
    from humming.tune import get_heuristics_config

    e = layer.entry
    s = e.scheme
    # the sizes the layout planned with: MXFP4's I is padded to 64 as vLLM pads it (the folder's w13 rows)
    subs = e.layout.humming_sublayers(e.metadata, s, hidden_size=e.shape.hidden_size,
                                      intermediate_size=e.shape.intermediate_size, num_experts=e.num_experts,
                                      has_bias=e.shape.has_bias, dtype=PARAMS_DTYPES[e.shape.dtype], device=device)
    tuning = {sub: get_heuristics_config(layer_config=v.config, use_f16_accum=COMPUTE["use_f16_accum"],
                                         use_batch_invariant=COMPUTE["use_batch_invariant"],
                                         gemm_type=GemmType.INDEXED, device=device) for sub, v in subs.items()}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    st["humming"] = {
        "configs": {sub: v.config for sub, v in subs.items()},
        "tuning": tuning,
        "tuning_str": {sub: json.dumps(t) for sub, t in tuning.items()},
        "compute_str": json.dumps(COMPUTE),
        "activation": activation_impl(e.activation, e.activation_params),
        # the GEMMs' stream-K locks, zeroed, one set per layer (vLLM: 8 per SM per experts object)
        "locks": torch.zeros(sms * 8, dtype=torch.int32, device=device),
    }
    return st["humming"]


def _local_ids(layer, topk_ids: torch.Tensor) -> torch.Tensor:
    """Global expert ids -> this folder's local ids, -1 for experts another EP rank holds."""
    e = layer.entry
    if e.expert_offset == 0 and e.num_experts == e.num_experts_global:
        return topk_ids
    local = topk_ids.long() - e.expert_offset
    return torch.where((local >= 0) & (local < e.num_experts), local, -1)


def _gemm(cfg, x: torch.Tensor, t: dict, sub: str, out: torch.Tensor, routes, top_k: int, valid_m: int, st: dict):
    from humming.forward import humming_forward

    names = NAMES[sub]
    sorted_ids, expert_ids, npad = routes
    # NVFP4's secondary scale is the GEMM's weight_scale_2, as vLLM's humming experts pass its g1 / g2 alphas
    return humming_forward(cfg, inputs=x, weight=t[names.weight], weight_scale=t[names.weight_scale],
                           zero_point=t.get(names.zero_point), bias=t.get(names.bias),
                           weight_scale_2=t.get(f"{sub}_weight_scale_2"), outputs=out,
                           sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=npad, locks=st["locks"],
                           top_k=top_k, valid_shape_m=valid_m, compute_config=st["compute_str"],
                           tuning_config=st["tuning_str"][sub])


def _run(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    from humming.forward import may_process_input

    e = layer.entry
    dtype = PARAMS_DTYPES[e.shape.dtype]
    if x.dtype != dtype:
        raise MoeConvertError("humming runs this folder's layers on activations in the model dtype (its scales "
                              "and LayerConfig are made for it)", tensor=layer.prefix,
                              expected=str(dtype).replace("torch.", ""), found=str(x.dtype).replace("torch.", ""))
    st = _state(layer, x.device)
    cfg13, cfg2 = st["configs"]["w13"], st["configs"]["w2"]
    M, k = topk_ids.shape
    E, H, I = e.num_experts, e.shape.hidden_size, e.shape.intermediate_size
    ids = _local_ids(layer, topk_ids)
    # vLLM's estimate of the routes this rank runs (its tuning key): M*k scaled to the local experts
    valid_m = -(-M * k * E // e.num_experts_global)
    b13, b2 = _block(st["tuning"]["w13"], valid_m), _block(st["tuning"]["w2"], valid_m)
    routes13 = align(ids, E, b13)
    routes2 = routes13 if b2 == b13 else align(ids, E, b2)
    x = x.contiguous()
    gate_up = torch.empty(M * k, 2 * I, dtype=dtype, device=x.device)
    _gemm(cfg13, x, layer.tensors, "w13", gate_up, routes13, k, valid_m, st)
    act, _, _ = may_process_input(cfg2, gate_up, activation_type="binary_split", activation_impl=st["activation"])
    # rows of routes to other ranks' experts are never written: zeros, so they add nothing
    down = torch.zeros(M * k, H, dtype=dtype, device=x.device)
    _gemm(cfg2, act, layer.tensors, "w2", down, routes2, 1, valid_m, st)
    w = torch.where(ids >= 0, topk_weights.float(), 0.0)
    return (down.view(M, k, H).float() * w.unsqueeze(-1)).sum(1).to(dtype)


KERNEL = register_kernel(Kernel(NAME, unavailable_reason, _run))
