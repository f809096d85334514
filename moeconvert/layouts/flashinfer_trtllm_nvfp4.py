"""``flashinfer-trtllm`` for NVFP4 experts: what vLLM holds on Blackwell for a compressed-tensors
``nvfp4-pack-quantized`` W4A4 MoE layer served by FlashInfer's TRT-LLM-gen kernel (docs/layouts/flashinfer-nvfp4.md).

vLLM's NVFP4 MoE oracle (``select_nvfp4_moe_backend``) tries FLASHINFER_TRTLLM first, and on SM100 it runs.
``CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading`` then calls
``convert_to_nvfp4_moe_kernel_format`` -> ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``: w13 to ``[up; gate]``
(``reorder_w1w3_to_w3w1``), H zero-padded to 256 (``align_fp4_moe_hidden_dim_for_fi``), I to 64
(``align_fp4_moe_weights_for_fi``, each half on its own), then ``prepare_static_weights_for_trtllm_fp4_moe``:
FlashInfer's gated-activation row interleave and epilogue row shuffle, the same for the e4m3 scales, which
``nvfp4_block_scale_interleave`` then swizzles 128x4. The experts' ``process_weights_after_loading``
(``TrtLlmNvFp4ExpertsBase``) folds the activations' scale into the weights' multipliers and registers
``g1_scale_c``. The row orders and the swizzle are the MXFP4 layout's (flashinfer_trtllm_mxfp4.py).

==================  =====================  ===========================================================
tensor              shape                  content
==================  =====================  ===========================================================
w13_weight          ``[E, 2Ip, Hp/2]``     uint8, row d = padded canonical row ``trtllm_w13_rows(Ip)[d]``
w13_weight_scale    ``[E, 2Ip, Hp/16]``    float8_e4m3fn, rows as the weights, 128x4 swizzled
w2_weight           ``[E, Hp, Ip/2]``      uint8, rows shuffled
w2_weight_scale     ``[E, Hp, Ip/16]``     float8_e4m3fn, 128x4 swizzled
w13_weight_scale_2  ``[E]``                fp32 ``g1_alphas``: the gate's weight multiplier * a13
w2_weight_scale_2   ``[E]``                fp32 ``g2_alphas``: w2's weight multiplier * a2
g1_scale_c          ``[E]``                fp32 ``g1_alphas * (1 / a2)``
w13_input_scale     ``[E]``                fp32 a13 for every expert (the kernel quantizes inputs by 1 / a13)
w2_input_scale      ``[E]``                fp32 a2 for every expert
w13_weight_global   ``[E]``                fp32 the gate's weight multiplier (what ``decode`` reads)
w2_weight_global    ``[E]``                fp32 w2's weight multiplier
==================  =====================  ===========================================================

``Hp`` = H rounded up to 256, ``Ip`` = I per TP rank rounded up to 64, zero codes and zero scale bytes in
the padding. a13 / a2 are the largest activation multiplier (``1 / input_global_scale``) of the rank's
experts (gate and up for a13): vLLM's ``amax_for_moe_activation_quant``, a fact of the whole layer, which
the layout scans (:class:`InputScan`). The last two tensors are not vLLM's: the fused multipliers do not
give the weight multipliers back exactly, and verify needs them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.layouts import register
from moeconvert.layouts.base import CHOICES, PARAMS_DTYPES, LayerScan, Layout, NotASlice, TensorSpec, TPCut, round_up
from moeconvert.layouts.flashinfer_common import MADE_FOR
from moeconvert.layouts.flashinfer_trtllm import shuffle_rows, swizzle_128x4, unswizzle_128x4
from moeconvert.layouts.flashinfer_trtllm_mxfp4 import trtllm_w13_rows
from moeconvert.layouts.marlin import _pad_halves, _unpad_halves
from moeconvert.layouts.marlin_nvfp4 import _refuse_nan, _require_block
from moeconvert.schemes import NVFP4Scheme, Scheme

GROUP_SIZE = 16
HIDDEN_ALIGNMENT = 256  # trtllm_hidden_alignment (0.34.0: trtllm_nvfp4_hidden_alignment, gated, static scales)
INTERMEDIATE_ALIGNMENT = 64  # align_fp4_moe_weights_for_fi(min_alignment=64 if is_gated)
SUBLAYERS = ("w13", "w2")
#: the scalars vLLM's layer holds after processing, and the weight multipliers decode reads
ALPHAS = {"w13": "w13_weight_scale_2", "w2": "w2_weight_scale_2"}
INPUTS = {"w13": "w13_input_scale", "w2": "w2_input_scale"}
WEIGHT_GLOBALS = {"w13": "w13_weight_global", "w2": "w2_weight_global"}
G1_SCALE_C = "g1_scale_c"
#: the per-expert fp32 tensors, in file order
SCALARS = (ALPHAS["w13"], ALPHAS["w2"], G1_SCALE_C, INPUTS["w13"], INPUTS["w2"], WEIGHT_GLOBALS["w13"],
           WEIGHT_GLOBALS["w2"])
MAX_INPUT = "max_input_multiplier"  # facts: per sublayer, each expert's largest 1 / input_global_scale


def padded_sizes(hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    return round_up(hidden_size, HIDDEN_ALIGNMENT), round_up(intermediate_size, INTERMEDIATE_ALIGNMENT)


@dataclasses.dataclass(frozen=True)
class _RowPlan:
    w13: torch.Tensor  # GEMM1 row d <- padded canonical [gate; up] row w13[d]
    w13_inverse: torch.Tensor
    w2: torch.Tensor
    w2_inverse: torch.Tensor


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


@functools.lru_cache(maxsize=None)
def _row_plan(Hp: int, Ip: int) -> _RowPlan:
    # vLLM swaps to [up; gate] and FlashInfer interleaves (up j, gate j) before its shuffle: the MXFP4
    # layout's rows over the padded halves
    w13, w2 = trtllm_w13_rows(Ip), shuffle_rows(Hp)
    return _RowPlan(w13, _inverse(w13), w2, _inverse(w2))


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(1, index.to(x.device))


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def _pad_rows(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[1] == size else torch.cat([x, x.new_zeros(x.shape[0], size - x.shape[1], *x.shape[2:])], 1)


def _input_multipliers(block: ExpertBlock) -> dict[str, torch.Tensor]:
    """Each expert's largest activation multiplier per sublayer (gate and up for w13)."""
    if block.w13_input_global is None or block.w2_input_global is None:
        raise MoeConvertError(
            "NVFP4 experts without input_global_scale (a W4A16 checkpoint): vLLM runs FlashInfer TRT-LLM NVFP4 "
            "for W4A4 checkpoints only and serves these on Marlin (use --backend marlin)",
            tensor="input_global_scale of the experts' projections", expected="present (W4A4)", found="absent")
    return {"w13": block.w13_input_global.float().amax(1), "w2": block.w2_input_global.float()}


class InputScan(LayerScan):
    """The largest activation multiplier of each sublayer over the layer's experts: vLLM's a13 / a2
    (``amax_for_moe_activation_quant`` over one rank's local experts). No chunk settles it before the last."""

    def __init__(self, num_experts: int):
        self.num_experts, self.seen = num_experts, 0
        self.max: dict[str, list[float]] = {sub: [] for sub in SUBLAYERS}

    def add(self, block: ExpertBlock, first_expert: int) -> None:
        for sub, m in _input_multipliers(block).items():
            self.max[sub] += m.tolist()
        self.seen += block.num_experts

    def settled(self) -> bool:
        return self.seen >= self.num_experts

    def choices(self) -> dict:
        if not self.settled():
            raise InternalError("flashinfer-trtllm nvfp4 scan: choices asked before every expert was scanned")
        return {sub: max(self.max[sub]) for sub in SUBLAYERS}

    def facts(self) -> dict:
        if self.seen != self.num_experts:
            raise InternalError(f"flashinfer-trtllm nvfp4 scan: {self.seen} of {self.num_experts} experts scanned")
        return {sub: {MAX_INPUT: list(self.max[sub])} for sub in SUBLAYERS}


class FlashInferNVFP4Layout(Layout):
    """What the FlashInfer NVFP4 layouts share (this one and flashinfer_cutlass_nvfp4.py): the layers vLLM
    builds them for, the layer's activation scales (:class:`InputScan`) and the per-expert scalars vLLM
    folds them into. Not registered: each subclass is a layout."""

    schemes = ("nvfp4",)
    #: vLLM 0.34.0's processing gives these bytes too, with 0.7.2.post1's helpers; it pins flashinfer-python
    #: 0.7.3, which could not be checked (docs/vllm.md, "vLLM versions"), so 0.33.0 only, as the MXFP4 layouts
    made_for = MADE_FOR
    #: the per-expert fp32 tensors the layout writes after its weights and scales, in file order
    scalars: ClassVar[tuple[str, ...]] = SCALARS

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, NVFP4Scheme)
        H, I = shape.hidden_size, shape.intermediate_size
        problems = []
        if scheme.group_size != GROUP_SIZE:
            problems.append(f"NVFP4 group size = {scheme.group_size}: the kernel reads one e4m3 scale per 16 along K")
        if H % GROUP_SIZE:
            problems.append(f"hidden_size H = {H} must be a multiple of 16 (whole NVFP4 scale groups along w13's K)")
        if I % GROUP_SIZE:
            problems.append(f"intermediate_size I = {I} (per TP partition) must be a multiple of 16 (whole scale "
                            "groups along w2's K)")
        if shape.dtype not in PARAMS_DTYPES:
            problems.append(f"model dtype = {shape.dtype}: vLLM serves NVFP4 MoE layers in bfloat16 or float16")
        if shape.activation != "silu":
            problems.append(f"activation = {shape.activation}: vLLM's NVFP4 experts are loaded [gate; up] for "
                            "SiLU-and-mul; this layout knows no other row order")
        if shape.has_bias:
            problems.append("expert biases: compressed-tensors NVFP4 experts carry none, and vLLM's NVFP4 method "
                            "creates no bias parameters")
        return problems

    # -- the layer's activation scales -------------------------------------------------------------------

    def layer_scan(self, shape: LayerShape, scheme: Scheme, expert_offset: int) -> InputScan:
        return InputScan(shape.num_experts)

    def recorded_facts(self, metadata: object) -> object:
        if not isinstance(metadata, dict):
            return None
        return {sub: {MAX_INPUT: m.get(MAX_INPUT)} if isinstance(m := metadata.get(sub), dict) else None
                for sub in SUBLAYERS}

    def facts_problem(self, facts: object, shape: LayerShape, scheme: Scheme, expert_offset: int) -> str | None:
        for sub in SUBLAYERS:
            f = facts.get(sub) if isinstance(facts, dict) else None
            got = f.get(MAX_INPUT) if isinstance(f, dict) else None
            if not (isinstance(got, list) and len(got) == shape.num_experts
                    and all(type(v) is float and v > 0 and v == float(torch.tensor(v, dtype=torch.float32))
                            for v in got)):
                return (f"{sub}.{MAX_INPUT}: expected {shape.num_experts} positive fp32 values (one per expert), "
                        f"found {got!r}")
        return None

    def choices(self, facts: dict, shape: LayerShape, scheme: Scheme) -> dict:
        return {sub: max(facts[sub][MAX_INPUT]) for sub in SUBLAYERS}

    def experts_problem(self, metadata: dict, experts: list[int]) -> str | None:
        """vLLM takes a13 / a2 over a rank's own experts (without EPLB): an EP rank whose experts' largest
        multiplier is not the layer's holds other scalars."""
        for sub in SUBLAYERS:
            got = metadata.get(sub, {}).get(MAX_INPUT)
            if not isinstance(got, list) or not experts or max(experts) >= len(got):
                continue
            if max(got[e] for e in experts) != max(got):
                return (f"{sub}: vLLM scales this rank's NVFP4 activations by the largest input multiplier of its "
                        "own experts, this folder by the whole layer's: convert for this rank (--ep-size/--ep-rank)")
        return None

    def _inputs(self, shape: LayerShape) -> dict[str, float]:
        given = shape.extra.get(CHOICES)
        if given is None:
            raise InternalError(f"{self.name} nvfp4: the activation scales are a fact of the whole layer "
                                f"(LayerShape.extra[{CHOICES!r}], from its scan)")
        return given

    # -- what every FlashInfer NVFP4 encoding shares ----------------------------------------------------

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """vLLM uses the gate's weight multiplier for the up rows too, and one activation multiplier per
        sublayer, the layer's largest, for every expert."""
        a = self._inputs(shape)
        E = block.num_experts
        return dataclasses.replace(block, w13_global=block.w13_global[:, :1].expand(-1, 2).contiguous(),
                                   w13_input_global=torch.full((E, 2), a["w13"], dtype=torch.float32),
                                   w2_input_global=torch.full((E,), a["w2"], dtype=torch.float32))

    def _prepared(self, block: ExpertBlock, shape: LayerShape) -> None:
        """What ``encode`` checks before it lays out a byte."""
        self.require(shape, block.scheme)
        self.require_block_sizes(block, shape)
        _require_block(block, shape)
        _input_multipliers(block)  # refuses a W4A16 block
        for sub in SUBLAYERS:
            _refuse_nan(getattr(block, f"{sub}_scale"), sub)

    def _scalars(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        """The per-expert fp32 tensors (:attr:`scalars`). vLLM: ``a13_scale = amax(1 / w13_input_global_scale)
        .repeat(E)``, fp32; the experts' ``process_weights_after_loading`` multiplies ``w13_weight_scale_2``
        (the gate's ``1 / weight_global_scale``) by it in place (``g1_alphas``), and TRT-LLM's registers
        ``g1_scale_c = g1_alphas * a2_gscale``, ``make_nvfp4_moe_quant_config``'s ``a2_gscale = 1.0 / a2_scale``,
        every step in fp32."""
        E = block.num_experts
        a = {sub: torch.full((E,), v, dtype=torch.float32) for sub, v in self._inputs(shape).items()}
        g = {"w13": block.w13_global[:, 0].float().contiguous(), "w2": block.w2_global.float().contiguous()}
        alphas = {sub: g[sub] * a[sub] for sub in SUBLAYERS}
        values = {**{ALPHAS[sub]: alphas[sub] for sub in SUBLAYERS}, G1_SCALE_C: alphas["w13"] * (1.0 / a["w2"]),
                  **{INPUTS[sub]: a[sub] for sub in SUBLAYERS}, **{WEIGHT_GLOBALS[sub]: g[sub] for sub in SUBLAYERS}}
        return {name: values[name] for name in self.scalars}

    def _decoded_scalars(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The block's multipliers, read back from the weight multipliers and the input scales written."""
        pair = lambda t: t.float().unsqueeze(1).expand(-1, 2).contiguous()  # noqa: E731
        return {"w13_global": pair(tensors[WEIGHT_GLOBALS["w13"]]),
                "w2_global": tensors[WEIGHT_GLOBALS["w2"]].float().contiguous(),
                "w13_input_global": pair(tensors[INPUTS["w13"]]),
                "w2_input_global": tensors[INPUTS["w2"]].float().contiguous()}

    def _scan_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None) -> dict:
        chosen = self.choices(facts, shape, scheme) if facts is not None else {}
        return {sub: {"input_scale": chosen.get(sub), MAX_INPUT: facts[sub][MAX_INPUT] if facts else None}
                for sub in SUBLAYERS}


# ---------------------------------------------------------------------------------------------------


@register
class FlashInferTrtllmNVFP4Layout(FlashInferNVFP4Layout):
    name = "flashinfer-trtllm"
    version = 1
    runtime_kernels = ()  # FlashInfer is not called by the runtime (yet)
    kernel = ("flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe (NVFP4 weights and activations, "
              "e4m3 group-16 scales; vLLM TrtLlmNvFp4Experts, SM100)")

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E = shape.num_experts
        Hp, Ip = padded_sizes(shape.hidden_size, shape.intermediate_size)
        f32, u8, e4m3 = torch.float32, torch.uint8, torch.float8_e4m3fn
        return [
            TensorSpec("w13_weight", (E, 2 * Ip, Hp // 2), u8),
            TensorSpec("w13_weight_scale", (E, 2 * Ip, Hp // GROUP_SIZE), e4m3),
            TensorSpec("w2_weight", (E, Hp, Ip // 2), u8),
            TensorSpec("w2_weight_scale", (E, Hp, Ip // GROUP_SIZE), e4m3),
        ] + [TensorSpec(name, (E,), f32) for name in self.scalars]

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        Hp, Ip = padded_sizes(shape.hidden_size, shape.intermediate_size)
        return self._scan_metadata(shape, scheme, facts) | {
            "padded_hidden_size": Hp, "padded_intermediate_size": Ip, "w13_rows": "up, gate pairs, shuffled",
            "epilogue_tile_m": 128, "scale_layout": "swizzled_128x4", "compute_capability": "10.x"}

    # -- encode / decode --------------------------------------------------------------------------------

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self._prepared(block, shape)
        H, I = shape.hidden_size, shape.intermediate_size
        Hp, Ip = padded_sizes(H, I)
        rows = _row_plan(Hp, Ip)

        def w13(x: torch.Tensor, cols: int) -> torch.Tensor:
            return _rows(_pad_last(_pad_halves(x, 1, I, Ip), cols), rows.w13)

        def w2(x: torch.Tensor, cols: int) -> torch.Tensor:
            return _rows(_pad_last(_pad_rows(x, Hp), cols), rows.w2)

        def swizzled(s: torch.Tensor) -> torch.Tensor:
            return swizzle_128x4(s).reshape(s.shape).view(torch.float8_e4m3fn)

        u8 = {sub: getattr(block, f"{sub}_scale").view(torch.uint8) for sub in SUBLAYERS}
        out = {
            "w13_weight": w13(block.w13, Hp // 2),
            "w13_weight_scale": swizzled(w13(u8["w13"], Hp // GROUP_SIZE)),
            "w2_weight": w2(block.w2, Ip // 2),
            "w2_weight_scale": swizzled(w2(u8["w2"], Ip // GROUP_SIZE)),
        }
        return out | self._scalars(block, shape)

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        H, I = shape.hidden_size, shape.intermediate_size
        Hp, Ip = padded_sizes(H, I)
        rows = _row_plan(Hp, Ip)

        def scales(name: str, r: int, c: int) -> torch.Tensor:
            return unswizzle_128x4(tensors[name].contiguous().view(torch.uint8).flatten(1), r, c)

        s13 = _rows(scales("w13_weight_scale", 2 * Ip, Hp // GROUP_SIZE), rows.w13_inverse)
        s2 = _rows(scales("w2_weight_scale", Hp, Ip // GROUP_SIZE), rows.w2_inverse)
        w13 = _rows(tensors["w13_weight"], rows.w13_inverse)
        w2 = _rows(tensors["w2_weight"], rows.w2_inverse)
        return ExpertBlock(
            scheme=scheme,
            w13=_unpad_halves(w13[:, :, :H // 2].contiguous(), 1, I, Ip),
            w13_scale=_unpad_halves(s13[:, :, :H // GROUP_SIZE].contiguous(), 1, I, Ip).view(torch.float8_e4m3fn),
            w2=w2[:, :H, :I // 2].contiguous(),
            w2_scale=s2[:, :H, :I // GROUP_SIZE].contiguous().view(torch.float8_e4m3fn),
            **self._decoded_scalars(tensors),
        )

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        return NotASlice("vLLM pads each rank's I to 64 on its own and shuffles each rank's rows in blocks of 32, "
                         "so a rank's tensors are not a slice of the full ones")
