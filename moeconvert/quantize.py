"""Output blocks of quantized layouts: padding, casting and MXFP4 quantization of a canonical chunk.

``moeconvert quantize --format mxfp4`` does, once, what vLLM 0.33.0's ``Mxfp4OnlineMoEMethod`` does at
every start (docs/quantize.md):

1. the experts are cast to the model dtype (the engine's parameters are in it; an fp32 checkpoint runs
   in bf16 unless ``--dtype`` says otherwise, as vLLM's ``dtype=auto`` does). A finite value the cast
   would turn into inf (bf16 weights above fp16's 65504 with ``--dtype float16``) is refused, naming the
   layer and expert, where vLLM quantizes the inf silently (to the top scale);
2. each TP rank's H and I are rounded up to the backend's multiples (``Layout.pad_multiples``) and the
   padding is zero: w13 rows ``[gate | 0 | up | 0]``, zero K columns, zero bias entries (§5.2-5.3);
3. w13 and w2 are quantized row by row along K (:func:`moeconvert.mxfp4.quantize_mxfp4`).

Integer experts (GPTQ, AWQ, compressed-tensors ``pack-quantized``: a WNA16 block) are first
dequantized to the model dtype by vLLM's own rule (:func:`moeconvert.layouts.emulation.dequantize`),
then quantized as above (docs/quantize.md, "From GPTQ, AWQ and int checkpoints"). NVFP4 experts
(compressed-tensors ``nvfp4-pack-quantized``) are dequantized as vLLM's own requantization of them does
(:func:`nvfp4_dequantized`), then quantized the same way.

A checkpoint whose experts are MXFP4 already (gpt-oss' ``*_blocks``/``*_scales``) is only padded:
zero codes with scale byte 0, which is what quantizing the zero padding gives (§5.3, vector B).

The same function builds the block a layout encodes and the block ``verify`` expects, so a file is
checked against a fresh quantization of its source, byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.layouts.base import padded_sizes, round_up
from moeconvert.mxfp4 import (E2M1_VALUES, MXFP4_BLOCK_SIZE, ROUNDINGS, dequantize_mxfp4, mxfp4_error_sums,
                              quantize_mxfp4, require_finite)
from moeconvert.layouts.emulation import dequantize
from moeconvert.schemes import FloatScheme, MXFP4Scheme, NVFP4Scheme, Scheme, WNA16Scheme

FORMATS = ("mxfp4",)
MODEL_DTYPES = ("bfloat16", "float16")
_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Quantization:
    """What ``quantize`` was asked for; stored in the manifest so ``verify`` can redo it."""

    format: str = "mxfp4"
    rounding: str = "vllm"
    device: str = "cpu"  # where the arithmetic runs; the bytes do not depend on it

    def __post_init__(self):
        if self.format not in FORMATS:
            raise MoeConvertError("unknown quantization format", expected=" | ".join(FORMATS), found=self.format)
        if self.rounding not in ROUNDINGS:
            raise MoeConvertError("unknown MXFP4 rounding rule", expected=" | ".join(ROUNDINGS), found=self.rounding)

    def to_json(self) -> dict:
        return {"format": self.format, "rounding": self.rounding}


def resolve_model_dtype(checkpoint_dtype: str, requested: str | None) -> str:
    """The dtype the engine's expert parameters have: vLLM's ``--dtype auto`` keeps bf16/fp16 and
    serves an fp32 checkpoint in bf16; an explicit ``--dtype`` wins."""
    if requested in (None, "auto"):
        return "bfloat16" if checkpoint_dtype == "float32" else checkpoint_dtype
    if requested not in MODEL_DTYPES:
        raise MoeConvertError("unsupported model dtype for MXFP4 experts", tensor="--dtype",
                              expected="auto | " + " | ".join(MODEL_DTYPES), found=requested)
    return requested


def output_problems(source_scheme: Scheme, shape: LayerShape, quant: Quantization | None) -> list[str]:
    """Limits of quantizing / padding itself, whatever the layout (the layout's own come from ``check``)."""
    problems = []
    if quant is not None and not isinstance(source_scheme, (FloatScheme, MXFP4Scheme, WNA16Scheme, NVFP4Scheme)):
        problems.append(f"experts are {source_scheme.describe()} already; `quantize` takes bf16/fp16/fp32, integer "
                        "(GPTQ, AWQ, pack-quantized; dequantized first), NVFP4 (dequantized first) or MXFP4 (relaid "
                        "out without requantizing) experts; use `moeconvert repack` for these")
    Hp, Ip = shape.hidden_size, shape.intermediate_size
    I = shape.extra.get("intermediate_size_unpadded", Ip)
    if quant is not None and isinstance(source_scheme, (WNA16Scheme, NVFP4Scheme)) and source_scheme.group_size > 0 \
            and I % source_scheme.group_size:
        # the TP cut of down_proj's K must fall on group boundaries for its scales to be cut with it
        problems.append(f"intermediate_size per TP rank = {I} is not a multiple of the source's group size "
                        f"{source_scheme.group_size}: down_proj's groups would be split across ranks")
    for name, k in (("hidden_size", Hp), ("intermediate_size per TP rank", Ip)):
        if k % MXFP4_BLOCK_SIZE:
            problems.append(f"{name} after padding = {k} must be divisible by 32 (vLLM: \"Online MXFP4 MoE "
                            "requires hidden/intermediate sizes divisible by 32\")")
    return problems


@dataclass
class Quality:
    """Per-layer error of dequant(quant(w)) against w, accumulated over chunks (real entries only)."""

    sq_err: dict = field(default_factory=lambda: {"w13": 0.0, "w2": 0.0})
    sq_ref: dict = field(default_factory=lambda: {"w13": 0.0, "w2": 0.0})
    max_abs: dict = field(default_factory=lambda: {"w13": 0.0, "w2": 0.0})
    saturated: dict = field(default_factory=lambda: {"w13": 0, "w2": 0})
    blocks: dict = field(default_factory=lambda: {"w13": 0, "w2": 0})

    def add(self, name: str, w: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, real_blocks: int) -> None:
        """Account one chunk; ``real_blocks`` counts its blocks outside the zero padding."""
        sq_err, sq_ref, max_abs, saturated = mxfp4_error_sums(w, packed, scales)
        self.sq_err[name] += sq_err
        self.sq_ref[name] += sq_ref
        self.max_abs[name] = max(self.max_abs[name], max_abs)
        self.saturated[name] += saturated
        self.blocks[name] += real_blocks

    def to_json(self) -> dict:
        """The report, finite by construction: the inputs were refused unless finite and the cast was
        refused where it overflows, so a NaN or inf here is a bug, never something to write down."""
        out = {}
        for name in ("w13", "w2"):
            num, den = self.sq_err[name] ** 0.5, self.sq_ref[name] ** 0.5
            out[name] = {
                # w == 0 everywhere quantizes exactly (num == 0), so den == 0 leaves num == 0 too
                "rel_fro_error": num / den if den else 0.0,
                "max_abs_error": self.max_abs[name],
                "saturated_block_fraction": self.saturated[name] / self.blocks[name] if self.blocks[name] else 0.0,
            }
            bad = {k: v for k, v in out[name].items() if not math.isfinite(v)}
            if bad or (num and not den):
                raise InternalError(f"quality report of {name} is not finite: {bad or 'error with a zero reference'}")
        return out


def output_block(block: ExpertBlock, shape: LayerShape, unpadded: tuple[int, int], quant: Quantization | None,
                 *, prefix: str, expert_offset: int, quality: Quality | None = None) -> ExpertBlock:
    """The canonical block a quantized layout encodes, from the source's canonical chunk.

    ``shape`` holds the padded (Hp, Ip); ``unpadded`` the rank's real (H, I). Float blocks are cast,
    padded and quantized (needs ``quant``); MXFP4 blocks are padded. Biases are cast to the model dtype.
    """
    H, I = unpadded
    Hp, Ip = shape.hidden_size, shape.intermediate_size
    dt = _TORCH[shape.dtype]
    kw = {}
    if block.w13_bias is not None:
        cast = dict(dtype=dt, prefix=prefix, expert_offset=expert_offset)
        kw["w13_bias"] = _pad_rows(to_model_dtype(block.w13_bias, what="w13_bias", **cast), I, Ip)
        kw["w2_bias"] = _pad_k(to_model_dtype(block.w2_bias, what="w2_bias", **cast), Hp)
    if isinstance(block.scheme, MXFP4Scheme):
        return ExpertBlock(
            scheme=block.scheme,
            w13=_pad_k(_pad_rows(block.w13, I, Ip), Hp // 2),
            w13_scale=_pad_k(_pad_rows(block.w13_scale, I, Ip), Hp // 32),
            w2=_pad_k(_pad_n(block.w2, Hp), Ip // 2),
            w2_scale=_pad_k(_pad_n(block.w2_scale, Hp), Ip // 32),
            **kw,
        )
    if isinstance(block.scheme, WNA16Scheme) and quant is not None:
        block = dequantized(block, shape, prefix=prefix, expert_offset=expert_offset)
    if isinstance(block.scheme, NVFP4Scheme) and quant is not None:
        block = nvfp4_dequantized(block, shape, prefix=prefix, expert_offset=expert_offset)
    if not isinstance(block.scheme, FloatScheme) or quant is None:
        raise MoeConvertError(f"cannot quantize {block.scheme.describe()} experts", tensor=prefix)
    out = {}
    for name, w, n_real, k_real in (("w13", block.w13, 2 * I, H), ("w2", block.w2, H, I)):
        require_finite(w, tensor=f"{prefix} ({name})", expert_offset=expert_offset)
        w = to_model_dtype(w.to(quant.device), dtype=dt, prefix=prefix, what=name, expert_offset=expert_offset)
        if name == "w13":
            w = _pad_k(_pad_rows(w, I, Ip), Hp)
        else:
            w = _pad_k(_pad_n(w, Hp), Ip)
        packed, scales = quantize_mxfp4(w, quant.rounding, tensor=f"{prefix} ({name})")
        refuse_infinite_blocks(w, packed, scales, rounding=quant.rounding, prefix=prefix, what=name,
                               expert_offset=expert_offset)
        if quality is not None:
            quality.add(name, w, packed, scales, w.shape[0] * n_real * k_real // MXFP4_BLOCK_SIZE)
        del w
        out[name], out[name + "_scale"] = packed.cpu(), scales.cpu()
    return ExpertBlock(scheme=MXFP4Scheme(), **out, **kw)


def dequantized(block: ExpertBlock, shape: LayerShape, *, prefix: str, expert_offset: int) -> ExpertBlock:
    """A WNA16 chunk dequantized to the model dtype as vLLM dequantizes GPTQ / AWQ int4
    (``_unpack_and_dequant_int4_gptq`` / ``_awq`` with ``output_dtype`` the model dtype: the code minus the
    zero point, exact, times the scale cast to the model dtype, rounded once).

    vLLM 0.34.0 has no requantization of its own from these formats (its GPTQ, AWQ and compressed-tensors
    WNA16 MoE methods do not implement ``dequantize_weight``), so this is the documented
    dequantize-then-quantize. A product beyond the model dtype's range (float16: 65504) is refused where
    the engine would carry an inf into the quantizer.
    """
    out = dequantize(block, shape, _TORCH[shape.dtype])
    _refuse_overflow(out, shape, "(code - zero) * scale", prefix=prefix, expert_offset=expert_offset)
    return out


def nvfp4_dequantized(block: ExpertBlock, shape: LayerShape, *, prefix: str, expert_offset: int) -> ExpertBlock:
    """An NVFP4 chunk dequantized to the model dtype as vLLM 0.33.0 / 0.34.0 dequantize compressed-tensors
    NVFP4 experts for requantization (``CompressedTensorsW4A4Nvfp4MoEMethod.dequantize_weight`` ->
    ``dequantize_nvfp4_moe_weights`` -> ``dequantize_to_dtype``, unswizzled, in
    ``quantization/utils/nvfp4_emulation_utils.py``), which their online MXFP4 method then quantizes.

    Per element, in fp32: ``E2M1(code) * (float(scale) * multiplier)``, the scale times the gate's, up's or
    down's ``1 / weight_global_scale`` rounded first, then the product; then one cast to the model dtype.
    The grouping is vLLM's: (code * scale) * multiplier, exact then rounded once, can differ from it in
    fp32 where the code is 1.5 or 3 times a power of two. A product beyond the model dtype's range is
    refused (vLLM's cast gives inf).
    """
    dt = _TORCH[shape.dtype]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)

    def one(packed: torch.Tensor, scales: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
        # multiplier: fp32 [E, N] (one value per output row)
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
        E, N, K = codes.shape
        step = (scales.float() * multiplier.unsqueeze(-1)).unsqueeze(-1)  # [E, N, K/16, 1]
        return (table[codes].view(E, N, K // 16, 16) * step).view(E, N, K).to(dt)

    I = block.w13.shape[1] // 2
    g13 = block.w13_global.repeat_interleave(I, dim=1)  # [E, 2] (gate, up) -> one per row of [gate; up]
    g2 = block.w2_global.unsqueeze(-1).expand(-1, block.w2.shape[1])
    out = ExpertBlock(scheme=FloatScheme(dtype=shape.dtype), w13=one(block.w13, block.w13_scale, g13),
                      w2=one(block.w2, block.w2_scale, g2))
    _refuse_overflow(out, shape, "code * scale * global", prefix=prefix, expert_offset=expert_offset)
    return out


def _refuse_overflow(out: ExpertBlock, shape: LayerShape, rule: str, *, prefix: str, expert_offset: int) -> None:
    """Refuse a dequantized chunk with an inf (a product beyond the model dtype's range)."""
    for what, w in (("w13", out.w13), ("w2", out.w2)):
        blown = torch.isinf(w)
        if bool(blown.any()):
            per_expert = blown.reshape(w.shape[0], -1).sum(1)
            e = int(torch.nonzero(per_expert)[0])
            advice = "; use --dtype bfloat16" if shape.dtype == "float16" else ""
            raise MoeConvertError(
                f"expert {e + expert_offset} ({what}): {int(per_expert[e])} dequantized values {rule} "
                f"exceed {shape.dtype}'s range{advice}", tensor=prefix)


def refuse_infinite_blocks(w: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *, rounding: str,
                           prefix: str, what: str, expert_offset: int) -> None:
    """Refuse a chunk whose MXFP4 encoding dequantizes to inf anywhere.

    Near the top of bf16's range (|x| > about 2^127) the ``vllm`` and ``triton_kernels`` roundings pick
    the scale 2^127 or 2^126, and a code of 4 or 6 times that is beyond every float format the kernels
    dequantize to: the file would hold an infinite weight that no verify can tell from the source's
    finite one. ``ocp`` takes the scale from the exponent of the block's maximum alone and never gets
    there. Only scale bytes 253 and 254 can overflow (6 * 2^126 > float32's largest), so only those
    blocks are dequantized.
    """
    hot = scales >= 253
    if not bool(hot.any()):
        return
    E, N, G = scales.shape
    blocks = dequantize_mxfp4(packed.reshape(E, N, G, MXFP4_BLOCK_SIZE // 2)[hot], scales[hot].unsqueeze(-1))
    bad = torch.zeros_like(hot)
    bad[hot] = torch.isinf(blocks).reshape(blocks.shape[0], -1).any(-1)
    if not bool(bad.any()):
        return
    per_expert = bad.reshape(E, -1).sum(1)
    e = int(torch.nonzero(per_expert)[0])
    big = float(w.reshape(E, N, G, MXFP4_BLOCK_SIZE)[e][bad[e]].abs().float().max())
    others = int((per_expert > 0).sum()) - 1
    more = f"; {others} more expert(s) too" if others else ""
    raise MoeConvertError(
        f"expert {e + expert_offset} ({what}): {int(per_expert[e])} block(s) of 32 (max |x| {big:.4g}) encode under "
        f"--rounding {rounding} to a scale whose values dequantize to inf{more}; --rounding ocp encodes them "
        f"finitely", tensor=prefix)


def to_model_dtype(t: torch.Tensor, *, dtype: torch.dtype, prefix: str, what: str,
                   expert_offset: int) -> torch.Tensor:
    """``t`` (a chunk of experts ``[E, ...]``) cast to the model dtype, refusing values the cast overflows.

    Finite values beyond the dtype's largest (65504 for float16) become inf, which MXFP4 then encodes
    as the top scale and a verify of the same cast cannot tell apart: the one line says which expert,
    how many values and what to do instead.
    """
    out = t.to(dtype)
    if out.dtype == t.dtype or not out.is_floating_point():
        return out
    blown = torch.isinf(out) & torch.isfinite(t)
    if not bool(blown.any()):
        return out
    per_expert = blown.reshape(blown.shape[0], -1).sum(1)
    e = int(torch.nonzero(per_expert)[0])
    big = float(t[e].abs().float().max())
    limit = torch.finfo(dtype).max
    name = str(dtype).removeprefix("torch.")
    others = int((per_expert > 0).sum()) - 1
    more = f"; {others} more expert(s) too" if others else ""
    advice = "; use --dtype bfloat16" if dtype == torch.float16 else ""
    raise MoeConvertError(
        f"expert {e + expert_offset} ({what}): {int(per_expert[e])} values exceed {name}'s range "
        f"(max |x| {big:.1e} > {limit:.6g}){more}{advice}", tensor=prefix)


def _pad_rows(t: torch.Tensor, I: int, Ip: int) -> torch.Tensor:
    """``[E, 2I, ...]`` as ``[gate; up]`` -> ``[E, 2Ip, ...]`` as ``[gate; 0; up; 0]``."""
    if I == Ip:
        return t
    out = t.new_zeros(t.shape[0], 2 * Ip, *t.shape[2:])
    out[:, :I] = t[:, :I]
    out[:, Ip:Ip + I] = t[:, I:]
    return out


def _pad_n(t: torch.Tensor, n: int) -> torch.Tensor:
    """Zero rows appended along dim 1 up to ``n``."""
    if t.shape[1] == n:
        return t
    out = t.new_zeros(t.shape[0], n, *t.shape[2:])
    out[:, :t.shape[1]] = t
    return out


def _pad_k(t: torch.Tensor, k: int) -> torch.Tensor:
    """Zero columns appended along the last dim up to ``k``."""
    if t.shape[-1] == k:
        return t
    return torch.nn.functional.pad(t, (0, k - t.shape[-1]))


__all__ = ["Quantization", "Quality", "output_block", "output_problems", "padded_sizes", "resolve_model_dtype",
           "round_up", "to_model_dtype"]
