"""The engines' fused-MoE kernels, driven for ``moeconvert bench kernel`` on the same layer shapes.

Each contender is run the way vLLM 0.33.0 runs it (docs/layouts/), as a whole
layer from ``(x, topk_weights, topk_ids)`` (and the router logits for triton_kernels, whose routing
step takes them), so that the bench times the same work for everyone under one CUDA graph:

* ``marlin``: vLLM's Marlin MoE CUDA kernel (``_moe_C.moe_wna16_marlin_gemm``) on random tensors of
  our ``marlin`` layouts' plans (exactly what vLLM holds after its own processing): vLLM's
  ``moe_align_block_size`` op, GEMM1, an activation kernel (vLLM's ``silu_and_mul`` /
  ``swigluoai_and_mul`` cost: one fused elementwise Triton kernel here), GEMM2 with the top-k
  weights, ``_moe_C.moe_sum``.
* ``humming``: humming-kernels (vLLM's default WNA16 / MXFP4 MoE backend on Hopper), its tensors made
  by humming's own conversion from compressed-tensors int4 / OCP MXFP4 checkpoint tensors, its
  default tuning heuristics; align (vLLM's op), indexed GEMM1, ``may_process_input`` (activation),
  GEMM2, the weighted top-k sum.
* ``triton_kernels``: OpenAI's triton_kernels as vendored in vLLM 0.33.0 (MXFP4 only), vLLM's
  Hopper swizzles, ``routing`` + two ``matmul_ogs`` (fused swiglu, fused top-k reduce).

Where to find them: vLLM's MoE ops library as runtime/vllm_marlin.py says (``$MOECONVERT_VLLM_MOE_LIB``);
``humming`` importable (``pip install humming-kernels==0.1.19``); ``triton_kernels`` importable or under
``$MOECONVERT_TRITON_KERNELS_SRC`` (a folder holding ``triton_kernels/``, e.g. vLLM's
``vllm/third_party``). A contender that cannot be found or fails says why in the bench's table.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeconvert.canonical import LayerShape
from moeconvert.errors import MoeConvertError
from moeconvert.layouts import get_layout
from moeconvert.schemes import MXFP4Scheme, WNA16Scheme

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


class Unavailable(Exception):
    """The contender cannot run here (the message says why)."""


def parse_format(fmt: str) -> tuple[int, int, bool] | None:
    """``int{4,8}-g{32,64,128,ch}[-asym]`` -> (bits, group size (-1: channelwise), symmetric); ``mxfp4`` -> None.
    Anything else is refused naming the grammar."""
    if fmt == "mxfp4":
        return None
    m = re.fullmatch(r"int([48])-g(32|64|128|ch)(-asym)?", fmt)
    if m is None:
        raise MoeConvertError("unknown weight format", tensor="--format",
                              expected="mxfp4 | int4|int8 - g32|g64|g128|gch [-asym] (e.g. int4-g128, int8-gch-asym)",
                              found=fmt)
    return int(m[1]), -1 if m[2] == "ch" else int(m[2]), m[3] is None


@dataclass(frozen=True)
class Problem:
    """One layer: ``E`` experts, ``top_k``, hidden ``H``, intermediate ``I``, weight format (see
    :func:`parse_format`)."""

    name: str
    E: int
    top_k: int
    H: int
    I: int
    fmt: str

    def __post_init__(self):
        parse_format(self.fmt)

    @property
    def kind(self) -> str:
        return "mxfp4" if self.fmt == "mxfp4" else "wna16"

    @property
    def scheme(self):
        if self.fmt == "mxfp4":
            return MXFP4Scheme()
        bits, group, symmetric = parse_format(self.fmt)
        return WNA16Scheme(bits, group, symmetric, "bfloat16")

    @property
    def activation(self) -> str:
        return "swigluoai" if self.fmt == "mxfp4" else "silu"

    def layer_shape(self, has_bias: bool = False) -> LayerShape:
        return LayerShape(self.E, self.H, self.I, has_bias=has_bias, activation=self.activation, dtype="bfloat16")

    def projection_bytes(self, N: int, K: int) -> float:
        """One expert's ``[N, K]`` projection in the format: codes, bf16 scales (e8m0 for MXFP4) and the
        zero points of an asymmetric format at the codes' width."""
        if self.fmt == "mxfp4":
            return N * K * (0.5 + 1 / 32)
        bits, group, symmetric = parse_format(self.fmt)
        groups = N * (1 if group == -1 else K // group)
        return N * K * bits / 8 + groups * 2 + (0 if symmetric else groups * bits / 8)

    @property
    def expert_bytes(self) -> float:
        return self.projection_bytes(2 * self.I, self.H) + self.projection_bytes(self.H, self.I)


# ---------------------------------------------------------------------------------------------------
# random tensors of a layout's plan


def padded_shape(layout_name: str, p: Problem) -> LayerShape:
    """The layer shape ``layout_name`` plans with: H and I rounded up to its ``pad_multiples``."""
    mh, mi = get_layout(layout_name, p.kind).pad_multiples
    up = lambda v, m: -(-v // m) * m
    return LayerShape(p.E, up(p.H, mh), up(p.I, mi), activation=p.activation, dtype="bfloat16")


def random_layout_tensors(layout_name: str, p: Problem, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with the shapes and dtypes of ``layout_name``'s plan for ``p``: codes over their
    whole range, scales near 1/sqrt(K) so that outputs stay O(1) (timings do not depend on values)."""
    layout = get_layout(layout_name, p.kind)
    shape = padded_shape(layout_name, p)
    problems = layout.check(shape, p.scheme)
    if problems:
        raise Unavailable(f"layout {layout_name} cannot hold {p.name}: {'; '.join(problems)}")
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for spec in layout.plan(shape, p.scheme):
        K = shape.hidden_size if spec.suffix.startswith("w13") else shape.intermediate_size
        n = math.prod(spec.shape)
        if "scale" in spec.suffix:
            if spec.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):  # e8m0 exponents
                e0 = round(127 - math.log2(3 * K ** 0.5))
                t = torch.randint(e0 - 1, e0 + 1, spec.shape, generator=g, device=device, dtype=torch.uint8)
                out[spec.suffix] = t.view(spec.dtype) if spec.dtype != torch.uint8 else t
            else:
                t = (torch.rand(spec.shape, generator=g, device=device) + 0.5) / (4.6 * K ** 0.5)
                out[spec.suffix] = t.to(spec.dtype)
        elif spec.dtype.is_floating_point:  # biases
            out[spec.suffix] = (torch.randn(spec.shape, generator=g, device=device) * 0.1).to(spec.dtype)
        else:
            info = torch.iinfo(spec.dtype)
            out[spec.suffix] = torch.randint(info.min, info.max, (n,), generator=g, device=device,
                                             dtype=torch.int64 if spec.dtype == torch.int32 else spec.dtype
                                             ).to(spec.dtype).view(spec.shape)
    return out


# ---------------------------------------------------------------------------------------------------
# elementwise helpers the CUDA contenders need around their GEMMs


@triton.jit
def _act_and_mul_kernel(c_ptr, a_ptr, I, stride_c, stride_a, alpha, limit, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    gate = tl.load(c_ptr + row * stride_c + offs, mask=m, other=0.0).to(tl.float32)
    up = tl.load(c_ptr + row * stride_c + I + offs, mask=m, other=0.0).to(tl.float32)
    if ACT == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        y = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(a_ptr + row * stride_a + offs, y.to(a_ptr.dtype.element_ty), mask=m)


def act_and_mul(c1: torch.Tensor, activation: str) -> torch.Tensor:
    """``[P, 2I]`` -> ``[P, I]``: vLLM's ``silu_and_mul`` / ``swigluoai_and_mul`` (fp32 math, one pass)."""
    P, two_i = c1.shape
    I = two_i // 2
    a = torch.empty(P, I, dtype=c1.dtype, device=c1.device)
    block = min(1024, triton.next_power_of_2(I))
    _act_and_mul_kernel[(P, triton.cdiv(I, block))](c1, a, I, c1.stride(0), a.stride(0), SWIGLU_ALPHA, SWIGLU_LIMIT,
                                                   ACT=int(activation == "swigluoai"), BLOCK=block)
    return a


def _moe_sum(y: torch.Tensor, M: int, top_k: int, H: int) -> torch.Tensor:
    from moeconvert.runtime import vllm_marlin

    lib = vllm_marlin.ops()
    if hasattr(lib, "moe_sum"):
        out = torch.empty(M, H, dtype=y.dtype, device=y.device)
        lib.moe_sum(y.view(M, top_k, H), out)
        return out
    return y.view(M, top_k, H).sum(1)


# ---------------------------------------------------------------------------------------------------
# vLLM Marlin


def marlin(p: Problem, device):
    """``run(x, tw, ids, logits)`` of vLLM's Marlin MoE on our marlin layout's tensors."""
    from moeconvert.runtime import vllm_marlin

    why = vllm_marlin.unavailable_reason(torch.device(device), {})
    if why:
        raise Unavailable(why)
    t = random_layout_tensors("marlin", p, device)
    shape = padded_shape("marlin", p)
    Hp, Ip = shape.hidden_size, shape.intermediate_size
    type_id = vllm_marlin.weight_type_id(p.kind, getattr(p.scheme, "bits", None), getattr(p.scheme, "symmetric", True))

    def run(x, tw, ids, logits):
        M = x.shape[0]
        xp = x if Hp == p.H else torch.nn.functional.pad(x, (0, Hp - p.H))
        r = vllm_marlin.prepare(tw, ids, p.E)
        c1 = vllm_marlin.gemm(xp, t, True, r, type_id=type_id, size_n=2 * Ip, size_k=Hp)
        a = act_and_mul(c1, p.activation)
        c2 = vllm_marlin.gemm(a, t, False, r, type_id=type_id, size_n=Hp, size_k=Ip)
        return _moe_sum(c2, M, p.top_k, Hp)[:, :p.H]

    return run, sum(v.numel() * v.element_size() for v in t.values())


# ---------------------------------------------------------------------------------------------------
# humming-kernels


def _humming_env() -> None:
    """humming JIT-compiles its kernels (NVRTC, else nvcc) and needs to find a CUDA toolkit."""
    cuda = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if os.path.isdir(cuda):
        os.environ.setdefault("CUDA_HOME", cuda)
        os.environ.setdefault("CUDA_PATH", cuda)
        os.environ["PATH"] = os.path.join(cuda, "bin") + os.pathsep + os.environ.get("PATH", "")
    if os.environ.get("HUMMING_COMPILER"):
        return
    try:
        from cuda.bindings import nvrtc  # noqa: F401  (humming uses NVRTC when this imports)
        from humming.utils import nvrtc as hn

        lib = hn.get_nvrtc_library_path()  # its compile subprocess loads the library by path
        os.environ["LD_LIBRARY_PATH"] = os.path.dirname(lib) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    except Exception:
        os.environ["HUMMING_COMPILER"] = "nvcc"


_HUMMING_ACT = {  # the C expressions of vLLM's humming activations on (a = gate, b = up)
    "silu": "(a / (1.f + expf(-a))) * b",
    "swigluoai": f"(fminf(a, {SWIGLU_LIMIT}f) / (1.f + expf(-{SWIGLU_ALPHA}f * fminf(a, {SWIGLU_LIMIT}f)))) * "
                 f"(fminf(fmaxf(b, -{SWIGLU_LIMIT}f), {SWIGLU_LIMIT}f) + 1.f)",
}


@triton.jit
def _mul_sum_kernel(y_ptr, w_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        y = tl.load(y_ptr + (m * TOPK + j) * H + offs, mask=offs < H, other=0.0).to(tl.float32)
        acc += y * tl.load(w_ptr + m * TOPK + j).to(tl.float32)
    tl.store(out_ptr + m * H + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


def humming(p: Problem, device, ms: list[int]):
    try:
        import packaging.version  # noqa: F401  (humming needs it; torch does not)
    except ImportError:
        try:
            import setuptools  # noqa: F401  (recent setuptools put their vendored copy on sys.path)
            import packaging.version  # noqa: F401,F811
        except ImportError:
            pass
    try:
        import humming as hm  # noqa: F401
        from humming.config import GemmType
        from humming.forward import humming_forward, may_process_input
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config
    except Exception as e:
        raise Unavailable(f"humming-kernels not importable ({type(e).__name__}: {e})") from None
    from moeconvert.kernels.align import moe_align_block_size
    from moeconvert.runtime import vllm_marlin

    _humming_env()
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)

    def sublayer(N, K, gated):
        if p.fmt == "mxfp4":
            q = {"quant_method": "mxfp4"}
            e0 = round(127 - math.log2(3 * K ** 0.5))
            raw = {"weight": torch.randint(0, 256, (p.E, N, K // 2), generator=g, device=dev, dtype=torch.uint8),
                   "weight_scale": torch.randint(e0 - 1, e0 + 1, (p.E, N, K // 32), generator=g, device=dev,
                                                 dtype=torch.uint8)}
        else:
            s = p.scheme
            G = 1 if s.group_size == -1 else K // s.group_size
            q = {"quant_method": "compressed-tensors", "format": "pack-quantized", "type": "int", "num_bits": s.bits,
                 "strategy": "channel" if s.group_size == -1 else "group",
                 "group_size": None if s.group_size == -1 else s.group_size, "symmetric": s.symmetric}
            word = lambda *shape: torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=g, device=dev,
                                                dtype=torch.int64).to(torch.int32)
            raw = {"weight_packed": word(p.E, N, K * s.bits // 32),
                   "weight_scale": ((torch.rand(p.E, N, G, generator=g, device=dev) + 0.5)
                                    / (4.6 * K ** 0.5)).to(torch.bfloat16)}
            if not s.symmetric:  # compressed-tensors packs zero points along N
                raw["weight_zero_point"] = word(p.E, N * s.bits // 32, G)
        ws, t = BaseWeightSchema.from_config(q).convert_humming(
            tensors=dict(raw), shape_n_stacks=[N // 2] * 2 if gated else [N], shape_k_stacks=[K],
            param_dtype=torch.bfloat16, num_experts=p.E)
        return prepare_and_transform_humming_tensors(
            tensors=t, shape_n=N, shape_k=K, pad_n_to_multiple=256, pad_k_to_multiple=128, weight_schema=ws,
            input_schema=HummingInputSchema(), has_bias=False, num_experts=p.E, torch_dtype=torch.bfloat16,
            device=dev)

    try:
        c13, w13 = sublayer(2 * p.I, p.H, True)
        c2, w2 = sublayer(p.H, p.I, False)
    except Exception as e:
        raise Unavailable(f"humming weight conversion failed: {type(e).__name__}: {str(e)[:200]}") from None
    # every tuning interval, as vLLM hands them (with only those our token counts fall in, humming's
    # launcher refuses some shapes: "shape_m is not within any range defined in configs")
    tuning = [json.dumps(get_heuristics_config(layer_config=c, use_f16_accum=False, use_batch_invariant=False,
                                               gemm_type=GemmType.INDEXED)) for c in (c13, c2)]
    compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
    locks = torch.zeros(torch.cuda.get_device_properties(dev).multi_processor_count * 8, dtype=torch.int32,
                        device=dev)
    have_vllm_align = vllm_marlin.unavailable_reason(dev, {}) is None

    def block_size(tc: str, vm: int) -> int:
        return next((cf["block_shape"][0] for lo, hi, cf in json.loads(tc) if lo < vm <= hi), 64)

    def align(ids, bs):
        if have_vllm_align:
            return vllm_marlin.align(ids, bs, p.E)
        a = moe_align_block_size(ids, bs, p.E)
        return a.sorted_token_ids, a.expert_ids, a.num_tokens_post_padded

    def gemm(cfg, w, inp, out, a, k, vm, tc):
        humming_forward(cfg, inputs=inp, weight=w["weight"], weight_scale=w.get("weight_scale"),
                        zero_point=w.get("zero_point"), bias=w.get("bias"), weight_scale_2=w.get("weight_scale_2"),
                        outputs=out, locks=locks, sorted_ids=a[0], expert_ids=a[1], num_tokens_padded=a[2], top_k=k,
                        valid_shape_m=vm, compute_config=compute, tuning_config=tc)

    def run(x, tw, ids, logits):
        M = x.shape[0]
        vm = M * p.top_k
        bs1, bs2 = block_size(tuning[0], vm), block_size(tuning[1], vm)
        a1 = align(ids, bs1)
        a2 = a1 if bs2 == bs1 else align(ids, bs2)
        gu = torch.empty(vm, 2 * p.I, device=dev, dtype=x.dtype)
        act = torch.empty(vm, p.I, device=dev, dtype=x.dtype)
        down = torch.empty(vm, p.H, device=dev, dtype=x.dtype)
        out = torch.empty(M, p.H, device=dev, dtype=x.dtype)
        gemm(c13, w13, x, gu, a1, p.top_k, vm, tuning[0])
        may_process_input(c2, inputs=gu, outputs=act, token_scales=None, hadamard_block_size=0, layout="normal",
                          activation_type="binary_split", activation_impl=_HUMMING_ACT[p.activation])
        gemm(c2, w2, act, down, a2, 1, vm, tuning[1])
        block = min(1024, triton.next_power_of_2(p.H))
        _mul_sum_kernel[(M, triton.cdiv(p.H, block))](down, tw, out, p.H, TOPK=p.top_k, BLOCK=block)
        return out

    nbytes = sum(v.numel() * v.element_size() for d in (w13, w2) for v in d.values() if torch.is_tensor(v))
    return run, nbytes


# ---------------------------------------------------------------------------------------------------
# OpenAI triton_kernels (MXFP4)


def _import_triton_kernels():
    src = os.environ.get("MOECONVERT_TRITON_KERNELS_SRC")
    if src and src not in sys.path:
        sys.path.insert(0, src)
    try:
        return (importlib.import_module("triton_kernels.matmul_ogs"), importlib.import_module("triton_kernels.routing"),
                importlib.import_module("triton_kernels.swiglu"), importlib.import_module("triton_kernels.tensor"),
                importlib.import_module("triton_kernels.tensor_details.layout"),
                importlib.import_module("triton_kernels.numerics"),
                importlib.import_module("triton_kernels.matmul_ogs_details.opt_flags"))
    except Exception as e:
        raise Unavailable(f"triton_kernels not importable ({type(e).__name__}: {str(e)[:160]}); set "
                          "MOECONVERT_TRITON_KERNELS_SRC to a folder holding triton_kernels/") from None


def triton_kernels(p: Problem, device):
    if p.fmt != "mxfp4":
        raise Unavailable("triton_kernels runs MXFP4 weights only")
    mo, routing, swiglu, tensor, layout, numerics, opt_flags = _import_triton_kernels()
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    cap = torch.cuda.get_device_capability(dev)
    if cap == (9, 0):  # vLLM's Hopper settings (docs/layouts/)
        opt_flags.update_opt_flags_constraints({"split_k": 1})
    elif cap[0] in (10, 12):
        opt_flags.update_opt_flags_constraints({"is_persistent": True, "epilogue_subtile": 1})

    def weights(N, K):
        e0 = round(127 - math.log2(3 * K ** 0.5))
        q = torch.randint(0, 256, (p.E, N, K // 2), generator=g, device=dev, dtype=torch.uint8)
        s = torch.randint(e0 - 1, e0 + 1, (p.E, N, K // 32), generator=g, device=dev, dtype=torch.uint8)
        vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        if cap == (9, 0):
            s = torch.nn.functional.pad(s, (0, -s.shape[-1] % 4))
        wq = tensor.convert_layout(tensor.wrap_torch_tensor(q.transpose(-2, -1), dtype=tensor.FP4), vl, **vo)
        ws = tensor.convert_layout(tensor.wrap_torch_tensor(s.transpose(-2, -1)), sl, **so)
        pc = mo.PrecisionConfig(weight_scale=ws, flex_ctx=mo.FlexCtx(rhs_data=numerics.InFlexData()))
        return wq, pc, q.numel() + s.numel()

    try:
        w13, pc13, b13 = weights(2 * p.I, p.H)
        w2, pc2, b2 = weights(p.H, p.I)
    except Exception as e:
        raise Unavailable(f"triton_kernels weight swizzle failed: {type(e).__name__}: {str(e)[:200]}") from None
    act = mo.FusedActivation(mo.FnSpecs("swiglu", swiglu.swiglu_fn, ("alpha", "limit")), (SWIGLU_ALPHA, SWIGLU_LIMIT), 2)

    def run(x, tw, ids, logits):
        M = x.shape[0]
        rd, gi, si = routing.routing(logits, p.top_k, sm_first=True)
        inter = torch.empty((1, M * p.top_k, p.I), device=dev, dtype=x.dtype)
        out = torch.empty((1, M, p.H), device=dev, dtype=x.dtype)
        mo.matmul_ogs(x, w13, None, rd, gather_indx=gi, precision_config=pc13, gammas=None, fused_activation=act,
                      y=inter)
        mo.matmul_ogs(inter.view(M * p.top_k, p.I), w2, None, rd, scatter_indx=si, precision_config=pc2,
                      gammas=rd.gate_scal, y=out)
        return out.view(M, p.H)

    return run, b13 + b2
