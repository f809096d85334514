"""``plain``: the canonical block stacked per layer under vLLM's FusedMoE parameter names.

This is what vLLM 0.33.0 holds *before* any backend processing (docs/layouts/plain.md; for MXFP4 the
plain packed layout of docs/layouts/plain.md, which is also what its EMULATION backend keeps), so it is
the reference format of the runtime and the input every other layout can be derived from.

=================  ===============================  =========================================
tensor             float                            wna16 (b bits, pf = 32/b)
=================  ===============================  =========================================
w13_weight         ``[E, 2I, H]`` ckpt dtype        int32 ``[E, 2I, H/pf]``, LSB-first along K
w2_weight          ``[E, H, I]``                    int32 ``[E, H, I/pf]``
w13_weight_scale   –                                ``[E, 2I, G13]`` ckpt scale dtype
w2_weight_scale    –                                ``[E, H, G2]``
w13_weight_zero_point –                             asym: int32 ``[E, 2I/pf, G13]``, packed along N
w2_weight_zero_point  –                             asym: int32 ``[E, H/pf, G2]``
w13_bias, w2_bias  ``[E, 2I]``, ``[E, H]`` (if the model has expert bias)
=================  ===============================  =========================================

MXFP4: ``w13_weight`` uint8 ``[E, 2I, H/2]``, ``w13_weight_scale`` uint8 ``[E, 2I, H/32]`` and the same
for w2. Rows of w13 are ``[gate; up]`` in every case.
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import W2, W13, Layout, TensorSpec
from moeconvert.packing import pack_int32, unpack_int32
from moeconvert.schemes import MXFP4Scheme, Scheme, WNA16Scheme

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


@register
class PlainLayout(Layout):
    name = "plain"
    version = 1
    schemes = ("float", "wna16", "mxfp4")
    runtime_kernels = ("reference",)  # the reference decodes this layout itself
    kernel = "reference"
    pad_multiples = (32, 32)  # MXFP4 output: whole blocks only (vLLM's EMULATION rounding, §5.3)

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        H, I = shape.hidden_size, shape.intermediate_size
        problems = []
        if isinstance(scheme, WNA16Scheme):
            pf = scheme.pack_factor
            for name, k in (("hidden_size H", H), ("intermediate_size I", I)):
                if k % pf:
                    problems.append(f"{name} = {k} must be a multiple of the pack factor {pf} (whole int32 words)")
                if scheme.group_size > 0 and k % scheme.group_size:
                    problems.append(f"{name} = {k} must be divisible by group_size {scheme.group_size}")
        if isinstance(scheme, MXFP4Scheme):
            for name, k in (("hidden_size H", H), ("intermediate_size I", I)):
                if k % 32:
                    problems.append(f"{name} = {k} must be a multiple of the MXFP4 block 32")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
        specs: list[TensorSpec] = []
        if scheme.kind == "float":
            dt = torch_dtype(scheme.dtype)
            specs += [TensorSpec(W13.weight, (E, 2 * I, H), dt), TensorSpec(W2.weight, (E, H, I), dt)]
            bias_dt = dt
        elif isinstance(scheme, WNA16Scheme):
            pf, sdt = scheme.pack_factor, torch_dtype(scheme.scale_dtype)
            specs += [
                TensorSpec(W13.weight, (E, 2 * I, H // pf), torch.int32),
                TensorSpec(W2.weight, (E, H, I // pf), torch.int32),
                TensorSpec(W13.weight_scale, (E, 2 * I, scheme.groups(H)), sdt),
                TensorSpec(W2.weight_scale, (E, H, scheme.groups(I)), sdt),
            ]
            if not scheme.symmetric:
                specs += [
                    TensorSpec(W13.weight_zero_point, (E, 2 * I // pf, scheme.groups(H)), torch.int32),
                    TensorSpec(W2.weight_zero_point, (E, H // pf, scheme.groups(I)), torch.int32),
                ]
            bias_dt = torch_dtype(shape.bias_dtype or shape.dtype)
        else:
            specs += [
                TensorSpec(W13.weight, (E, 2 * I, H // 2), torch.uint8),
                TensorSpec(W2.weight, (E, H, I // 2), torch.uint8),
                TensorSpec(W13.weight_scale, (E, 2 * I, H // 32), torch.uint8),
                TensorSpec(W2.weight_scale, (E, H, I // 32), torch.uint8),
            ]
            bias_dt = torch_dtype(shape.bias_dtype or shape.dtype)
        if shape.has_bias:
            specs += [TensorSpec(W13.bias, (E, 2 * I), bias_dt), TensorSpec(W2.bias, (E, H), bias_dt)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        return self.lay_out(block)

    @staticmethod
    def lay_out(block: ExpertBlock) -> dict[str, torch.Tensor]:
        """The block's tensors as the plain layout stores them (layouts built on it, once checked)."""
        s = block.scheme
        out: dict[str, torch.Tensor] = {}
        if isinstance(s, WNA16Scheme):
            out[W13.weight] = pack_int32(block.w13, s.bits, dim=2)
            out[W2.weight] = pack_int32(block.w2, s.bits, dim=2)
            out[W13.weight_scale] = block.w13_scale
            out[W2.weight_scale] = block.w2_scale
            if not s.symmetric:
                out[W13.weight_zero_point] = pack_int32(block.w13_zero, s.bits, dim=1)
                out[W2.weight_zero_point] = pack_int32(block.w2_zero, s.bits, dim=1)
        else:
            out[W13.weight], out[W2.weight] = block.w13, block.w2
            if block.w13_scale is not None:
                out[W13.weight_scale], out[W2.weight_scale] = block.w13_scale, block.w2_scale
        if block.w13_bias is not None:
            out[W13.bias], out[W2.bias] = block.w13_bias, block.w2_bias
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        H, I = shape.hidden_size, shape.intermediate_size
        kw = {"w13_bias": tensors.get(W13.bias), "w2_bias": tensors.get(W2.bias)}
        if isinstance(scheme, WNA16Scheme):
            b = scheme.bits
            kw.update(
                w13=unpack_int32(tensors[W13.weight], b, H, dim=2),
                w2=unpack_int32(tensors[W2.weight], b, I, dim=2),
                w13_scale=tensors[W13.weight_scale],
                w2_scale=tensors[W2.weight_scale],
            )
            if not scheme.symmetric:
                kw["w13_zero"] = unpack_int32(tensors[W13.weight_zero_point], b, 2 * I, dim=1)
                kw["w2_zero"] = unpack_int32(tensors[W2.weight_zero_point], b, H, dim=1)
        else:
            kw.update(w13=tensors[W13.weight], w2=tensors[W2.weight])
            if W13.weight_scale in tensors:
                kw.update(w13_scale=tensors[W13.weight_scale], w2_scale=tensors[W2.weight_scale])
        return ExpertBlock(scheme=scheme, **kw)
