"""``marlin`` for NVFP4 experts: what vLLM 0.33.0 holds on Hopper for a compressed-tensors
``nvfp4-pack-quantized`` checkpoint served on Marlin (docs/layouts/marlin-nvfp4.md).

The bytes equal what ``CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading`` leaves with the
MARLIN backend (``convert_to_nvfp4_moe_kernel_format`` -> ``prepare_nvfp4_moe_layer_for_marlin``; 16-bit
activations, ``VLLM_MARLIN_INPUT_DTYPE`` unset). The consumer is ``moe_wna16_marlin_gemm`` with
``b_q_type = float4_e2m1f``, e4m3-coded group scales and one fp32 global scale per expert.

==================  ======================  ======================================================
tensor              shape                   dtype, content
==================  ======================  ======================================================
w13_weight          ``[E, H/16, 4Np]``      int32: the int4 GPTQ -> Marlin repack of the e2m1 codes
w2_weight           ``[E, Np/16, 2H]``      int32
w13_weight_scale    ``[E, H/16, 2Np]``      float8_e4m3fn bytes holding S0E5M3 codes of
                                            ``scale * sf * 2^7`` (K-first, 8x8-transposed in runs of 64,
                                            each run of 4 as [0, 2, 1, 3]); below 2: 0
w2_weight_scale     ``[E, Np/16, H]``       the same
w13_weight_scale_2  ``[E]``                 fp32: gate's global multiplier * 2^119 (bf16; fp16: 2^7) / sf
w2_weight_scale_2   ``[E]``                 fp32, the same
==================  ======================  ======================================================

``Np`` is I per TP rank rounded up to 64 (to 128 when H is not a multiple of 128); H is not padded.
``sf`` is a power of two chosen per sublayer over all the rank's experts (vLLM's
``_nvfp4_compute_scale_factor``: the largest that keeps the largest scale * sf <= 448; 1 for fp16
models), so the layer's bytes depend on all its experts: the layout declares a :class:`ScaleScan`.
vLLM uses the gate's global scale for w13 and ignores the up one (it warns when they differ); this
layout does the same and says so in ``expected_block``.
"""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.layouts import register
from moeconvert.layouts.base import CHOICES, PARAMS_DTYPES, W2, W13, LayerScan, Layout, NotASlice, TensorSpec, TPCut
from moeconvert.layouts.marlin import _pad_halves, _unpad_halves, grouped_perm
from moeconvert.layouts.marlin_mxfp4 import _swap_inner_pairs, repack_fp4, unrepack_fp4
from moeconvert.schemes import NVFP4Scheme, Scheme

GROUP_SIZE = 16
SUBLAYERS = ("w13", "w2")
#: the tensors vLLM's Marlin NVFP4 path holds besides w13/w2 weight and scale (its ``_scale_2`` parameters)
GLOBAL = {"w13": "w13_weight_scale_2", "w2": "w2_weight_scale_2"}
#: ``nvfp4_marlin_process_global_scale``: 2^(exponent bias of the activation dtype - fp4's - 7)
GLOBAL_FACTOR = {"bfloat16": 2.0 ** 119, "float16": 2.0 ** 7}
E4M3_MAX = 448.0
MAX_BYTES = "max_scale_byte"  # facts: per sublayer, each expert's largest positive e4m3 scale byte (0: none)


def padded_intermediate(hidden_size: int, intermediate_size: int) -> int:
    """``prepare_nvfp4_moe_layer_for_marlin``: N to 64 when K % 128 == 0, else to 128."""
    m = 64 if hidden_size % 128 == 0 else 128
    return -(-intermediate_size // m) * m


# ---------------------------------------------------------------------------------------------------
# the scale factor (``_nvfp4_compute_scale_factor``) and the S0E5M3 scale bytes (``nvfp4_marlin_process_scales``)


def scale_factor(max_scale_byte: int, dtype: str) -> int:
    """The power of two vLLM multiplies a sublayer's scales by, from its largest positive e4m3 scale byte:
    the same fp32 arithmetic as ``_nvfp4_compute_scale_factor`` (``floor(log2(448 * 2^7 / (max * 2^7)))``)."""
    if dtype == "float16" or max_scale_byte == 0:
        return 1
    top = torch.tensor([max_scale_byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 2 ** 7
    if not bool(top < E4M3_MAX * 2 ** 7):
        return 1
    return int((E4M3_MAX * 2 ** 7 / top).log2().floor().exp2().item())


def max_scale_bytes(scales: torch.Tensor) -> list[int]:
    """Each expert's largest positive (non-NaN) e4m3 scale byte, 0 when it has none: positive e4m3 values
    order like their bytes 0x01..0x7E."""
    b = scales.contiguous().view(torch.uint8).flatten(1).int()
    b = torch.where(b < 0x7F, b, 0)  # negative (sign bit) and NaN (0x7F) bytes do not count
    return b.amax(1).tolist() if b.shape[1] else [0] * b.shape[0]


def encode_scales(s: torch.Tensor, sf: int) -> torch.Tensor:
    """e4m3 ``scale`` -> the S0E5M3 byte of ``scale * sf * 2^7``: the top byte of its fp16 bits shifted left
    once (exponent and 3 mantissa bits), 0 where ``scale * sf * 2^7 < 2`` (negatives too)."""
    v = (s.float() * sf * 2 ** 7).to(torch.half)
    byte = ((v.view(torch.int16) >> 7) & 0xFF).to(torch.uint8)
    return torch.where(v >= 2, byte, 0).view(torch.float8_e4m3fn)


def decode_scales(b: torch.Tensor, sf: int) -> torch.Tensor:
    v = (b.contiguous().view(torch.uint8).to(torch.int16) << 7).view(torch.half)
    return (v.float() / (sf * 2 ** 7)).to(torch.float8_e4m3fn)


def kept_scales(s: torch.Tensor, sf: int) -> torch.Tensor:
    """What the scales are after vLLM's processing, read back: those below ``2^-6 / sf`` (and negatives) 0."""
    v = s.float() * sf * 2 ** 7
    return torch.where(v >= 2, s.view(torch.uint8), 0).view(torch.float8_e4m3fn)


def permute_scales(s_kfirst: torch.Tensor) -> torch.Tensor:
    """``marlin_permute_scales(group_size=16)`` (grouped: 16 < K) then the fp8 dequantizer's pair swap."""
    return _swap_inner_pairs(grouped_perm(s_kfirst))


def unpermute_scales(s: torch.Tensor) -> torch.Tensor:
    return grouped_perm(_swap_inner_pairs(s))


class ScaleScan(LayerScan):
    """The largest positive scale of each sublayer over the layer's experts: the fact ``sf`` reads. vLLM
    takes it over one rank's local experts and TP slice. A scale above 224 settles ``sf = 1``."""

    def __init__(self, num_experts: int, dtype: str):
        self.num_experts, self.dtype, self.seen = num_experts, dtype, 0
        self.max = {sub: [] for sub in SUBLAYERS}

    def add(self, block: ExpertBlock, first_expert: int) -> None:
        for sub in SUBLAYERS:
            self.max[sub] += max_scale_bytes(getattr(block, f"{sub}_scale"))
        self.seen += block.num_experts

    def settled(self) -> bool:
        return self.seen >= self.num_experts or all(
            scale_factor(max(self.max[sub], default=0), self.dtype) == 1 and self.max[sub] for sub in SUBLAYERS)

    def choices(self) -> dict:
        if not self.settled():
            raise InternalError("marlin nvfp4 scan: choices asked before they are settled")
        return {sub: scale_factor(max(self.max[sub], default=0), self.dtype) for sub in SUBLAYERS}

    def facts(self) -> dict:
        if self.seen != self.num_experts:
            raise InternalError(f"marlin nvfp4 scan: {self.seen} of {self.num_experts} experts scanned")
        return {sub: {MAX_BYTES: list(self.max[sub])} for sub in SUBLAYERS}


# ---------------------------------------------------------------------------------------------------


@register
class MarlinNVFP4Layout(Layout):
    name = "marlin"
    version = 1
    schemes = ("nvfp4",)
    runtime_kernels = ()
    kernel = "vllm._moe_C.moe_wna16_marlin_gemm (float4_e2m1f, S0E5M3 scales, fp32 global scale)"
    made_for = {"vllm": ["0.33.0", "0.34.0"]}  # the versions whose processing the oracle tests check
    vllm_method = "MarlinNVFP4Method"

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, NVFP4Scheme)
        H, I = shape.hidden_size, shape.intermediate_size
        problems = []
        if scheme.group_size != GROUP_SIZE:
            problems.append(f"NVFP4 group size = {scheme.group_size}: Marlin reads one e4m3 scale per 16 along K")
        if H % 64:
            problems.append(f"hidden_size H = {H} must be a multiple of 64 (vLLM's Marlin NVFP4 path asserts it; "
                            "H is never padded)")
        if I % GROUP_SIZE:
            problems.append(f"intermediate_size I = {I} (per TP partition) must be a multiple of 16 (whole scale "
                            "groups along w2's K)")
        if shape.dtype not in GLOBAL_FACTOR:
            problems.append(f"model dtype = {shape.dtype}: Marlin runs NVFP4 experts with bfloat16 or float16 "
                            "activations only")
        if shape.activation != "silu":
            problems.append(f"activation = {shape.activation}: vLLM's NVFP4 experts are loaded [gate; up] for "
                            "SiLU-and-mul; this layout knows no other row order")
        if shape.has_bias:
            problems.append("expert biases: compressed-tensors NVFP4 experts carry none, and vLLM's NVFP4 method "
                            "creates no bias parameters")
        return problems

    def _sizes(self, shape: LayerShape) -> tuple[int, int, int]:
        H, I = shape.hidden_size, shape.intermediate_size
        return H, I, padded_intermediate(H, I)

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E = shape.num_experts
        H, _, Np = self._sizes(shape)
        e4m3 = torch.float8_e4m3fn
        return [
            TensorSpec(W13.weight, (E, H // 16, 4 * Np), torch.int32),
            TensorSpec(W2.weight, (E, Np // 16, 2 * H), torch.int32),
            TensorSpec(W13.weight_scale, (E, H // GROUP_SIZE, 2 * Np), e4m3),
            TensorSpec(W2.weight_scale, (E, Np // GROUP_SIZE, H), e4m3),
            TensorSpec(GLOBAL["w13"], (E,), torch.float32),
            TensorSpec(GLOBAL["w2"], (E,), torch.float32),
        ]

    # -- the layer-wide scale factor ---------------------------------------------------------------------

    def layer_scan(self, shape: LayerShape, scheme: Scheme, expert_offset: int) -> ScaleScan:
        return ScaleScan(shape.num_experts, shape.dtype)

    def recorded_facts(self, metadata: object) -> object:
        if not isinstance(metadata, dict):
            return None
        return {sub: {MAX_BYTES: m.get(MAX_BYTES)} if isinstance(m := metadata.get(sub), dict) else None
                for sub in SUBLAYERS}

    def facts_problem(self, facts: object, shape: LayerShape, scheme: Scheme, expert_offset: int) -> str | None:
        for sub in SUBLAYERS:
            f = facts.get(sub) if isinstance(facts, dict) else None
            got = f.get(MAX_BYTES) if isinstance(f, dict) else None
            if not (isinstance(got, list) and len(got) == shape.num_experts
                    and all(type(b) is int and 0 <= b < 0x7F for b in got)):
                return (f"{sub}.{MAX_BYTES}: expected {shape.num_experts} e4m3 bytes 0..126 (one per expert), "
                        f"found {got!r}")
        return None

    def choices(self, facts: dict, shape: LayerShape, scheme: Scheme) -> dict:
        return {sub: scale_factor(max(facts[sub][MAX_BYTES], default=0), shape.dtype) for sub in SUBLAYERS}

    def _factors(self, block: ExpertBlock | None, shape: LayerShape) -> dict[str, int]:
        given = shape.extra.get(CHOICES)
        if given is not None:
            return given
        if block is not None:  # a chunk whose own largest scale already settles sf = 1 needs no scan
            scan = ScaleScan(block.num_experts + 1, shape.dtype)
            scan.add(block, 0)
            if scan.settled():
                return scan.choices()
        raise InternalError("marlin nvfp4: the scale factor of a layer whose scales are all <= 224 needs the "
                            f"layer's scan (LayerShape.extra[{CHOICES!r}])")

    def experts_problem(self, metadata: dict, experts: list[int]) -> str | None:
        """vLLM takes ``sf`` over a rank's own experts: an EP rank whose experts' largest scale gives another
        ``sf`` than the whole layer's holds other bytes."""
        for sub in SUBLAYERS:
            m = metadata.get(sub, {})
            got, dtype = m.get(MAX_BYTES), m.get("dtype", "bfloat16")
            if not isinstance(got, list) or not experts or max(experts) >= len(got):
                continue
            whole = scale_factor(max(got, default=0), dtype)
            mine = scale_factor(max(got[e] for e in experts), dtype)
            if mine != whole:
                return (f"{sub}: vLLM scales this rank's NVFP4 scales by {mine} (it decides over a rank's own "
                        f"experts), this folder by {whole} (the whole layer): convert for this rank (--ep-size/--ep-rank)")
        return None

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        chosen = self.choices(facts, shape, scheme) if facts is not None else {}
        return {sub: {"scale_factor": chosen.get(sub), MAX_BYTES: facts[sub][MAX_BYTES] if facts else None,
                      "dtype": shape.dtype} for sub in SUBLAYERS} | {
            "padded_intermediate_size": self._sizes(shape)[2]}

    # -- encode / decode --------------------------------------------------------------------------------

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        s = block.scheme
        self.require(shape, s)
        self.require_block_sizes(block, shape)
        _require_block(block, shape)
        H, I, Np = self._sizes(shape)
        sf = self._factors(block, shape)
        out = {
            W13.weight: repack_fp4(_pad_halves(block.w13, 1, I, Np)),
            W2.weight: repack_fp4(_pad_last(block.w2, Np // 2)),
        }
        u8 = {sub: getattr(block, f"{sub}_scale").view(torch.uint8) for sub in SUBLAYERS}
        for sub, scale in (("w13", _pad_halves(u8["w13"], 1, I, Np)), ("w2", _pad_last(u8["w2"], Np // GROUP_SIZE))):
            _refuse_nan(scale, sub)
            coded = encode_scales(scale.view(torch.float8_e4m3fn), sf[sub]).view(torch.uint8).transpose(1, 2)
            out[f"{sub}_weight_scale"] = permute_scales(coded).view(torch.float8_e4m3fn)
        factor = GLOBAL_FACTOR[shape.dtype]
        for sub, g in (("w13", block.w13_global[:, 0]), ("w2", block.w2_global)):
            # vLLM: nvfp4_marlin_process_global_scale, then / combined_scale_factor, in fp32
            stored = (g.float() * factor) / sf[sub]
            if not bool(torch.equal((stored * sf[sub]) / factor, g.float())):
                bad = int(torch.nonzero((stored * sf[sub]) / factor != g.float())[0])
                raise MoeConvertError("NVFP4 global scale out of range for Marlin (its fp32 product with "
                                      f"2^{int(torch.tensor(factor).log2())} / {sf[sub]} is not exact)",
                                      tensor=f"{sub} global scale of local expert {bad}",
                                      expected="a multiplier whose product stays a normal fp32",
                                      found=float(g[bad]))
            out[GLOBAL[sub]] = stored.contiguous()
        return out

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """vLLM zeroes scales below ``2^-6 / sf`` (and negative ones), and uses the gate's global scale for
        the up rows as well. Marlin runs 16-bit activations: a W4A4 checkpoint's input scales are not kept."""
        sf = self._factors(block, shape)
        g13 = block.w13_global[:, :1].expand(-1, 2).contiguous()
        return dataclasses.replace(block, w13_scale=kept_scales(block.w13_scale, sf["w13"]),
                                   w2_scale=kept_scales(block.w2_scale, sf["w2"]), w13_global=g13,
                                   w13_input_global=None, w2_input_global=None)

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        H, I, Np = self._sizes(shape)
        sf = self._factors(None, shape) if CHOICES in shape.extra else {sub: 1 for sub in SUBLAYERS}
        factor = GLOBAL_FACTOR[shape.dtype]
        scales = {sub: decode_scales(unpermute_scales(tensors[f"{sub}_weight_scale"].view(torch.uint8))
                                     .transpose(1, 2), sf[sub]).view(torch.uint8) for sub in SUBLAYERS}
        glob = {sub: (tensors[GLOBAL[sub]] * sf[sub]) / factor for sub in SUBLAYERS}
        return ExpertBlock(
            scheme=scheme,
            w13=_unpad_halves(unrepack_fp4(tensors[W13.weight], 2 * Np, H), 1, I, Np),
            w2=unrepack_fp4(tensors[W2.weight], H, Np)[:, :, :I // 2].contiguous(),
            w13_scale=_unpad_halves(scales["w13"], 1, I, Np).view(torch.float8_e4m3fn),
            w2_scale=scales["w2"][:, :, :I // GROUP_SIZE].contiguous().view(torch.float8_e4m3fn),
            w13_global=glob["w13"].unsqueeze(1).expand(-1, 2).contiguous(),
            w2_global=glob["w2"].contiguous(),
        )

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        return NotASlice("vLLM pads each rank's NVFP4 I on its own and scales each rank's scales by a factor "
                         "chosen over that rank's slice")


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], size - x.shape[-1])], -1)


def _refuse_nan(scale: torch.Tensor, sub: str) -> None:
    nan = (scale.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        e = int(torch.nonzero(nan)[0][0])
        raise MoeConvertError("NaN NVFP4 scale", tensor=f"{sub} scales of local expert {e}", expected="finite e4m3",
                              found="NaN")


def _require_block(block: ExpertBlock, shape: LayerShape) -> None:
    E, H, I = block.num_experts, shape.hidden_size, shape.intermediate_size
    want = {"w13": ((E, 2 * I, H // 2), torch.uint8), "w2": ((E, H, I // 2), torch.uint8),
            "w13_scale": ((E, 2 * I, H // GROUP_SIZE), torch.float8_e4m3fn),
            "w2_scale": ((E, H, I // GROUP_SIZE), torch.float8_e4m3fn),
            "w13_global": ((E, 2), torch.float32), "w2_global": ((E,), torch.float32)}
    for name, (dims, dtype) in want.items():
        t = getattr(block, name)
        if t is None or tuple(t.shape) != dims or t.dtype != dtype:
            found = None if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise InternalError(f"NVFP4 block {name} is {found}, the layer H={H} I={I} needs {dims} {dtype}")
