"""The runtime kernel ``vllm-marlin``: vLLM 0.33.0's Marlin MoE CUDA kernel on ``marlin`` layouts (WNA16
int4/int8 and MXFP4), loaded alone. The adapter (availability, one layer's call) is at the end.

Only vLLM's compiled MoE ops library is loaded (``torch.ops.load_library`` of ``vllm/_moe_C*.so``),
never the ``vllm`` Python package: ``$MOECONVERT_VLLM_MOE_LIB`` names the file, else it is looked up
next to an installed ``vllm`` (found with ``importlib.util.find_spec``, which does not import it).

The calls are those of vLLM's ``_fused_marlin_moe`` (docs/layouts/marlin.md), with the 0.33.0
argument list of ``torch.ops._moe_C.moe_wna16_marlin_gemm``::

    (a, c_or_none, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, workspace,
     sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
     mul_topk_weights, b_q_type_id, size_m, size_n, size_k, use_atomic_add, use_fp32_reduce,
     is_zp_float, thread_k, thread_n, blocks_per_sm)

GEMM1 (``size_n = 2Ip, size_k = Hp``, ``top_k``), the activation in float32 written in the activation
dtype (vLLM's ``silu_and_mul`` reads the two halves, ``swigluoai_and_mul`` even/odd columns), GEMM2
(``size_m = M*top_k``, ``top_k = 1``, ``mul_topk_weights``), then the sum over the k.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format.manifest import made_for_versions
from moeconvert.layouts.base import W2, W13
from moeconvert.runtime.dispatch import Kernel, register_kernel

NAME = "vllm-marlin"

ENV_LIB = "MOECONVERT_VLLM_MOE_LIB"

#: vllm/scalar_type.py ``ScalarType.id`` of the weight types (uint4b8 = symmetric int4, uint4 = int4 with
#: zero points, uint8b128 = symmetric int8, float4_e2m1f = MXFP4 values)
UINT4B8, UINT4, UINT8B128 = 0x4000000100400, 0x4000000000400, 0x4000001000800
FLOAT4_E2M1F = 0x2000000010102
BLOCK_SIZES = (8, 16, 32, 48, 64)
MIN_CAPABILITY = (8, 0)  # "marlin kernel only support Ampere or newer GPUs"


def find_library() -> tuple[Path | None, str]:
    """(path of the _moe_C library or None, where it was looked for / why not)."""
    env = os.environ.get(ENV_LIB)
    if env:
        p = Path(env)
        return (p, f"${ENV_LIB}") if p.is_file() else (None, f"${ENV_LIB}={env} is not a file")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, f"vLLM is not installed and ${ENV_LIB} is not set"
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("_moe_C*.so"))
        if found:
            return found[0], "the installed vllm package"
    return None, f"the installed vllm package has no _moe_C*.so ({', '.join(spec.submodule_search_locations)})"


def installed_vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _load(path: str):
    torch.ops.load_library(path)
    return torch.ops._moe_C


def ops():
    """``torch.ops._moe_C`` with vLLM's MoE ops registered (raises MoeConvertError if it cannot be)."""
    path, where = find_library()
    if path is None:
        raise MoeConvertError(f"vLLM's MoE ops library not found: {where}")
    try:
        return _load(str(path))
    except (OSError, RuntimeError) as e:
        raise MoeConvertError(f"cannot load vLLM's MoE ops library: {str(e).splitlines()[0]}", file=str(path)) from e


def unavailable_reason(device: torch.device, made_for: dict) -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    if device.type != "cuda":
        return f"it needs a CUDA device (device is {device})"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"it needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (this GPU is {cap[0]}.{cap[1]})"
    path, where = find_library()
    if path is None:
        return where
    want, have = made_for_versions(made_for.get("vllm")), installed_vllm_version()
    if want and have and have not in want and not os.environ.get(ENV_LIB):
        return f"the installed vLLM is {have}, the layout was made for vLLM {', '.join(want)}"
    try:
        lib = ops()
    except MoeConvertError as e:
        return e.line()
    for name in ("moe_wna16_marlin_gemm", "moe_align_block_size"):
        if not hasattr(lib, name):
            return f"{path} has no op {name}"
    return None


def block_size(M: int, top_k: int, E: int) -> int:
    """vLLM's choice: the first of 8, 16, 32, 48, 64 with ``M * top_k / E / bs < 0.9``, else 64."""
    for bs in BLOCK_SIZES:
        if M * top_k / E / bs < 0.9:
            return bs
    return BLOCK_SIZES[-1]


def align(topk_ids: torch.Tensor, bs: int, E: int):
    """``moe_align_block_size``: tokens sorted by expert, padded per expert to a multiple of ``bs``."""
    n = topk_ids.numel()
    maxp = n + E * (bs - 1)
    if n < E:
        maxp = min(n * bs, maxp)
    dev = topk_ids.device
    sorted_ids = torch.empty(maxp, dtype=torch.int32, device=dev)
    expert_ids = torch.empty((maxp + bs - 1) // bs, dtype=torch.int32, device=dev)
    npad = torch.empty(1, dtype=torch.int32, device=dev)
    ops().moe_align_block_size(topk_ids, E, bs, sorted_ids, expert_ids, npad, None, None)
    return sorted_ids, expert_ids, npad


@functools.lru_cache(maxsize=None)
def _workspace(device: torch.device) -> torch.Tensor:
    """Lock storage, ``num_SMs * 4`` int32 zeros; the kernel resets it after each call (one stream)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms * 4, dtype=torch.int32, device=device)


def weight_type_id(kind: str, bits: int | None = None, symmetric: bool = True) -> int:
    if kind == "mxfp4":
        return FLOAT4_E2M1F
    if bits == 8:
        return UINT8B128  # int8 is always uint8b128 (vLLM ignores zero points for int8)
    return UINT4B8 if symmetric else UINT4


@dataclass
class Routing:
    """The aligned routing both GEMMs share (``moe_align_block_size`` for the chosen block size)."""

    topk_weights: torch.Tensor  # [M, k] float32
    top_k: int
    block_size: int
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_past_padded: torch.Tensor


def prepare(topk_weights: torch.Tensor, topk_ids: torch.Tensor, E: int) -> Routing:
    M, top_k = topk_ids.shape
    bs = block_size(M, top_k, E)
    sid, eid, npad = align(topk_ids.to(torch.int32).contiguous(), bs, E)
    return Routing(topk_weights.float().contiguous(), top_k, bs, sid, eid, npad)


def gemm(a: torch.Tensor, t: dict[str, torch.Tensor], w13: bool, r: Routing, *, type_id: int, size_n: int,
         size_k: int) -> torch.Tensor:
    """One Marlin MoE GEMM. GEMM1 (``w13``): ``a [M, K]``, each token to its k experts, out
    ``[M*k, N]``; GEMM2: ``a [M*k, K]``, one expert per row, times its topk weight, out ``[M*k, N]``."""
    p = W13 if w13 else W2
    size_m = a.shape[0]
    return ops().moe_wna16_marlin_gemm(
        a, None, t[p.weight], t.get(p.bias), t[p.weight_scale], None, None,
        t.get(p.weight_zero_point), _workspace(a.device), r.sorted_ids, r.expert_ids, r.num_tokens_past_padded,
        r.topk_weights, r.block_size, r.top_k if w13 else 1, not w13, type_id, size_m, size_n, size_k,
        False, True, False, -1, -1, -1).view(size_m * (r.top_k if w13 else 1), size_n)


def activation(c1: torch.Tensor, act, Ip: int, w13_rows: str, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's activation op on GEMM1's output, in float32, written in the activation dtype:
    ``silu_and_mul`` reads the two halves, ``swigluoai_and_mul`` even/odd columns (interleaved rows)."""
    c1 = c1.float()
    gate, up = (c1[:, 0::2], c1[:, 1::2]) if w13_rows == "interleaved" else (c1[:, :Ip], c1[:, Ip:])
    return act(gate, up).to(dtype).contiguous()


def fused_moe(x: torch.Tensor, t: dict[str, torch.Tensor], *, E: int, Hp: int, Ip: int, type_id: int,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, act, w13_rows: str = "gate_up") -> torch.Tensor:
    """Both Marlin GEMMs; ``x [M, Hp]`` fp16/bf16, ``topk_ids`` local expert ids. Returns ``[M, Hp]``."""
    M, top_k = topk_ids.shape
    r = prepare(topk_weights, topk_ids, E)
    c1 = gemm(x, t, True, r, type_id=type_id, size_n=2 * Ip, size_k=Hp)
    a = activation(c1, act, Ip, w13_rows, x.dtype)
    c2 = gemm(a, t, False, r, type_id=type_id, size_n=Hp, size_k=Ip)
    return c2.view(M, top_k, Hp).sum(1)


# ---------------------------------------------------------------------------------------------------
# the runtime's adapter: an ``MoELayer`` of a ``marlin`` layout (its manifest entry and tensors) in,
# the layer's output out


def _unavailable(layer, device: torch.device) -> str | None:
    return unavailable_reason(device, layer.entry.layout.made_for)


def _local_ids(layer, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
    """Global expert ids -> this output's local ids; other ranks' experts get weight 0 (EP)."""
    e = layer.entry
    if e.expert_offset == 0 and e.num_experts == e.num_experts_global:
        return topk_weights, topk_ids
    local = topk_ids.long() - e.expert_offset
    mine = (local >= 0) & (local < e.num_experts)
    return (torch.where(mine, topk_weights.float(), 0.0),
            torch.where(mine, local, 0).to(torch.int32).contiguous())


def _run(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    e = layer.entry
    if x.dtype not in (torch.float16, torch.bfloat16) or (e.scheme.kind == "mxfp4" and x.dtype != torch.bfloat16):
        raise MoeConvertError("vLLM's Marlin MoE runs float16/bfloat16 activations (bfloat16 only for MXFP4)",
                              tensor=layer.prefix, expected="bfloat16" + ("" if e.scheme.kind == "mxfp4" else " or float16"),
                              found=str(x.dtype).replace("torch.", ""))
    s = e.scheme
    type_id = weight_type_id(s.kind, getattr(s, "bits", None), getattr(s, "symmetric", True))
    H, Hp = e.hidden_size, e.shape.hidden_size
    Ip = e.intermediate_size_padded
    xin = x if Hp == H else torch.nn.functional.pad(x, (0, Hp - H))
    w, ids = _local_ids(layer, topk_weights, topk_ids)
    y = fused_moe(xin.contiguous(), layer.tensors, E=e.num_experts, Hp=Hp, Ip=Ip, type_id=type_id,
                  topk_weights=w, topk_ids=ids.to(torch.int32).contiguous(), act=layer.act,
                  w13_rows=e.metadata.get("w13_rows") or "gate_up")
    return y[:, :H]


KERNEL = register_kernel(Kernel(NAME, _unavailable, _run))
