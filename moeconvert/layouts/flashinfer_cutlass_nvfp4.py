"""``flashinfer-cutlass`` for NVFP4 experts: what vLLM holds on Blackwell for a compressed-tensors
``nvfp4-pack-quantized`` W4A4 MoE layer served by FlashInfer's CUTLASS MoE kernel (docs/layouts/flashinfer-nvfp4.md,
"flashinfer-cutlass").

SM100's next FlashInfer choice after TRT-LLM and CuteDSL (``--moe-backend flashinfer_cutlass``):
``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` swaps w13 to ``[up; gate]`` (``reorder_w1w3_to_w3w1``) and
swizzles each expert's e4m3 scales 128x4 (``swizzle_blockscale``: rows padded to 128, columns to 4, with
zeros); the weights keep their rows and are not padded (vLLM refuses a gated layer whose 2I is not a multiple
of 128). The experts (``FlashInferExperts.process_weights_after_loading``) fold the activation scales into the
weights' multipliers as for TRT-LLM, and register nothing else.

==================  ===========================  ======================================================
tensor              shape                        content
==================  ===========================  ======================================================
w13_weight          ``[E, 2I, H/2]``             uint8, rows ``[up; gate]``
w13_weight_scale    ``[E, 2I, r4(H/16)]``        float8_e4m3fn, rows ``[up; gate]``, 128x4 swizzled
w2_weight           ``[E, H, I/2]``              uint8, as the checkpoint
w2_weight_scale     ``[E, r128(H), I/16]``       float8_e4m3fn, 128x4 swizzled
w13_weight_scale_2  ``[E]``                      fp32 ``g1_alphas`` (flashinfer_trtllm_nvfp4.py)
w2_weight_scale_2   ``[E]``                      fp32 ``g2_alphas``
w13_input_scale     ``[E]``                      fp32 a13 for every expert
w2_input_scale      ``[E]``                      fp32 a2 for every expert
w13_weight_global   ``[E]``                      fp32 the gate's weight multiplier (what ``decode`` reads)
w2_weight_global    ``[E]``                      fp32 w2's weight multiplier
==================  ===========================  ======================================================
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import NotASlice, TensorSpec, TPCut, round_up
from moeconvert.layouts.flashinfer_trtllm import swizzle_128x4, unswizzle_128x4
from moeconvert.layouts.flashinfer_trtllm_nvfp4 import ALPHAS, GROUP_SIZE, INPUTS, WEIGHT_GLOBALS, \
    FlashInferNVFP4Layout
from moeconvert.schemes import Scheme

ROWS_TILE, COLS_TILE = 128, 4  # swizzle_blockscale pads rows to 128 and columns to 4


def _up_first(x: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` rows -> ``[up; gate]`` (and back: the swap is its own inverse)."""
    half = x.shape[1] // 2
    return torch.cat([x[:, half:], x[:, :half]], 1)


def _scale_shape(rows: int, cols: int) -> tuple[int, int]:
    return round_up(rows, ROWS_TILE), round_up(cols, COLS_TILE)


def _swizzled(s: torch.Tensor) -> torch.Tensor:
    """``swizzle_blockscale``: zero-pad ``[E, R, C]`` to 128 rows / 4 columns, then the 128x4 swizzle."""
    E, R, C = s.shape
    Rp, Cp = _scale_shape(R, C)
    padded = torch.nn.functional.pad(s.view(torch.uint8), (0, Cp - C, 0, Rp - R))
    return swizzle_128x4(padded).reshape(E, Rp, Cp).view(torch.float8_e4m3fn)


def _unswizzled(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    Rp, Cp = _scale_shape(rows, cols)
    flat = t.contiguous().view(torch.uint8).flatten(1)
    return unswizzle_128x4(flat, Rp, Cp)[:, :rows, :cols].contiguous()


@register
class FlashInferCutlassNVFP4Layout(FlashInferNVFP4Layout):
    name = "flashinfer-cutlass"
    version = 1
    runtime_kernels = ()  # FlashInfer is not called by the runtime (yet)
    kernel = ("flashinfer.fused_moe.cutlass_fused_moe (NVFP4 weights and activations, e4m3 group-16 scales; "
              "vLLM FlashInferExperts, SM100)")
    scalars = (ALPHAS["w13"], ALPHAS["w2"], INPUTS["w13"], INPUTS["w2"], WEIGHT_GLOBALS["w13"],
               WEIGHT_GLOBALS["w2"])

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        problems = super()._check(shape, scheme)
        if (2 * shape.intermediate_size) % ROWS_TILE:
            # prepare_nvfp4_moe_layer_for_fi_or_cutlass raises NotImplementedError for a gated layer
            problems.append(f"intermediate_size I = {shape.intermediate_size} (per TP partition): 2I must be a "
                            "multiple of 128 (vLLM does not pad gate and up for FlashInfer CUTLASS NVFP4)")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
        u8, e4m3 = torch.uint8, torch.float8_e4m3fn
        return [
            TensorSpec("w13_weight", (E, 2 * I, H // 2), u8),
            TensorSpec("w13_weight_scale", (E, *_scale_shape(2 * I, H // GROUP_SIZE)), e4m3),
            TensorSpec("w2_weight", (E, H, I // 2), u8),
            TensorSpec("w2_weight_scale", (E, *_scale_shape(H, I // GROUP_SIZE)), e4m3),
        ] + [TensorSpec(name, (E,), torch.float32) for name in self.scalars]

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        return self._scan_metadata(shape, scheme, facts) | {
            "w13_rows": "up, gate", "scale_layout": "swizzled_128x4", "compute_capability": "10.x"}

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self._prepared(block, shape)
        out = {
            "w13_weight": _up_first(block.w13),
            "w13_weight_scale": _swizzled(_up_first(block.w13_scale)),
            "w2_weight": block.w2.contiguous(),
            "w2_weight_scale": _swizzled(block.w2_scale),
        }
        return out | self._scalars(block, shape)

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        H, I = shape.hidden_size, shape.intermediate_size
        s13 = _unswizzled(tensors["w13_weight_scale"], 2 * I, H // GROUP_SIZE)
        return ExpertBlock(
            scheme=scheme,
            w13=_up_first(tensors["w13_weight"]),
            w13_scale=_up_first(s13).view(torch.float8_e4m3fn),
            w2=tensors["w2_weight"].contiguous(),
            w2_scale=_unswizzled(tensors["w2_weight_scale"], H, I // GROUP_SIZE).view(torch.float8_e4m3fn),
            **self._decoded_scalars(tensors),
        )

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        return NotASlice("the scales are swizzled in tiles of 128 rows per rank, so a rank's tensors are not a "
                         "slice of the full ones")
