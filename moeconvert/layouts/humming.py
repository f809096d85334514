"""``humming``: WNA16 experts as vLLM 0.33.0 holds them after its HUMMING processing (docs/layouts/humming.md).

The bytes equal what vLLM 0.33.0 keeps for a compressed-tensors ``pack-quantized`` MoE layer on SM90
with 16-bit activations, once ``convert_to_humming_moe_kernel_format`` has run humming-kernels 0.1.19's
``convert_humming`` and ``prepare_and_transform_humming_tensors`` on each sublayer (w13, w2).

======================  ==================================  =========================================
tensor                  shape                               dtype
======================  ==================================  =========================================
w13_weight              ``[E, Hp/16, 2Ip'*bits/2]``         int32, 64x64 tiles (``weight_repack_nk``)
w2_weight               ``[E, Ip/16, Hn*bits/2]``           int32
w13_weight_scale        ``[E, G13p, N13p]``                 model dtype, K-first, 8x8-transposed cols
w2_weight_scale         ``[E, G2p, N2p]``                   model dtype
w13_zero_point          ``[E, G13p, N13p*zb/32]`` (asym)    int32, permuted like the scales, packed
w2_zero_point           ``[E, G2p, N2p*zb/32]`` (asym)      int32
w13_bias, w2_bias       ``[E, N13p]``, ``[E, N2p]``         model dtype, 32-cycle permuted
======================  ==================================  =========================================

Per sublayer, N (output rows) is padded to a multiple of 256 and K to a multiple of 128 as one block
(w13's N is ``2I``, gate and up stacked, padded once at the end). ``zb`` is 4 for int4, 8 for int8.

One choice depends on the data: a symmetric sublayer none of whose codes is 0, over all the rank's
experts, is re-encoded as sign-magnitude (humming's ``float{b}e0m{b-1}``) before packing. The layout
declares a scan (``layer_scan``: which experts of each sublayer have no 0 code) that the job runs before
encoding; the choice reaches ``encode`` and ``decode`` as ``LayerShape.extra[CHOICES]``
(``{"w13": b_dtype, "w2": b_dtype}``), and the manifest records the facts and the choice per sublayer.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.layouts import register
from moeconvert.layouts.base import (CHOICES, PARAMS_DTYPES, LayerScan, Layout, NotASlice, TensorSpec, TPCut,
                                     round_up, scales_and_biases_in_model_dtype)
from moeconvert.layouts.marlin import grouped_perm, single_perm
from moeconvert.packing import pack_int32, unpack_int32
from moeconvert.schemes import Scheme, WNA16Scheme

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
PAD_N, PAD_K = 256, 128  # vLLM's _prepare_and_transform_sublayer: pad_n_to_multiple, pad_k_to_multiple
EXTRA_KEY = CHOICES  # {"w13": b_dtype, "w2": b_dtype}
NO_ZERO = "experts_without_zero_code"
SUBLAYERS = ("w13", "w2")


@dataclasses.dataclass(frozen=True)
class SublayerNames:
    weight: str
    weight_scale: str
    zero_point: str
    bias: str

    @classmethod
    def of(cls, sub: str) -> "SublayerNames":
        # vLLM's _replace_layer_parameters names them f"{sublayer}_{humming name}"
        return cls(f"{sub}_weight", f"{sub}_weight_scale", f"{sub}_zero_point", f"{sub}_bias")


NAMES = {sub: SublayerNames.of(sub) for sub in SUBLAYERS}


def unsigned_dtype(bits: int) -> str:
    return f"uint{bits}"


def sign_magnitude_dtype(bits: int) -> str:
    return f"float{bits}e0m{bits - 1}"


def choice(bits: int, without_zero_code: bool) -> str:
    """humming's weight dtype for a symmetric sublayer: sign-magnitude exactly when no code of it is 0."""
    return sign_magnitude_dtype(bits) if without_zero_code else unsigned_dtype(bits)


class ZeroCodeScan(LayerScan):
    """Which experts of each sublayer have no 0 code: the fact humming's sign-magnitude choice reads.

    vLLM 0.33.0 (``convert_to_humming_moe_kernel_format`` -> humming's ``convert_humming`` ->
    ``convert_symmetric_integer_weight``) looks for a 0 code in one sublayer's whole weight tensor, which
    holds the rank's local experts and its TP slice: w13 and w2 decide separately, each over all the
    rank's experts. A 0 code seen settles that sublayer (unsigned); sign-magnitude needs every expert."""

    def __init__(self, bits: int, num_experts: int):
        self.bits, self.num_experts, self.seen = bits, num_experts, 0
        self.without = {sub: [] for sub in SUBLAYERS}

    def add(self, block: ExpertBlock, first_expert: int) -> None:
        for sub in SUBLAYERS:
            codes = getattr(block, sub)
            zero = (codes == 0).flatten(1).any(1)
            self.without[sub] += [first_expert + i for i in torch.nonzero(~zero).flatten().tolist()]
        self.seen += block.num_experts

    def _without_zero(self, sub: str) -> bool | None:
        """True / False once known, None while every expert seen lacks a 0 code and some are still unseen."""
        if len(self.without[sub]) < self.seen:
            return False
        return True if self.seen >= self.num_experts else None

    def settled(self) -> bool:
        return all(self._without_zero(sub) is not None for sub in SUBLAYERS)

    def choices(self) -> dict:
        if not self.settled():
            raise InternalError("humming scan: choices asked before they are settled")
        return {sub: choice(self.bits, self._without_zero(sub)) for sub in SUBLAYERS}

    def facts(self) -> dict:
        if self.seen != self.num_experts:
            raise InternalError(f"humming scan: {self.seen} of {self.num_experts} experts scanned")
        return {sub: {NO_ZERO: list(self.without[sub])} for sub in SUBLAYERS}


# ---------------------------------------------------------------------------------------------------
# codes: sign-magnitude re-encoding and the int -> float preprocessing of weight_repack_nk


def to_sign_magnitude(u: torch.Tensor, bits: int) -> torch.Tensor:
    """humming's ``convert_symmetric_integer_weight``: d = u - 2^(b-1) as |d| with the sign in the top bit."""
    mid = 1 << (bits - 1)
    u = u.to(torch.int16)
    return torch.where(u >= mid, u - mid, 2 * mid - u).to(torch.uint8)


def from_sign_magnitude(s: torch.Tensor, bits: int) -> torch.Tensor:
    mid = 1 << (bits - 1)
    s = s.to(torch.int16)
    return torch.where(s < mid, s + mid, 2 * mid - s).to(torch.uint8)


def int2fp(v: torch.Tensor, zp: torch.Tensor, bits: int) -> torch.Tensor:
    """``kShouldPreprocessForINT2FP``: ``v >= zp ? v - zp : mask - v`` (zp broadcast to v)."""
    mask = (1 << bits) - 1
    v, zp = v.to(torch.int16), zp.to(torch.int16)
    return torch.where(v >= zp, v - zp, mask - v).to(torch.uint8)


def un_int2fp(w: torch.Tensor, zp: torch.Tensor, bits: int) -> torch.Tensor:
    mask = (1 << bits) - 1
    w, zp = w.to(torch.int16), zp.to(torch.int16)
    return torch.where(w <= mask - zp, w + zp, mask - w).to(torch.uint8)


def preprocesses_int2fp(b_dtype: str, bits: int, asym: bool) -> bool:
    """transform_humming_weight with bf16/fp16 activations: only integer weights wider than 6 (asym) or
    7 (sym) bits are shifted by the kernel; sign-magnitude weights are floating point to humming."""
    return b_dtype.startswith("uint") and bits > (6 if asym else 7)


# ---------------------------------------------------------------------------------------------------
# weights: weight_repack_nk<bits, 16, packed, ...> with interleave_mode 3, as one gather per 64x64 tile


@functools.lru_cache(maxsize=4)
def _tile_gather(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source index ``64 n + k`` (inside a 64x64 tile) of each output field, in output order
    ``[i1 (4), lane (32), word (bits), field (32/bits)]``, and its inverse.

    In the kernel, lane t reads n = 8 i + t/4, k = 8 j + 2 (t%4) + kk (i < 8, j < 8, kk < 2) into
    ``tmp[j/2][i/2][i%2][j%2][kk]``; word w of output row i1 takes the 32/bits values at
    ``tmp[i1] + w * 32/bits + new(q)`` where ``new(q) = 2 (q % (16/bits)) + q / (16/bits)``.
    """
    per_word = 32 // bits
    i1 = torch.arange(4).view(4, 1, 1, 1)
    t = torch.arange(32).view(1, 32, 1, 1)
    w = torch.arange(bits).view(1, 1, bits, 1)
    q = torch.arange(per_word).view(1, 1, 1, per_word)
    half = per_word // 2
    rest = w * per_word + 2 * (q % half) + q // half  # offset inside tmp[i1]: 8 i3 + 4 i4 + 2 i5 + i6
    i3, i4, i5, i6 = rest // 8, rest // 4 % 2, rest // 2 % 2, rest % 2
    n = (2 * i3 + i4) * 8 + t // 4
    k = (2 * i1 + i5) * 8 + (t % 4) * 2 + i6
    src = (n * 64 + k).reshape(-1)
    if not torch.equal(src.sort().values, torch.arange(64 * 64)):
        raise InternalError("humming tile gather is not a permutation")
    inverse = torch.empty_like(src)
    inverse[src] = torch.arange(src.numel())
    return src, inverse


def repack_weights(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Padded N-first fields ``[E, Np, Kp]`` (already sign-magnitude / int2fp-shifted) -> humming
    words ``[E, Kp/16, Np*bits/2]``."""
    E, Np, Kp = fields.shape
    src, _ = _tile_gather(bits)
    tiles = fields.reshape(E, Np // 64, 64, Kp // 64, 64).permute(0, 3, 1, 2, 4).reshape(E, Kp // 64, Np // 64, 4096)
    out = tiles.index_select(3, src.to(fields.device)).reshape(E, Kp // 64, Np // 64, 4, 32 * bits, 32 // bits)
    out = out.permute(0, 1, 3, 2, 4, 5).reshape(E, Kp // 16, Np * bits // 2, 32 // bits)
    return pack_int32(out.to(torch.int32), bits, dim=3).reshape(E, Kp // 16, Np * bits // 2)


def unrepack_weights(words: torch.Tensor, bits: int, Np: int, Kp: int) -> torch.Tensor:
    E = words.shape[0]
    _, inverse = _tile_gather(bits)
    f = unpack_int32(words.reshape(E, Kp // 16, Np * bits // 2, 1), bits, 32 // bits, dim=3)
    f = f.reshape(E, Kp // 64, 4, Np // 64, 32 * bits * (32 // bits)).permute(0, 1, 3, 2, 4)
    f = f.reshape(E, Kp // 64, Np // 64, 4096).index_select(3, inverse.to(words.device))
    f = f.reshape(E, Kp // 64, Np // 64, 64, 64).permute(0, 2, 3, 1, 4).reshape(E, Np, Kp)
    return f.to(torch.uint8)


# ---------------------------------------------------------------------------------------------------
# zero points: transform_humming_zero_point (always the 8x8 transpose, then nibbles / bytes packed)


def pack_zero_points(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Padded unsigned zero points ``[E, Np, Gp]`` -> int32 ``[E, Gp, Np*zb/32]``."""
    z = grouped_perm(z.transpose(1, 2).contiguous()).to(torch.uint8)
    if bits <= 4:
        z = z[..., 1::2] * 16 + z[..., 0::2]
    E, Gp = z.shape[:2]
    return pack_int32(z.reshape(E, Gp, -1, 4).to(torch.int32), 8, dim=3).reshape(E, Gp, -1)


def unpack_zero_points(words: torch.Tensor, bits: int) -> torch.Tensor:
    E, Gp, W = words.shape
    b = unpack_int32(words.reshape(E, Gp, W, 1), 8, 4, dim=3).reshape(E, Gp, W * 4).to(torch.uint8)
    if bits <= 4:
        b = torch.stack([b & 15, b >> 4], -1).reshape(E, Gp, -1)
    return grouped_perm(b).transpose(1, 2).contiguous()


def _pad(x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    pad: list[int] = []
    for have, want in zip(reversed(x.shape), reversed(sizes)):
        pad += [0, want - have]
    return torch.nn.functional.pad(x, pad) if any(pad) else x


# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sublayer:
    """One sublayer's sizes: N output rows, K input columns, and their padded sizes."""

    N: int
    K: int
    Np: int
    Kp: int
    G: int
    Gp: int


def sublayers(shape: LayerShape, g: int) -> dict[str, Sublayer]:
    H, I = shape.hidden_size, shape.intermediate_size
    out = {}
    for sub, (N, K) in (("w13", (2 * I, H)), ("w2", (H, I))):
        Np, Kp = round_up(N, PAD_N), round_up(K, PAD_K)
        G, Gp = (1, 1) if g == -1 else (K // g, Kp // g)
        out[sub] = Sublayer(N, K, Np, Kp, G, Gp)
    return out


@register
class HummingLayout(Layout):
    name = "humming"
    version = 1
    schemes = ("wna16",)
    runtime_kernels = ("humming",)  # runtime/humming.py; the reference when it cannot run (and says why)
    kernel = "humming-kernels HummingGroupedExperts (vLLM 0.33.0, SM90, 16-bit activations)"
    made_for = {"vllm": ["0.33.0"], "humming-kernels": "0.1.19", "sm": "90", "activation": "16-bit (model dtype)"}
    vllm_method = "HummingWNA16Method"

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        H, I, g, bits = shape.hidden_size, shape.intermediate_size, scheme.group_size, scheme.bits
        problems = []
        if bits not in (4, 8):
            problems.append(f"bits = {bits}: the humming layout holds 4- and 8-bit weights")
        if g not in SUPPORTED_GROUP_SIZES:
            problems.append(f"group_size = {g}: the humming layout holds -1 (channelwise), 32, 64 or 128")
        if g > 0 and H % g:
            problems.append(f"hidden_size H = {H} must be divisible by group_size {g}")
        if g > 0 and I % g:
            problems.append(f"intermediate_size I = {I} (per TP partition) must be divisible by group_size {g}")
        if I % 8:
            problems.append(f"intermediate_size I = {I} (per TP partition) must be a multiple of 8 "
                            "(whole packed int32 words for the w2 codes and the w13 zero points)")
        if H % 8:
            problems.append(f"hidden_size H = {H} must be a multiple of 8 (whole packed int32 words)")
        if shape.dtype not in PARAMS_DTYPES:
            problems.append(f"model dtype = {shape.dtype}: humming's 16-bit path runs float16 or bfloat16 "
                            "activations, and the scales take the activation dtype")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        assert isinstance(scheme, WNA16Scheme)
        E, b = shape.num_experts, scheme.bits
        dt = PARAMS_DTYPES[shape.dtype]
        subs = sublayers(shape, scheme.group_size)
        specs = []
        for sub in SUBLAYERS:
            s = subs[sub]
            specs += [TensorSpec(NAMES[sub].weight, (E, s.Kp // 16, s.Np * b // 2), torch.int32),
                      TensorSpec(NAMES[sub].weight_scale, (E, s.Gp, s.Np), dt)]
        if not scheme.symmetric:
            zb = 4 if b <= 4 else 8
            specs += [TensorSpec(NAMES[sub].zero_point, (E, subs[sub].Gp, subs[sub].Np * zb // 32), torch.int32)
                      for sub in SUBLAYERS]
        if shape.has_bias:
            specs += [TensorSpec(NAMES[sub].bias, (E, subs[sub].Np), dt) for sub in SUBLAYERS]
        return specs

    # -- the data-dependent choice ---------------------------------------------------------------------

    def b_dtype(self, codes: torch.Tensor, shape: LayerShape, scheme: WNA16Scheme, sub: str) -> str:
        """The weight dtype humming gives this sublayer: uint{b}, or sign-magnitude float{b}e0m{b-1} for a
        symmetric sublayer without a 0 code over all the rank's experts (humming's
        ``convert_symmetric_integer_weight``), as the job's scan decided it."""
        if not scheme.symmetric:
            return unsigned_dtype(scheme.bits)
        given = shape.extra.get(EXTRA_KEY, {}).get(sub)
        has_zero = bool((codes == 0).any())
        if given is None:
            if has_zero:  # a 0 code here is a 0 code of the sublayer: unsigned whatever the rest holds
                return unsigned_dtype(scheme.bits)
            raise InternalError(f"{sub}: encoding a symmetric chunk without a 0 code needs the layer's scan "
                                f"(LayerShape.extra[{EXTRA_KEY!r}])")
        if has_zero and given != unsigned_dtype(scheme.bits):
            raise InternalError(f"{sub}: the layer's scan chose {given}, but this chunk has a 0 code")
        return given

    def layer_scan(self, shape: LayerShape, scheme: Scheme, expert_offset: int) -> "ZeroCodeScan | None":
        assert isinstance(scheme, WNA16Scheme)
        return ZeroCodeScan(scheme.bits, shape.num_experts) if scheme.symmetric else None

    def recorded_facts(self, metadata: object) -> object:
        if not isinstance(metadata, dict):
            return None
        return {sub: {NO_ZERO: m.get(NO_ZERO)} if isinstance(m := metadata.get(sub), dict) else None
                for sub in SUBLAYERS}

    def facts_problem(self, facts: object, shape: LayerShape, scheme: Scheme, expert_offset: int) -> str | None:
        e0, e1 = expert_offset, expert_offset + shape.num_experts
        for sub in SUBLAYERS:
            f = facts.get(sub) if isinstance(facts, dict) else None
            ids = f.get(NO_ZERO) if isinstance(f, dict) else None
            if not (isinstance(ids, list) and all(type(i) is int for i in ids)):
                return f"{sub}.{NO_ZERO}: expected a list of expert indices, found {ids!r}"
            if ids != sorted(set(ids)) or (ids and not e0 <= ids[0] <= ids[-1] < e1):
                return (f"{sub}.{NO_ZERO}: expected increasing expert indices in [{e0}, {e1}) (this layer's "
                        f"experts), found {ids}")
        return None

    def choices(self, facts: dict, shape: LayerShape, scheme: Scheme) -> dict:
        assert isinstance(scheme, WNA16Scheme)
        # the sublayer has no 0 code <=> none of the rank's experts has one (the facts list each such expert)
        return {sub: choice(scheme.bits, len(facts[sub][NO_ZERO]) == shape.num_experts) for sub in SUBLAYERS}

    # -- encode / decode --------------------------------------------------------------------------------

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        s = block.scheme
        self.require(shape, s)
        self.require_block_sizes(block, shape)
        assert isinstance(s, WNA16Scheme)
        dt, b, asym = PARAMS_DTYPES[shape.dtype], s.bits, not s.symmetric
        E = block.num_experts
        out: dict[str, torch.Tensor] = {}
        zps: dict[str, torch.Tensor] = {}
        for sub, d in sublayers(shape, s.group_size).items():
            codes = getattr(block, sub)
            b_dtype = self.b_dtype(codes, shape, s, sub)
            fields = _pad(codes, (E, d.Np, d.Kp))
            if b_dtype.startswith("float"):
                fields = _pad(to_sign_magnitude(codes, b), (E, d.Np, d.Kp))
            zp = _pad(getattr(block, f"{sub}_zero"), (E, d.Np, d.Gp)) if asym else None
            if preprocesses_int2fp(b_dtype, b, asym):
                zk = torch.full((1, 1, 1), 1 << (b - 1), dtype=torch.uint8, device=fields.device) if zp is None else \
                    zp.repeat_interleave(d.Kp // d.Gp, dim=2)
                fields = int2fp(fields, zk, b)
            out[NAMES[sub].weight] = repack_weights(fields, b)
            # the loader's copy_ casts scales to params_dtype; padding adds zero scales
            scale = _pad(getattr(block, f"{sub}_scale").to(dt), (E, d.Np, d.Gp)).transpose(1, 2).contiguous()
            out[NAMES[sub].weight_scale] = (single_perm if s.group_size == -1 else grouped_perm)(scale)
            if asym:
                zps[NAMES[sub].zero_point] = pack_zero_points(zp, b)
        out.update(zps)
        if block.w13_bias is not None:
            for sub, d in sublayers(shape, s.group_size).items():
                out[NAMES[sub].bias] = single_perm(_pad(getattr(block, f"{sub}_bias").to(dt), (E, d.Np)))
        return out

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        return scales_and_biases_in_model_dtype(block, shape)

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        assert isinstance(scheme, WNA16Scheme)
        b, asym = scheme.bits, not scheme.symmetric
        given = shape.extra.get(EXTRA_KEY, {})
        kw: dict[str, torch.Tensor] = {}
        for sub, d in sublayers(shape, scheme.group_size).items():
            b_dtype = given.get(sub, unsigned_dtype(b))
            fields = unrepack_weights(tensors[NAMES[sub].weight], b, d.Np, d.Kp)
            zp = unpack_zero_points(tensors[NAMES[sub].zero_point], b) if asym else None
            if preprocesses_int2fp(b_dtype, b, asym):
                zk = torch.full((1, 1, 1), 1 << (b - 1), dtype=torch.uint8, device=fields.device) if zp is None else \
                    zp.repeat_interleave(d.Kp // d.Gp, dim=2)
                fields = un_int2fp(fields, zk, b)
            if b_dtype.startswith("float"):
                fields = from_sign_magnitude(fields, b)
            kw[sub] = fields[:, :d.N, :d.K].contiguous()
            scale = (single_perm if scheme.group_size == -1 else grouped_perm)(tensors[NAMES[sub].weight_scale])
            kw[f"{sub}_scale"] = scale.transpose(1, 2)[:, :d.N, :d.G].contiguous()
            if asym:
                kw[f"{sub}_zero"] = zp[:, :d.N, :d.G].contiguous()
            if NAMES[sub].bias in tensors:
                kw[f"{sub}_bias"] = single_perm(tensors[NAMES[sub].bias])[:, :d.N].contiguous()
        return ExpertBlock(scheme=scheme, **kw)

    # -- what a loader needs to rebuild humming's LayerConfig --------------------------------------------

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        """humming's LayerConfig fields per sublayer; ``b_dtype`` and the experts without a 0 code (global
        indices) come from the scan's ``facts`` (symmetric; null before the data is read)."""
        assert isinstance(scheme, WNA16Scheme)
        chosen = self.choices(facts, shape, scheme) if facts is not None and scheme.symmetric else {}
        meta = {}
        for sub, d in sublayers(shape, scheme.group_size).items():
            meta[sub] = {
                "shape_n": d.Np, "shape_k": d.Kp, "pad_shape_n": d.Np - d.N, "pad_shape_k": d.Kp - d.K,
                "num_experts": shape.num_experts,
                # symmetric: the scan's choice (None before the data is read); asymmetric: always unsigned
                "b_dtype": chosen.get(sub) if scheme.symmetric else unsigned_dtype(scheme.bits),
                NO_ZERO: facts[sub][NO_ZERO] if facts is not None and scheme.symmetric else None,
                "a_dtype": "bfloat16" if shape.dtype == "bfloat16" else "float16",
                "c_dtype": "bfloat16" if shape.dtype == "bfloat16" else "float16",
                "bs_dtype": "bfloat16" if shape.dtype == "bfloat16" else "float16",
                "weight_scale_group_size": max(scheme.group_size, 0),
                "weight_scale_type": "channel" if scheme.group_size == -1 else "group",
                "has_zero_point": not scheme.symmetric,
                "has_bias": shape.has_bias,
                "sm_version": 90,
            }
        return meta

    def experts_problem(self, metadata: dict, experts: list[int]) -> str | None:
        """vLLM decides the sign-magnitude choice over a rank's own experts: an EP rank of a full folder
        whose experts all lack a 0 code in a sublayer the folder holds unsigned would choose
        sign-magnitude, and these bytes are not what it holds (the other way round cannot happen)."""
        for sub in SUBLAYERS:
            m = metadata.get(sub, {})
            without = m.get(NO_ZERO)
            if without is None or not str(m.get("b_dtype")).startswith("uint"):
                continue
            if experts and set(experts) <= set(without):
                bits = int(str(m["b_dtype"])[4:])
                return (f"{sub}: none of this rank's experts {_runs(experts)} has a 0 code, so vLLM's humming path "
                        f"makes them {sign_magnitude_dtype(bits)} (it decides over a rank's own experts), while "
                        f"this folder holds the whole layer as {m['b_dtype']}: convert for this rank "
                        "(--ep-size/--ep-rank)")
        return None

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        return NotASlice("humming pads and tiles each rank's sublayers on their own (N to 256, K to 128, 64x64 "
                         "tiles) and chooses sign-magnitude codes over each rank's own weights")

    def humming_sublayers(self, metadata: dict, scheme: Scheme, *, hidden_size: int, intermediate_size: int,
                          num_experts: int, has_bias: bool, dtype: torch.dtype, input_schemas: dict | None = None,
                          device=None) -> dict[str, "HummingSublayer"]:
        """Each sublayer's humming weight schema and ``LayerConfig`` for a folder's layer (``humming_configs``)."""
        assert isinstance(scheme, WNA16Scheme)
        return humming_configs(metadata, group_size=scheme.group_size, symmetric=scheme.symmetric,
                               hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts,
                               has_bias=has_bias, dtype=dtype, input_schemas=input_schemas, device=device)

    def vllm_state_problem(self, scheme: Scheme) -> str | None:
        """Why no vLLM 0.33.0 memory holds such a layer (None: vLLM runs humming for it)."""
        assert isinstance(scheme, WNA16Scheme)
        return vllm_state_problem(scheme.symmetric, scheme.group_size)

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        out = []
        if scheme.group_size == -1:
            out.append("channelwise weights: vLLM 0.33.0's compressed-tensors WNA16 MoE method asserts a group "
                       "strategy for every non-Marlin backend, so vLLM itself does not reach humming for them; "
                       "this file holds what humming's own transform makes")
        return out


def _runs(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    out: list[str] = []
    ids = sorted(ids)
    start = prev = ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}..{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------------
# humming's own schema and LayerConfig for a folder's layer: what a consumer of these bytes hands humming.
# The runtime's ``humming`` kernel (runtime/humming.py) and the vLLM plugin (HummingWNA16Method) both build
# theirs here, so the two never diverge. humming is imported only when they are asked for.


def vllm_state_problem(symmetric: bool, group_size: int) -> str | None:
    """Why no vLLM 0.33.0 memory holds such a humming layer (None: vLLM runs humming for it).

    vLLM's WNA16 oracle finds no humming experts for the asymmetric weight key, and its compressed-tensors
    MoE method asserts group scales for every backend but Marlin: it serves both with Marlin."""
    if symmetric and group_size != -1:
        return None
    what = "asymmetric" if not symmetric else "channelwise"
    return (f"vLLM 0.33.0 never runs humming for {what} compressed-tensors experts (it serves them with Marlin), "
            "so this humming folder has no vLLM state to match")


@dataclasses.dataclass(frozen=True)
class HummingSublayer:
    """What humming is handed for one sublayer: its weight schema and the ``LayerConfig`` its kernels run."""

    weight_schema: object  # humming.schema.HummingWeightSchema
    config: object  # humming.config.LayerConfig


#: LayerConfig fields the manifest's layout_metadata records per sublayer (``num_experts`` is left out: a
#: vLLM EP rank of a whole folder holds fewer experts than the folder, and checks that count itself)
CONFIG_FIELDS = ("shape_n", "shape_k", "pad_shape_n", "pad_shape_k", "b_dtype", "a_dtype", "c_dtype", "bs_dtype",
                 "weight_scale_group_size", "weight_scale_type", "has_zero_point", "has_bias", "sm_version")


def humming_weight_schema(metadata: dict, sub: str, *, group_size: int, symmetric: bool):
    """humming's ``HummingWeightSchema`` for a ``pack-quantized`` sublayer, as humming's
    ``CompressedTensorsWeightSchema.convert_humming`` leaves it: unsigned codes, or sign-magnitude where no
    code of the sublayer is 0 (``metadata[sub]["b_dtype"]``, chosen over the rank's experts as vLLM does)."""
    from humming import dtypes
    from humming.schema import HummingWeightSchema

    b_dtype = metadata[sub]["b_dtype"]
    if b_dtype is None:
        raise MoeConvertError(f"layout_metadata.{sub}.b_dtype is null: the folder records no weight dtype; "
                              "convert the source again with this moeconvert")
    return HummingWeightSchema(b_dtype=dtypes.DataType.from_str(b_dtype), weight_scale_group_size=max(group_size, 0),
                               has_zero_point=not symmetric)


def humming_configs(metadata: dict, *, group_size: int | None = None, symmetric: bool | None = None, hidden_size: int,
                    intermediate_size: int, num_experts: int, has_bias: bool, dtype: torch.dtype,
                    input_schemas: dict | None = None, device=None,
                    weight_schemas: dict | None = None) -> dict[str, HummingSublayer]:
    """Each sublayer's humming weight schema and ``LayerConfig`` for a layer of H ``hidden_size``, I
    ``intermediate_size`` per rank and ``num_experts`` local experts, made by humming's own
    ``prepare_layer_config`` as vLLM's ``convert_to_humming_moe_kernel_format`` calls it (w13: N = 2I, K = H;
    w2: N = H, K = I; N padded to 256, K to 128; the model ``dtype``; ``input_schemas`` per sublayer,
    None: 16-bit activations in that dtype), on ``device`` (humming reads its SM there). Every field the folder's
    ``metadata`` records must come out the same, or a one-line error names the differences: the bytes are
    made for that config only. ``weight_schemas`` (per sublayer) replaces the ``pack-quantized`` schema made
    from ``group_size`` and ``symmetric`` (MXFP4: ``layouts/humming_mxfp4.py``)."""
    from humming.transform import prepare_layer_config

    out = {}
    for sub, (n, k) in (("w13", (2 * intermediate_size, hidden_size)), ("w2", (hidden_size, intermediate_size))):
        schema = (weight_schemas[sub] if weight_schemas is not None else
                  humming_weight_schema(metadata, sub, group_size=group_size, symmetric=symmetric))
        config = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema,
                                      input_schema=(input_schemas or {}).get(sub),
                                      num_experts=num_experts, pad_n_to_multiple=PAD_N, pad_k_to_multiple=PAD_K,
                                      has_bias=has_bias, torch_dtype=dtype, device=device)
        meta = metadata[sub]
        got = {key: config_value(config, key) for key in CONFIG_FIELDS}
        differ = [f"{key} {v} here, {meta.get(key)} in the folder" for key, v in got.items() if meta.get(key) != v]
        if differ:
            raise MoeConvertError(f"{sub}: humming's LayerConfig for this layer differs from the folder's "
                                  f"({', '.join(differ)})")
        out[sub] = HummingSublayer(schema, config)
    return out


def config_value(config, key: str):
    """A ``LayerConfig`` field as the manifest writes it (dtypes and enums by name, sizes as ints)."""
    v = getattr(config, key)
    if isinstance(v, (bool, int)) or v is None:
        return v
    return str(getattr(v, "value", v))
