"""``emulation``: int4 WNA16 experts dequantized to bf16, as vLLM 0.33.0's EMULATION backend holds them.

vLLM's ``_process_weights_emulation_gptq`` (``oracle/int_wna16.py``, EMULATION branch of
``convert_to_wna16_moe_kernel_format``) dequantizes the int4 codes once at load time and
``Int4EmulationTritonExperts`` then runs vLLM's plain bf16 Triton MoE on them. What it keeps is the
``plain`` layout of a bfloat16 layer (docs/layouts/plain.md), so this layout *is* ``plain``'s float form
applied to the dequantized block:

=================  ==================  ==========================================================
tensor             shape               value (bfloat16)
=================  ==================  ==========================================================
w13_weight         ``[E, 2I, H]``      ``bf16((u - z) * bf16(s))`` per ``[n, k]``, rows ``[gate; up]``
w2_weight          ``[E, H, I]``       the same for down
w13_bias, w2_bias  ``[E, 2I]``, ``[E, H]`` (if the model has expert biases), the loader's bf16 values
=================  ==================  ==========================================================

``u`` is the unsigned code, ``z`` the unsigned zero point (8 when symmetric), ``s`` the scale of
``k // group_size`` after the loader's cast to the model dtype; the difference is exact and the product
is rounded once to bf16 (round to nearest even), as vLLM's bf16 tensor product does. vLLM also keeps a
one-element fp16 dummy scale and, for asymmetric checkpoints, the loaded int32 zero points on the layer;
no kernel reads them and they are not written.

``decode`` gives the dequantized (bfloat16) block, not codes: dequantization cannot be undone.
``expected_block`` computes the same from a source block, so ``verify`` still compares exactly.
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import TensorSpec, unwritten_problems
from moeconvert.layouts.plain import PlainLayout, torch_dtype
from moeconvert.layouts.triton_wna16 import expert_count_problems
from moeconvert.schemes import FloatScheme, Scheme, WNA16Scheme

#: what the file holds, whatever the checkpoint's scheme
OUTPUT_SCHEME = FloatScheme("bfloat16")


def dequantize(block: ExpertBlock, shape: LayerShape, out_dtype: torch.dtype = torch.bfloat16) -> ExpertBlock:
    """The float block vLLM's dequantization computes from a canonical WNA16 block (whole chunk at once).

    ``out_dtype`` is the dequantization's ``output_dtype``: bf16 for the EMULATION backend; ``quantize
    --format mxfp4`` passes the model dtype (docs/quantize.md, "From GPTQ, AWQ and int checkpoints").
    """
    s = block.scheme
    params_dtype = torch_dtype(shape.dtype)

    def one(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
        E, N, K = codes.shape
        G = scales.shape[2]
        z = zeros.to(torch.int16)[..., None] if zeros is not None else s.offset
        q = codes.to(torch.int16).reshape(E, N, G, K // G) - z
        # the loader casts the scales to params_dtype, the dequantization to output_dtype; one rounding of
        # the product (_unpack_and_dequant_int4_gptq / _awq: ``w.to(output_dtype) * scale.to(output_dtype)``)
        scale = scales.to(params_dtype).to(out_dtype)[..., None]
        return (q.to(out_dtype) * scale).reshape(E, N, K)

    bias = {}
    if block.w13_bias is not None:
        bias = {"w13_bias": block.w13_bias.to(params_dtype), "w2_bias": block.w2_bias.to(params_dtype)}
    return ExpertBlock(
        scheme=OUTPUT_SCHEME if out_dtype == torch.bfloat16 else FloatScheme(str(out_dtype).removeprefix("torch.")),
        w13=one(block.w13, block.w13_scale, block.w13_zero),
        w2=one(block.w2, block.w2_scale, block.w2_zero),
        **bias,
    )


@register
class EmulationLayout(PlainLayout):
    name = "emulation"
    version = 1
    schemes = ("wna16",)
    runtime_kernels = ()  # vLLM's emulation is not called by the runtime (yet)
    kernel = "vllm fused_moe_kernel, bf16 (Int4EmulationTritonExperts)"
    made_for = {"vllm": ["0.33.0", "0.34.0"]}  # the versions whose processing the oracle tests check

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        E, H, I, g = shape.num_experts, shape.hidden_size, shape.intermediate_size, scheme.group_size
        problems = []
        if scheme.bits != 4:
            problems.append(
                f"bits = {scheme.bits}: vLLM 0.33.0's WNA16 emulation dequantizes int4 only "
                "(Int4EmulationTritonExperts takes the int4 schemes)"
            )
        if g <= 0:
            problems.append(
                "channelwise scales (group_size = -1): vLLM 0.33.0 refuses them for every non-Marlin WNA16 "
                "backend (CompressedTensorsWNA16MoEMethod asserts strategy == 'group')"
            )
        else:
            if H % g:
                problems.append(f"hidden_size H = {H} must be divisible by group_size {g}")
            if I % g:
                problems.append(
                    f"intermediate_size I = {I} (per TP partition) must be divisible by group_size {g} "
                    "(scale groups may not cross the TP shard boundary)"
                )
        for name, k in (("hidden_size H", H), ("intermediate_size I (per TP partition)", I)):
            if k % 8:
                problems.append(f"{name} = {k} must be a multiple of 8: the emulation unpacks whole int32 words")
        if shape.dtype != "bfloat16":
            problems.append(
                f"model dtype = {shape.dtype}: the emulation always dequantizes to bfloat16 and vLLM's Triton "
                "MoE needs activations of the weights' dtype (tl.dot: 'Both operands must be same dtype'), so "
                "only a bfloat16 model runs"
            )
        problems += expert_count_problems(E)
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        return super().plan(shape, OUTPUT_SCHEME)

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        return self.lay_out(dequantize(block, shape))

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """The dequantized bfloat16 block (the codes are not recoverable)."""
        return super().decode(tensors, shape, OUTPUT_SCHEME)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        return dequantize(block, shape)

    def byte_problems(self, tensors: dict[str, torch.Tensor], block: ExpertBlock, shape: LayerShape) -> list[str]:
        """The bytes are ``plain``'s bfloat16 form of the dequantized block (``decode`` gives it back, not codes,
        so it cannot be encoded again): checked as that form. Which codes and scales made them is gone with
        the dequantization; only ``verify --against`` compares them with the source's."""
        return unwritten_problems(self.name, tensors, self.lay_out(block))

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        return ["weights are stored dequantized in bfloat16 (4x the int4 bytes), as vLLM's EMULATION backend "
                "holds them: a reference/debug form, not a fast one"]
