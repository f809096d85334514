"""``triton-fast``: moeconvert's own layout for its fused-MoE Triton kernel (kernels/moe_fast.py).

Made for one wide, coalesced load per weight tile on Hopper and no register shuffle after unpacking.
Every projection (w13: N = 2I rows [gate; up], K = H; w2: N = H, K = I) is stored K-major with the
output channels contiguous:

=========================  ===================  ==============================================
tensor                     shape                dtype / contents
=========================  ===================  ==============================================
``*_weight`` int4, MXFP4   ``[E, K/2, N]``      uint8: byte (r, n) = code(n, r) | code(n, r + K/2) << 4
``*_weight`` int8          ``[E, K, N]``        uint8: the unsigned code (q + 128)
``*_weight_scale``         ``[E, K/g, N]``      model dtype (WNA16), uint8 e8m0 (MXFP4, g = 32)
``*_weight_zero_point``    ``[E, K/g, N]``      uint8, one unsigned zero point a byte (int4 asymmetric)
``*_bias``                 ``[E, N]``           model dtype (layers with expert biases)
=========================  ===================  ==============================================

The 4-bit byte pairs input ``k`` with input ``k + K/2`` (a "half split", not neighbours): the two
nibbles of a ``[BLOCK_K/2, BLOCK_N]`` byte tile are then two ready MMA operands, multiplied with the
contiguous activation columns ``k..`` and ``K/2 + k..``. When K/2 is whole scale groups (WNA16: K a
multiple of 2g; MXFP4: H and I multiples of 64, padded so by ``quantize``) a K step reads one row of
scales for each half; otherwise (e.g. I = 384 at g = 128) the kernel reads a scale per element.
w13 keeps [gate; up] rows for every activation (gpt-oss' swiglu included): the kernel reads gate
column n and up column n + I in one program and applies the activation there.

WNA16 codes stay unsigned (``u = q + 2^(b-1)``); symmetric layers have no zero-point tensor (the
kernel subtracts 8 / 128). Scales and biases are cast to the model dtype (round to nearest even);
MXFP4 scales stay the e8m0 bytes. Version 1.
"""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError
from moeconvert.layouts import register
from moeconvert.layouts.base import Layout, TensorSpec
from moeconvert.schemes import Scheme, WNA16Scheme

NAME = "triton-fast"
KERNEL = "moeconvert.kernels fused_moe_fast (kernels/moe_fast.py)"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ACTIVATIONS = ("silu", "swigluoai")


# ---------------------------------------------------------------------------------------------------
# bytes


def pack_half_split(codes: torch.Tensor) -> torch.Tensor:
    """Canonical unsigned 4-bit codes ``[E, N, K]`` -> ``[E, K/2, N]`` uint8, low nibble k, high k + K/2."""
    K = codes.shape[-1]
    if K % 2:
        raise InternalError(f"half-split packing needs an even K, got {K}")
    t = codes.to(torch.uint8).transpose(1, 2)
    return (t[:, : K // 2] | (t[:, K // 2:] << 4)).contiguous()


def unpack_half_split(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_half_split`: ``[E, K/2, N]`` -> codes ``[E, N, K]`` uint8."""
    return torch.cat([packed & 0xF, packed >> 4], dim=1).transpose(1, 2).contiguous()


def _swap_kn(t: torch.Tensor) -> torch.Tensor:
    """``[E, N, X]`` <-> ``[E, X, N]``, contiguous (its own inverse): int8 weights, scales, zero points."""
    return t.transpose(1, 2).contiguous()


def _packed_mxfp4_to_codes(packed: torch.Tensor) -> torch.Tensor:
    """Canonical MXFP4 ``[E, N, K/2]`` (low nibble = even k) -> codes ``[E, N, K]``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _codes_to_packed_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _common_problems(shape: LayerShape) -> list[str]:
    problems = []
    if shape.activation not in ACTIVATIONS:
        problems.append(f"activation = {shape.activation}: the triton-fast kernel applies {' or '.join(ACTIVATIONS)}")
    if shape.num_experts < 1:
        problems.append(f"num_experts = {shape.num_experts}: the layer must hold at least one expert")
    if shape.num_experts > 1024:
        problems.append(f"num_experts = {shape.num_experts}: the kernel's alignment step holds at most 1024 experts")
    return problems


# ---------------------------------------------------------------------------------------------------


@register
class TritonFastWNA16Layout(Layout):
    name = NAME
    version = 1
    schemes = ("wna16",)
    kernel = KERNEL

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        H, I, g, b = shape.hidden_size, shape.intermediate_size, scheme.group_size, scheme.bits
        problems = _common_problems(shape)
        if b not in (4, 8):
            problems.append(f"bits = {b}: the triton-fast kernel takes 4- and 8-bit weights")
        if shape.dtype not in DTYPES:
            problems.append(f"model dtype = {shape.dtype}: the kernel runs float16, bfloat16 or float32 activations")
        for what, k in (("hidden_size H", H), ("intermediate_size I (per TP partition)", I)):
            if g > 0 and k % g:
                problems.append(f"{what} = {k} must be divisible by group_size {g}")
            elif b == 4 and k % 2:
                problems.append(f"{what} = {k} must be even for int4: a byte pairs input k with k + K/2")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        assert isinstance(scheme, WNA16Scheme)
        E, H, I, b = shape.num_experts, shape.hidden_size, shape.intermediate_size, scheme.bits
        dt = DTYPES[shape.dtype]
        rows = (lambda k: k // 2) if b == 4 else (lambda k: k)
        specs = [
            TensorSpec("w13_weight", (E, rows(H), 2 * I), torch.uint8),
            TensorSpec("w2_weight", (E, rows(I), H), torch.uint8),
            TensorSpec("w13_weight_scale", (E, scheme.groups(H), 2 * I), dt),
            TensorSpec("w2_weight_scale", (E, scheme.groups(I), H), dt),
        ]
        if not scheme.symmetric:
            specs += [TensorSpec("w13_weight_zero_point", (E, scheme.groups(H), 2 * I), torch.uint8),
                      TensorSpec("w2_weight_zero_point", (E, scheme.groups(I), H), torch.uint8)]
        if shape.has_bias:
            specs += [TensorSpec("w13_bias", (E, 2 * I), dt), TensorSpec("w2_bias", (E, H), dt)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        s = block.scheme
        self.require(shape, s)
        self.require_block_sizes(block, shape)
        dt = DTYPES[shape.dtype]
        weights = pack_half_split if s.bits == 4 else _swap_kn
        out = {
            "w13_weight": weights(block.w13),
            "w2_weight": weights(block.w2),
            "w13_weight_scale": _swap_kn(block.w13_scale.to(dt)),
            "w2_weight_scale": _swap_kn(block.w2_scale.to(dt)),
        }
        if not s.symmetric:
            out["w13_weight_zero_point"] = _swap_kn(block.w13_zero.to(torch.uint8))
            out["w2_weight_zero_point"] = _swap_kn(block.w2_zero.to(torch.uint8))
        if block.w13_bias is not None:
            out["w13_bias"] = block.w13_bias.to(dt).contiguous()
            out["w2_bias"] = block.w2_bias.to(dt).contiguous()
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical block; scales and biases stay in the file's (model) dtype."""
        assert isinstance(scheme, WNA16Scheme)
        weights = unpack_half_split if scheme.bits == 4 else _swap_kn
        kw = {
            "w13": weights(tensors["w13_weight"]),
            "w2": weights(tensors["w2_weight"]),
            "w13_scale": _swap_kn(tensors["w13_weight_scale"]),
            "w2_scale": _swap_kn(tensors["w2_weight_scale"]),
        }
        if not scheme.symmetric:
            kw["w13_zero"] = _swap_kn(tensors["w13_weight_zero_point"])
            kw["w2_zero"] = _swap_kn(tensors["w2_weight_zero_point"])
        if "w13_bias" in tensors:
            kw["w13_bias"], kw["w2_bias"] = tensors["w13_bias"], tensors["w2_bias"]
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """The source block with scales and biases cast to the model dtype, as encode casts them."""
        dt = DTYPES[shape.dtype]
        cast = lambda t: None if t is None else t.to(dt)
        return dataclasses.replace(block, w13_scale=cast(block.w13_scale), w2_scale=cast(block.w2_scale),
                                   w13_bias=cast(block.w13_bias), w2_bias=cast(block.w2_bias))

    def layer_metadata(self, shape: LayerShape, scheme: Scheme) -> dict:
        return {"format": f"int{scheme.bits}", "w13_rows": "gate_up",
                "packing": "half_split" if scheme.bits == 4 else "bytes"}

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        if scheme.scale_dtype != shape.dtype:
            return [f"checkpoint scales are {scheme.scale_dtype}; they are cast to the model dtype {shape.dtype} "
                    "(round to nearest even)"]
        return []


@register
class TritonFastMXFP4Layout(Layout):
    name = NAME
    version = 1
    schemes = ("mxfp4",)
    kernel = KERNEL
    # K/2 whole 32-blocks for both GEMMs: H and I rounded up to 64 (zeros), as quantize pads
    pad_multiples = (64, 64)

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        H, I = shape.hidden_size, shape.intermediate_size
        problems = _common_problems(shape)
        for what, k in (("hidden_size H", H), ("intermediate_size I (per TP partition)", I)):
            if k % 64:
                problems.append(f"{what} = {k} must be a multiple of 64 (padded so by quantize): a byte pairs input k "
                                "with k + K/2, so K/2 must be whole 32-blocks")
        if shape.dtype not in ("bfloat16", "float32"):
            problems.append(
                f"model dtype = {shape.dtype}: MXFP4 weights are dequantized to the activation dtype, and float16 cannot "
                "hold e8m0 scales outside 2^-24..2^15; use --dtype bfloat16")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
        specs = [
            TensorSpec("w13_weight", (E, H // 2, 2 * I), torch.uint8),
            TensorSpec("w2_weight", (E, I // 2, H), torch.uint8),
            TensorSpec("w13_weight_scale", (E, H // 32, 2 * I), torch.uint8),
            TensorSpec("w2_weight_scale", (E, I // 32, H), torch.uint8),
        ]
        if shape.has_bias:
            dt = DTYPES[shape.dtype]
            specs += [TensorSpec("w13_bias", (E, 2 * I), dt), TensorSpec("w2_bias", (E, H), dt)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        E, H, I = block.num_experts, shape.hidden_size, shape.intermediate_size
        want = {"w13": (E, 2 * I, H // 2), "w2": (E, H, I // 2), "w13_scale": (E, 2 * I, H // 32),
                "w2_scale": (E, H, I // 32)}
        for name, dims in want.items():
            t = getattr(block, name)
            if t is None or tuple(t.shape) != dims:
                raise InternalError(f"MXFP4 block {name} is {None if t is None else tuple(t.shape)}, the padded layer "
                                    f"H={H} I={I} needs {dims}")
        as_bytes = lambda t: t.view(torch.uint8) if t.dtype != torch.uint8 else t
        out = {
            "w13_weight": pack_half_split(_packed_mxfp4_to_codes(block.w13)),
            "w2_weight": pack_half_split(_packed_mxfp4_to_codes(block.w2)),
            "w13_weight_scale": _swap_kn(as_bytes(block.w13_scale)),
            "w2_weight_scale": _swap_kn(as_bytes(block.w2_scale)),
        }
        if block.w13_bias is not None:
            dt = DTYPES[shape.dtype]
            out["w13_bias"] = block.w13_bias.to(dt).contiguous()
            out["w2_bias"] = block.w2_bias.to(dt).contiguous()
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        kw = {
            "w13": _codes_to_packed_mxfp4(unpack_half_split(tensors["w13_weight"])),
            "w2": _codes_to_packed_mxfp4(unpack_half_split(tensors["w2_weight"])),
            "w13_scale": _swap_kn(tensors["w13_weight_scale"]),
            "w2_scale": _swap_kn(tensors["w2_weight_scale"]),
        }
        if "w13_bias" in tensors:
            kw["w13_bias"], kw["w2_bias"] = tensors["w13_bias"], tensors["w2_bias"]
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        if block.w13_bias is None:
            return block
        dt = DTYPES[shape.dtype]
        return dataclasses.replace(block, w13_bias=block.w13_bias.to(dt), w2_bias=block.w2_bias.to(dt))

    def layer_metadata(self, shape: LayerShape, scheme: Scheme) -> dict:
        return {"format": "mxfp4", "w13_rows": "gate_up", "packing": "half_split"}
