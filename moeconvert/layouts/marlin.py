"""``marlin``: WNA16 experts as vLLM 0.33.0's Marlin MoE kernel reads them (docs/layouts/marlin.md).

The bytes equal what vLLM holds after ``_process_weights_marlin`` (MARLIN and BATCHED_MARLIN backends,
16-bit activations), with one deliberate exception where vLLM's own choice makes its kernel compute
wrong results (the w13 scale permutation when I == group_size < H, or H == group_size < I; see
:func:`w13_scales_grouped`).
vLLM serves such a file with ``--moe-backend marlin`` (the SM90 default is Humming, spec §2).

=======================  ===================================  ======================================
tensor                   shape                                dtype
=======================  ===================================  ======================================
w13_weight               ``[E, H/16, 2Ip*bits/2]``            int32, Marlin 16x64 tiles (§3.3)
w2_weight                ``[E, Ip/16, H*bits/2]``             int32
w13_weight_scale         ``[E, G13, 2Ip]``                    model dtype (fp16/bf16), permuted cols
w2_weight_scale          ``[E, Ip/g or 1, H]``                model dtype
w13_weight_zero_point    ``[E, G13, 2Ip/8]`` (int4 asym)      int32, permuted + interleaved nibbles
w2_weight_zero_point     ``[E, Ip/g or 1, H/8]``              int32
w13_bias, w2_bias        ``[E, 2Ip]``, ``[E, H]`` (if bias)   model dtype, single-permuted
=======================  ===================================  ======================================

``Ip = round_up(I, lcm(64, g or 1))``; w13 columns are ``[gate | 0-pad | up | 0-pad]``, w2 rows
(and for g > 0 its scale rows) are zero-padded from I to Ip. Everything is K-first (the transpose
of the checkpoint). Scales and biases are cast to the model dtype exactly as vLLM's loader ``copy_``
does (round to nearest even).

Every transform is a reshape/permute of a whole chunk of experts; the view shapes are planned once
per (size_k, size_n, bits).
"""

from __future__ import annotations

import functools
import math

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError
from moeconvert.layouts import register
from moeconvert.layouts.base import (PARAMS_DTYPES, W2, W13, Layout, NotASlice, TensorSpec, TPCut,
                                     scales_and_biases_in_model_dtype)
from moeconvert.packing import LITTLE_ENDIAN, pack_int32, pair_nibbles_at, split_nibbles_at, unpack_int32
from moeconvert.schemes import Scheme, WNA16Scheme

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)  # marlin_utils.py:MARLIN_SUPPORTED_GROUP_SIZES

DEVIATION = (
    "w13 scales use the grouped permutation where vLLM 0.33.0 uses the single one (I == group_size); "
    "vLLM's choice gives wrong results"
)
DEVIATION_H_EQ_G = (
    "w13 scales use the single permutation where vLLM 0.33.0 uses the grouped one (H == group_size < I); "
    "vLLM's choice gives wrong results"
)


# ---------------------------------------------------------------------------------------------------
# sizes and the scale-permutation rule


def padded_intermediate(intermediate_size: int, group_size: int) -> int:
    """Ip: I rounded up to the Marlin thread tile, kept a multiple of the group (spec §3.2)."""
    unit = math.lcm(64, group_size if group_size > 0 else 1)
    return -(-intermediate_size // unit) * unit


def _groups(k: int, group_size: int) -> int:
    return 1 if group_size <= 0 else k // group_size


def w13_scales_grouped(hidden_size: int, group_size: int) -> bool:
    """Which permutation the kernel reads for GEMM1 scales: grouped iff there is more than one group.

    ``moe_wna16_marlin_gemm`` runs in group mode iff ``b_scales.size(1) > 1`` (here ``H/g``) and in
    one-group (channel) mode otherwise, whose epilogue reads the single layout. vLLM 0.33.0 instead
    decides with ``g < intermediate_size_per_partition`` (it passes I as ``size_k``, where the GEMM's
    K is H), which is wrong for w13 whenever ``I == g < H`` and whenever ``H == g < I``: on an H200
    its kernel then misses by a relative error of 0.3-0.5 (tests/test_layout_marlin.py, gpu). We
    follow the kernel (spec §3.4, §8).
    """
    return _groups(hidden_size, group_size) > 1


def w2_scales_grouped(intermediate_padded: int, group_size: int) -> bool:
    """GEMM2 scales: grouped iff ``Ip/g > 1``. vLLM's rule agrees here (it passes ``G2p * g``)."""
    return _groups(intermediate_padded, group_size) > 1


def vllm_w13_scales_grouped(intermediate_size: int, group_size: int) -> bool:
    """The rule vLLM 0.33.0's ``_process_weights_marlin`` applies to w13 (reproduced to detect deviations)."""
    return group_size != -1 and group_size < intermediate_size


# ---------------------------------------------------------------------------------------------------
# weights (spec §3.3)


@functools.lru_cache(maxsize=None)
def _tile_plan(size_k: int, size_n: int, bits: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """How N-first codes ``[E, size_n, size_k]`` become Marlin field order, as (view, order, inverse order).

    n = 64 nt + 16 warp + 8 hi_n + col, k = 16 kt + 8 hi_k + 2 tq + lo. Row kt of the output holds the
    16x64 tiles nt left to right; in a tile, thread t = 4 col + tq owns the words 4t + warp (int4) or
    8t + 2 warp + hi_n (int8), i.e. its mma.m16n8k16 B fragment.
    """
    view = (size_n // 64, 4, 2, 8, size_k // 16, 2, 4, 2)
    # dims of the view with experts in front: 0 E, 1 nt, 2 warp, 3 hi_n, 4 col, 5 kt, 6 hi_k, 7 tq, 8 lo
    if bits == 4:
        order = (0, 5, 1, 4, 7, 2, 8, 3, 6)  # word (nt, col, tq, warp), nibble 4 lo + 2 hi_n + hi_k
    elif bits == 8:
        order = (0, 5, 1, 4, 7, 2, 3, 8, 6)  # word (nt, col, tq, warp, hi_n), byte 2 lo + hi_k
    else:
        raise InternalError(f"Marlin repack of {bits}-bit codes")
    inverse = tuple(sorted(range(len(order)), key=order.__getitem__))
    return view, order, inverse


@functools.lru_cache(maxsize=8)
def _byte_gather(size_k: int, size_n: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Marlin tile order as one gather over source bytes, and its inverse (int32 indices, per shape).

    Source bytes: int8 codes as they are; int4 codes paired ``k`` / ``k + 8`` (the two ``hi_k`` halves of
    a 16-deep k tile, which share a byte of the output word) by :func:`pair_nibbles_at`. Output byte
    ``j`` of a row is byte ``j % 4`` of word ``j // 4`` (LSB-first packing on a little-endian host).
    """
    view, order, _ = _tile_plan(size_k, size_n, bits)
    fields = torch.arange(size_n * size_k, dtype=torch.int64).reshape(view).permute([d - 1 for d in order[1:]])
    src = fields.reshape(-1)  # source field of each output field, in output order
    if bits == 4:
        lo, hi = src[0::2], src[1::2]
        if not (torch.equal(hi, lo + 8) and bool((lo % 16 < 8).all())):
            raise InternalError("Marlin int4 tile plan: nibble pairs are not k / k+8")
        src = (lo // 16) * 8 + lo % 16  # the byte of pair_nibbles_at(codes, 8) holding field lo
    src = src.to(torch.int32)
    inverse = torch.empty_like(src)
    inverse[src.long()] = torch.arange(src.numel(), dtype=torch.int32)
    return src, inverse


def _source_bytes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    flat = codes.to(torch.uint8).reshape(codes.shape[0], -1)
    return pair_nibbles_at(flat, 8) if bits == 4 else flat


def repack_weights(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """N-first unsigned codes ``[E, size_n, size_k]`` -> Marlin words ``[E, size_k/16, size_n*bits/2]``.

    Equal to ``gptq_marlin_repack`` of the GPTQ (K-packed) form of each expert: one cached byte gather.
    """
    E, size_n, size_k = codes.shape
    if bits not in (4, 8):
        raise InternalError(f"Marlin repack of {bits}-bit codes")
    if not LITTLE_ENDIAN:  # the byte gather assumes LSB-first words are their bytes in order
        view, order, _ = _tile_plan(size_k, size_n, bits)
        fields = codes.reshape(E, *view).permute(order).reshape(E, size_k // 16, size_n * 16)
        return pack_int32(fields, bits, dim=2)
    gather, _ = _byte_gather(size_k, size_n, bits)
    # index_select, not ``[:, gather]``: the same bytes, about twice as fast on the CPU
    out = torch.index_select(_source_bytes(codes, bits).to(codes.device), 1, gather.to(codes.device))
    return out.reshape(E, size_k // 16, -1).view(torch.int32)


def unrepack_weights(words: torch.Tensor, bits: int, size_n: int, size_k: int) -> torch.Tensor:
    """Inverse of :func:`repack_weights`: Marlin words -> N-first codes ``[E, size_n, size_k]`` uint8."""
    E = words.shape[0]
    if not LITTLE_ENDIAN:
        view, order, inverse = _tile_plan(size_k, size_n, bits)
        full = (E, *view)
        fields = unpack_int32(words, bits, size_n * 16, dim=2)
        return fields.reshape(*(full[d] for d in order)).permute(inverse).reshape(E, size_n, size_k).contiguous()
    _, inverse = _byte_gather(size_k, size_n, bits)
    src = torch.index_select(words.contiguous().reshape(E, -1).view(torch.uint8), 1, inverse.to(words.device))
    if bits == 4:
        src = split_nibbles_at(src, 8)
    return src.reshape(E, size_n, size_k)


# ---------------------------------------------------------------------------------------------------
# column permutations of scales, zero points and biases (spec §3.4-3.6); each is its own inverse


def grouped_perm(x: torch.Tensor) -> torch.Tensor:
    """64-cycle (an 8x8 transpose): ``out[..., c] = in[..., 64(c//64) + 8(c%8) + (c%64)//8]``."""
    *lead, n = x.shape
    return x.reshape(*lead, n // 64, 8, 8).transpose(-1, -2).reshape(*lead, n).contiguous()


def single_perm(x: torch.Tensor) -> torch.Tensor:
    """32-cycle: ``out[..., c] = in[..., 32(c//32) + 2((c%32)//8) + [0,1,8,9,16,17,24,25][c%8]]``."""
    *lead, n = x.shape
    return x.reshape(*lead, n // 32, 4, 4, 2).transpose(-2, -3).reshape(*lead, n).contiguous()


def _interleave8(x: torch.Tensor) -> torch.Tensor:
    """Each run of 8 columns reordered by [0,2,4,6,1,3,5,7] (the dequantizer's nibble order)."""
    *lead, n = x.shape
    return x.reshape(*lead, n // 8, 4, 2).transpose(-1, -2).reshape(*lead, n).contiguous()


def _deinterleave8(x: torch.Tensor) -> torch.Tensor:
    *lead, n = x.shape
    return x.reshape(*lead, n // 8, 2, 4).transpose(-1, -2).reshape(*lead, n).contiguous()


def pack_zero_points(z: torch.Tensor) -> torch.Tensor:
    """K-first unsigned int4 zero points ``[E, G, Nn]`` -> Marlin words ``[E, G, Nn/8]``.

    Always the grouped perm ("zero-points are applied on every MMA"), then the interleave, then packed
    LSB-first: nibble t of word w holds ``z[64(w//8) + 8 [0,2,4,6,1,3,5,7][t] + w%8]``.
    """
    return pack_int32(_interleave8(grouped_perm(z)), 4, dim=2)


def unpack_zero_points(words: torch.Tensor) -> torch.Tensor:
    return grouped_perm(_deinterleave8(unpack_int32(words, 4, words.shape[2] * 8, dim=2)))


# ---------------------------------------------------------------------------------------------------
# gate | up halves


def _pad_halves(x: torch.Tensor, dim: int, size: int, padded: int) -> torch.Tensor:
    """Zero-pad each of the [gate; up] halves of ``dim`` (length 2*size) to ``padded``."""
    if padded == size:
        return x
    dim = dim % x.dim()
    shape = list(x.shape)
    halves = x.reshape(*shape[:dim], 2, size, *shape[dim + 1:])
    pad = halves.new_zeros(*shape[:dim], 2, padded - size, *shape[dim + 1:])
    return torch.cat([halves, pad], dim + 1).reshape(*shape[:dim], 2 * padded, *shape[dim + 1:])


def _unpad_halves(x: torch.Tensor, dim: int, size: int, padded: int) -> torch.Tensor:
    if padded == size:
        return x
    dim = dim % x.dim()
    shape = list(x.shape)
    halves = x.reshape(*shape[:dim], 2, padded, *shape[dim + 1:]).narrow(dim + 1, 0, size)
    return halves.reshape(*shape[:dim], 2 * size, *shape[dim + 1:]).contiguous()


def _pad_dim(x: torch.Tensor, dim: int, padded: int) -> torch.Tensor:
    if x.shape[dim] == padded:
        return x
    shape = list(x.shape)
    shape[dim] = padded - shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim)


# ---------------------------------------------------------------------------------------------------


@register
class MarlinLayout(Layout):
    name = "marlin"
    version = 1
    schemes = ("wna16",)
    runtime_kernels = ("vllm-marlin",)
    kernel = "vllm._moe_C.moe_wna16_marlin_gemm"
    made_for = {"vllm": ["0.33.0", "0.34.0"]}  # the versions whose processing the oracle tests check
    vllm_method = "MarlinWNA16Method"

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        H, I, g, bits = shape.hidden_size, shape.intermediate_size, scheme.group_size, scheme.bits
        problems = []
        if bits not in (4, 8):
            problems.append(f"bits = {bits}: Marlin MoE kernels exist for 4- and 8-bit weights only")
        if bits == 8 and not scheme.symmetric:
            problems.append(
                "8-bit weights with zero points (asymmetric) have no Marlin MoE kernel: "
                "int8 must be symmetric (uint8b128)"
            )
        if g not in SUPPORTED_GROUP_SIZES:
            problems.append(f"group_size = {g} is not supported by Marlin: it must be -1 (channelwise), 32, 64 or 128")
        if H % 128:
            problems.append(
                f"hidden_size H = {H} must be a multiple of 128 (Marlin never pads H; it is the size_k of "
                "GEMM1 and the size_n of GEMM2)"
            )
        if g > 0 and H % g:
            problems.append(f"hidden_size H = {H} must be divisible by group_size {g}")
        if g > 0 and I % g:
            problems.append(
                f"intermediate_size I = {I} (per TP partition) must be divisible by group_size {g} "
                "(scale groups may not cross the TP shard boundary)"
            )
        if I % 8:
            problems.append(
                f"intermediate_size I = {I} (per TP partition) must be a multiple of 8 (whole packed int32 "
                "words for the w2 codes and the w13 zero points)"
            )
        if shape.dtype not in PARAMS_DTYPES:
            problems.append(
                f"model dtype = {shape.dtype}: Marlin runs float16 or bfloat16 activations, and its scales "
                "must have the activation dtype"
            )
        # Ip % 64 == 0 by construction and H % 128 == 0 cover the repack tiles (size_k % 16, size_n % 64).
        return problems

    def _sizes(self, shape: LayerShape, scheme: WNA16Scheme):
        H, I, g = shape.hidden_size, shape.intermediate_size, scheme.group_size
        Ip = padded_intermediate(I, g)
        return H, I, Ip, g, _groups(H, g), _groups(Ip, g)

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        assert isinstance(scheme, WNA16Scheme)
        E = shape.num_experts
        H, _, Ip, _, G13, G2p = self._sizes(shape, scheme)
        b, dt = scheme.bits, PARAMS_DTYPES[shape.dtype]
        specs = [
            TensorSpec(W13.weight, (E, H // 16, 2 * Ip * b // 2), torch.int32),
            TensorSpec(W2.weight, (E, Ip // 16, H * b // 2), torch.int32),
            TensorSpec(W13.weight_scale, (E, G13, 2 * Ip), dt),
            TensorSpec(W2.weight_scale, (E, G2p, H), dt),
        ]
        if not scheme.symmetric:
            specs += [
                TensorSpec(W13.weight_zero_point, (E, G13, 2 * Ip // 8), torch.int32),
                TensorSpec(W2.weight_zero_point, (E, G2p, H // 8), torch.int32),
            ]
        if shape.has_bias:
            specs += [TensorSpec(W13.bias, (E, 2 * Ip), dt), TensorSpec(W2.bias, (E, H), dt)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        s = block.scheme
        self.require(shape, s)
        H, I, Ip, g, _, G2p = self._sizes(shape, s)
        if (block.hidden_size, block.intermediate_size) != (H, I):
            raise InternalError(f"block is H={block.hidden_size} I={block.intermediate_size}, layer says H={H} I={I}")
        dt = PARAMS_DTYPES[shape.dtype]
        w13_grouped, w2_grouped = w13_scales_grouped(H, g), w2_scales_grouped(Ip, g)

        out = {
            W13.weight: repack_weights(_pad_halves(block.w13, 1, I, Ip), s.bits),
            W2.weight: repack_weights(_pad_dim(block.w2, 2, Ip), s.bits),
        }
        # The loader's copy_ casts to params_dtype (RNE), before any padding or permutation (spec §3.4).
        s13 = _pad_halves(block.w13_scale.to(dt), 1, I, Ip).transpose(1, 2)
        s2 = block.w2_scale.to(dt).transpose(1, 2)
        if g > 0:
            s2 = _pad_dim(s2, 1, G2p)
        out[W13.weight_scale] = (grouped_perm if w13_grouped else single_perm)(s13)
        out[W2.weight_scale] = (grouped_perm if w2_grouped else single_perm)(s2)
        if not s.symmetric:
            z13 = _pad_halves(block.w13_zero, 1, I, Ip).transpose(1, 2)
            z2 = block.w2_zero.transpose(1, 2)
            if g > 0:
                z2 = _pad_dim(z2, 1, G2p)
            out[W13.weight_zero_point] = pack_zero_points(z13)
            out[W2.weight_zero_point] = pack_zero_points(z2)
        if block.w13_bias is not None:
            out[W13.bias] = single_perm(_pad_halves(block.w13_bias.to(dt), 1, I, Ip))
            out[W2.bias] = single_perm(block.w2_bias.to(dt))
        return out

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        return scales_and_biases_in_model_dtype(block, shape)

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical block, unpadded; scales and biases stay in the file's (model) dtype."""
        assert isinstance(scheme, WNA16Scheme)
        H, I, Ip, g, _, _ = self._sizes(shape, scheme)
        b = scheme.bits
        G2 = _groups(I, g)
        w13_grouped, w2_grouped = w13_scales_grouped(H, g), w2_scales_grouped(Ip, g)

        kw: dict[str, torch.Tensor | None] = {
            "w13": _unpad_halves(unrepack_weights(tensors[W13.weight], b, 2 * Ip, H), 1, I, Ip),
            "w2": unrepack_weights(tensors[W2.weight], b, H, Ip)[:, :, :I].contiguous(),
        }
        s13 = (grouped_perm if w13_grouped else single_perm)(tensors[W13.weight_scale])
        kw["w13_scale"] = _unpad_halves(s13.transpose(1, 2), 1, I, Ip)
        s2 = (grouped_perm if w2_grouped else single_perm)(tensors[W2.weight_scale])
        kw["w2_scale"] = s2[:, :G2].transpose(1, 2).contiguous()
        if not scheme.symmetric:
            z13 = unpack_zero_points(tensors[W13.weight_zero_point])
            kw["w13_zero"] = _unpad_halves(z13.transpose(1, 2), 1, I, Ip)
            z2 = unpack_zero_points(tensors[W2.weight_zero_point])
            kw["w2_zero"] = z2[:, :G2].transpose(1, 2).contiguous()
        if W13.bias in tensors:
            kw["w13_bias"] = _unpad_halves(single_perm(tensors[W13.bias]), 1, I, Ip)
            kw["w2_bias"] = single_perm(tensors[W2.bias])
        return ExpertBlock(scheme=scheme, **kw)

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        """A TP rank's Marlin tensors are columns (w13: N = 2Ip, as [gate; up] halves) or rows (w2: K = Ip)
        of the full ones exactly when no tile, scale group or permutation run straddles a rank boundary:
        the repack moves fields only inside 16x64 tiles (``_tile_plan``), the scale and zero-point
        permutations only inside runs of 32 or 64 columns, so cuts at multiples of 64 columns (w13) and
        of 16 rows and whole groups (w2) keep each rank's bytes, provided the rank's I needs no padding of
        its own and its w2 scales take the same permutation as the full ones (tests/test_vllm_parallel.py
        compares the cuts with ``repack --tp-size --tp-rank`` byte for byte)."""
        assert isinstance(scheme, WNA16Scheme)
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        I, Ir, g = shape.intermediate_size, rank.intermediate_size, scheme.group_size
        unit = math.lcm(64, g if g > 0 else 1)
        if tp_size > 1 and Ir % unit:
            return NotASlice(f"a TP rank's I = {Ir} is padded to {padded_intermediate(Ir, g)} for Marlin's thread tile "
                    f"(a multiple of {unit}), the full tensors pad I = {I} once: a rank's tiles are not a slice of them")
        if w2_scales_grouped(Ir, g) != w2_scales_grouped(padded_intermediate(I, g), g):
            return NotASlice(f"a TP rank holds one w2 scale group (I / {tp_size} = group_size {g}), which Marlin permutes "
                    "with its single (channel) permutation; the full tensor's groups take the grouped one")
        if shape.has_bias:
            return NotASlice("expert biases: w2's bias is added once after TP's all-reduce, which a slice does not express")
        w2_rows = TPCut(1) if g > 0 else TPCut(None)  # channelwise w2 scales are per output column (H)
        cuts = {W13.weight: TPCut(2, runs=2), W2.weight: TPCut(1), W13.weight_scale: TPCut(2, runs=2),
                W2.weight_scale: w2_rows}
        if not scheme.symmetric:
            cuts.update({W13.weight_zero_point: TPCut(2, runs=2), W2.weight_zero_point: w2_rows})
        return cuts

    def _deviation(self, shape: LayerShape, scheme: WNA16Scheme) -> str | None:
        H, I, g = shape.hidden_size, shape.intermediate_size, scheme.group_size
        ours, vllms = w13_scales_grouped(H, g), vllm_w13_scales_grouped(I, g)
        if ours == vllms:
            return None
        return DEVIATION if ours else DEVIATION_H_EQ_G

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        assert isinstance(scheme, WNA16Scheme)
        H, _, Ip, g, _, _ = self._sizes(shape, scheme)
        meta = {
            "intermediate_size_padded": Ip,
            "w13_scale_perm": "grouped" if w13_scales_grouped(H, g) else "single",
            "w2_scale_perm": "grouped" if w2_scales_grouped(Ip, g) else "single",
        }
        deviation = self._deviation(shape, scheme)
        if deviation:
            meta["deviation"] = deviation
        return meta

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        H, I, Ip, g, _, _ = self._sizes(shape, scheme)
        out = []
        deviation = self._deviation(shape, scheme)
        if deviation:
            out.append(
                f"H = {H}, I = {I}, group_size = {g}: vLLM 0.33.0's own load-time Marlin path puts the w13 "
                "scales in a layout its kernel does not read for this shape, so vLLM computes wrong results "
                "for it (measured on an H200 with vLLM's kernel: relative error 0.3-0.5 instead of 0.002); this "
                f"file deviates from vLLM's memory on purpose: {deviation.split(';')[0]}, the layout the kernel reads"
            )
        if Ip != I:
            out.append(
                f"I = {I} is padded to Ip = {Ip} for the Marlin thread tile (as vLLM does); the kernel works "
                "on the padded size"
            )
        return out
