"""``triton-fast``: moeconvert's own layout for its fused-MoE Triton kernel (kernels/moe_fast.py).

Made for Hopper's MMA with the weights as the first operand, straight from registers: every thread
loads, with one 16-byte load, exactly the 32 codes of its MMA fragment, and the unpacked codes are
the operand without a shuffle or a trip through shared memory. Every projection (w13: N = 2I rows
[gate; up], K = H; w2: N = H, K = I):

=========================  ===================  ==============================================
tensor                     shape                dtype / contents
=========================  ===================  ==============================================
``*_weight`` int4, MXFP4   ``[E, N/16, 8K]``    uint8: 16 x 64 fragment atoms (:func:`pack_fragments`)
``*_weight`` int8          ``[E, N/16, 16K]``   uint8: 16 x 32 fragment atoms (:func:`pack_int8_fragments`)
``*_weight_scale``         ``[E, K/g, N]``      model dtype (WNA16), uint8 e8m0 (MXFP4, g = 32)
``*_weight_zero_point``    ``[E, K/g, N]``      uint8, one unsigned zero point a byte (asymmetric)
``*_bias``                 ``[E, N]``           model dtype (layers with expert biases)
=========================  ===================  ==============================================

4-bit formats need H and I multiples of 64 (MXFP4: padded so by ``quantize``); scales stay one row
of N per group, read as rows by the kernel. w13 keeps [gate; up] rows for every activation (gpt-oss'
swiglu included): the kernel reads gate row n and up row n + I in one program and applies the
activation there.

WNA16 codes stay unsigned (``u = q + 2^(b-1)``); symmetric layers have no zero-point tensor (the
kernel subtracts 8 / 128). Scales and biases are cast to the model dtype (round to nearest even);
MXFP4 scales stay the e8m0 bytes. WNA16 version 3 (version 2 stored int8 codes as ``[E, K, N]`` rows,
which the kernel had to reshuffle into its operand; version 1 stored 4-bit codes ``[E, K/2, N]``, input
k and k + K/2 in one byte); MXFP4 version 2.
"""

from __future__ import annotations

import dataclasses

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError
from moeconvert.layouts import register
from moeconvert.layouts.base import W2, W13, Layout, NotASlice, TensorSpec, TPCut, expert_bias_cuts
from moeconvert.schemes import Scheme, WNA16Scheme

NAME = "triton-fast"
KERNEL = "moeconvert.kernels fused_moe_fast (kernels/moe_fast.py)"
#: no engine processes these bytes: the list is the vLLM versions whose modular-experts interface the plugin's
#: ``TritonFastMethod`` (integrations/vllm/methods/triton_fast.py) was run against, where the plugin serves the folder
MADE_FOR = {"vllm": ["0.33.0", "0.34.0"]}
#: a folder written before the plugin served this layout records no ``vllm`` (same version, same bytes)
MADE_FOR_OPTIONAL = ("vllm",)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ACTIVATIONS = ("silu", "swigluoai", "situ")


# ---------------------------------------------------------------------------------------------------
# bytes


ATOM_N, ATOM_K = 16, 64  # one warp's MMA fragment rows x inputs: 32 lanes x 16 bytes
ATOM_BYTES = ATOM_N * ATOM_K // 2


def pack_fragments(codes: torch.Tensor) -> torch.Tensor:
    """Canonical unsigned 4-bit codes ``[E, N, K]`` -> fragment-ordered ``[E, N/16, 8K]`` uint8.

    Row ``a`` holds output rows 16a..16a+15 as K/64 atoms of 512 bytes. In an atom, lane ``l = 4g + t``
    owns bytes 16l..16l+15, four little-endian words: word ``kt``'s nibble ``i`` (bits 4i..4i+3) is the
    code of row ``8h + g`` and input ``16kt + 8kh + 2t + e`` with ``i = 2kh + h + 4e``, i.e. the eight
    codes of lane l's MMA fragment of one 16-input step (rows g, g + 8; inputs 2t, 2t+1, 2t+8, 2t+9)."""
    E, N, K = codes.shape
    if N % ATOM_N or K % ATOM_K:
        raise InternalError(f"fragment packing needs N % {ATOM_N} == 0 and K % {ATOM_K} == 0, got N={N} K={K}")
    c = codes.to(torch.uint8).reshape(E, N // 16, 2, 8, K // 64, 4, 2, 4, 2)  # a h g ka kt kh t e
    c = c.permute(0, 1, 4, 3, 7, 5, 8, 6, 2)  # a ka g t kt e kh h: byte (4kt + 2e + kh), nibble h
    return (c[..., 0] | (c[..., 1] << 4)).reshape(E, N // 16, K * 8).contiguous()


def unpack_fragments(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fragments`: ``[E, N/16, 8K]`` -> codes ``[E, N, K]`` uint8."""
    E, A, B = packed.shape
    K = B // 8
    b = packed.reshape(E, A, K // 64, 8, 4, 4, 2, 2)  # a ka g t kt e kh
    c = torch.stack([b & 0xF, b >> 4], dim=-1)  # ... h
    return c.permute(0, 1, 8, 3, 2, 5, 7, 4, 6).reshape(E, A * 16, K).contiguous()


ATOM8_K = 32  # int8: 16 rows x 32 inputs, the same 32 lanes x 16 bytes


def pack_int8_fragments(codes: torch.Tensor) -> torch.Tensor:
    """Canonical unsigned 8-bit codes ``[E, N, K]`` -> fragment-ordered ``[E, N/16, 16K]`` uint8.

    Row ``a`` holds output rows 16a..16a+15 as K/32 atoms of 512 bytes. In an atom, lane ``l = 4g + t``
    owns bytes 16l..16l+15: byte ``8kt + 4kh + 2h + e`` is the code of row ``8h + g`` and input
    ``16kt + 8kh + 2t + e``, i.e. the sixteen codes of lane l's MMA fragments of two 16-input steps, each
    32-bit word two fragment registers (rows g and g + 8, inputs 2t, 2t+1 or 2t+8, 2t+9)."""
    E, N, K = codes.shape
    if N % ATOM_N or K % ATOM8_K:
        raise InternalError(f"int8 fragment packing needs N % {ATOM_N} == 0 and K % {ATOM8_K} == 0, got N={N} K={K}")
    c = codes.to(torch.uint8).reshape(E, N // 16, 2, 8, K // 32, 2, 2, 4, 2)  # a h g ka kt kh t e
    return c.permute(0, 1, 4, 3, 7, 5, 6, 2, 8).reshape(E, N // 16, K * 16).contiguous()  # a ka g t kt kh h e


def unpack_int8_fragments(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int8_fragments`: ``[E, N/16, 16K]`` -> codes ``[E, N, K]`` uint8."""
    E, A, B = packed.shape
    K = B // 16
    b = packed.reshape(E, A, K // 32, 8, 4, 2, 2, 2, 2)  # a ka g t kt kh h e
    return b.permute(0, 1, 7, 3, 2, 5, 6, 4, 8).reshape(E, A * 16, K).contiguous()


def _swap_kn(t: torch.Tensor) -> torch.Tensor:
    """``[E, N, X]`` <-> ``[E, X, N]``, contiguous (its own inverse): scales, zero points."""
    return t.transpose(1, 2).contiguous()


def _packed_mxfp4_to_codes(packed: torch.Tensor) -> torch.Tensor:
    """Canonical MXFP4 ``[E, N, K/2]`` (low nibble = even k) -> codes ``[E, N, K]``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _codes_to_packed_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _tp_cuts(shape: LayerShape, rank: LayerShape | NotASlice, scheme: Scheme) -> dict[str, TPCut] | NotASlice:
    """Both registrations' TP cuts (``Layout.tp_cuts``), ``rank`` the rank's own layer (``_rank_shape``).

    Nothing is permuted across rows or atoms: w13's rows are ``[gate; up]`` halves (fragment atoms hold 16
    rows each, a rank's I / T a multiple of 64 for 4-bit weights, 32 for int8), w2's K is whole atoms (512
    bytes: 64 inputs of 4-bit weights, 32 of int8) of each 16-row atom row; scales and zero points are
    rows of K / g, so a rank holds its groups of w2 (all of w2's one channelwise row) and its columns of
    w13."""
    if isinstance(rank, NotASlice):
        return rank
    w2_groups = TPCut(None) if scheme.kind != "mxfp4" and scheme.group_size <= 0 else TPCut(1)
    cuts = {W13.weight: TPCut(1, runs=2), W2.weight: TPCut(2),
            W13.weight_scale: TPCut(2, runs=2), W2.weight_scale: w2_groups}
    if scheme.kind != "mxfp4" and not scheme.symmetric:
        cuts.update({W13.weight_zero_point: TPCut(2, runs=2), W2.weight_zero_point: w2_groups})
    if shape.has_bias:
        bias = expert_bias_cuts(shape, 2)
        if isinstance(bias, NotASlice):
            return bias
        cuts.update(bias)
    return cuts


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
    version = 3
    schemes = ("wna16",)
    runtime_kernels = ("triton",)
    kernel = KERNEL
    made_for = MADE_FOR
    made_for_optional = MADE_FOR_OPTIONAL
    vllm_method = "TritonFastMethod"

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
            atom_k = ATOM_K if b == 4 else ATOM8_K
            if b in (4, 8) and k % atom_k:
                problems.append(f"{what} = {k} must be a multiple of {atom_k} for int{b}: the weights are stored "
                                f"in {ATOM_N} x {atom_k} MMA fragment atoms")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        assert isinstance(scheme, WNA16Scheme)
        E, H, I, b = shape.num_experts, shape.hidden_size, shape.intermediate_size, scheme.bits
        dt = DTYPES[shape.dtype]
        row = 16 * b // 8  # bytes of a 16-row atom row per input: 8 (int4), 16 (int8)
        specs = [
            TensorSpec(W13.weight, (E, 2 * I // ATOM_N, row * H), torch.uint8),
            TensorSpec(W2.weight, (E, H // ATOM_N, row * I), torch.uint8),
            TensorSpec(W13.weight_scale, (E, scheme.groups(H), 2 * I), dt),
            TensorSpec(W2.weight_scale, (E, scheme.groups(I), H), dt),
        ]
        if not scheme.symmetric:
            specs += [TensorSpec(W13.weight_zero_point, (E, scheme.groups(H), 2 * I), torch.uint8),
                      TensorSpec(W2.weight_zero_point, (E, scheme.groups(I), H), torch.uint8)]
        if shape.has_bias:
            specs += [TensorSpec(W13.bias, (E, 2 * I), dt), TensorSpec(W2.bias, (E, H), dt)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        s = block.scheme
        self.require(shape, s)
        self.require_block_sizes(block, shape)
        dt = DTYPES[shape.dtype]
        weights = pack_fragments if s.bits == 4 else pack_int8_fragments
        out = {
            W13.weight: weights(block.w13),
            W2.weight: weights(block.w2),
            W13.weight_scale: _swap_kn(block.w13_scale.to(dt)),
            W2.weight_scale: _swap_kn(block.w2_scale.to(dt)),
        }
        if not s.symmetric:
            out[W13.weight_zero_point] = _swap_kn(block.w13_zero.to(torch.uint8))
            out[W2.weight_zero_point] = _swap_kn(block.w2_zero.to(torch.uint8))
        if block.w13_bias is not None:
            out[W13.bias] = block.w13_bias.to(dt).contiguous()
            out[W2.bias] = block.w2_bias.to(dt).contiguous()
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical block; scales and biases stay in the file's (model) dtype."""
        assert isinstance(scheme, WNA16Scheme)
        weights = unpack_fragments if scheme.bits == 4 else unpack_int8_fragments
        kw = {
            "w13": weights(tensors[W13.weight]),
            "w2": weights(tensors[W2.weight]),
            "w13_scale": _swap_kn(tensors[W13.weight_scale]),
            "w2_scale": _swap_kn(tensors[W2.weight_scale]),
        }
        if not scheme.symmetric:
            kw["w13_zero"] = _swap_kn(tensors[W13.weight_zero_point])
            kw["w2_zero"] = _swap_kn(tensors[W2.weight_zero_point])
        if W13.bias in tensors:
            kw["w13_bias"], kw["w2_bias"] = tensors[W13.bias], tensors[W2.bias]
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """The source block with scales and biases cast to the model dtype, as encode casts them."""
        dt = DTYPES[shape.dtype]
        cast = lambda t: None if t is None else t.to(dt)
        return dataclasses.replace(block, w13_scale=cast(block.w13_scale), w2_scale=cast(block.w2_scale),
                                   w13_bias=cast(block.w13_bias), w2_bias=cast(block.w2_bias))

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        return {"format": f"int{scheme.bits}", "w13_rows": "gate_up", "packing": "fragments"}

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        return _tp_cuts(shape, self._rank_shape(shape, scheme, tp_size), scheme)

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, WNA16Scheme)
        if scheme.scale_dtype != shape.dtype:
            return [f"checkpoint scales are {scheme.scale_dtype}; they are cast to the model dtype {shape.dtype} "
                    "(round to nearest even)"]
        return []


@register
class TritonFastMXFP4Layout(Layout):
    name = NAME
    version = 2
    schemes = ("mxfp4",)
    runtime_kernels = ("triton",)
    kernel = KERNEL
    made_for = MADE_FOR
    made_for_optional = MADE_FOR_OPTIONAL
    vllm_method = "TritonFastMethod"
    # whole fragment atoms for both GEMMs: H and I rounded up to 64 (zeros), as quantize pads
    pad_multiples = (64, 64)

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        H, I = shape.hidden_size, shape.intermediate_size
        problems = _common_problems(shape)
        for what, k in (("hidden_size H", H), ("intermediate_size I (per TP partition)", I)):
            if k % 64:
                problems.append(f"{what} = {k} must be a multiple of 64 (padded so by quantize): the weights are "
                                f"stored in {ATOM_N} x {ATOM_K} MMA fragment atoms")
        if shape.dtype not in ("bfloat16", "float32"):
            problems.append(
                f"model dtype = {shape.dtype}: MXFP4 weights are dequantized to the activation dtype, and float16 cannot "
                "hold e8m0 scales outside 2^-24..2^15; use --dtype bfloat16")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
        specs = [
            TensorSpec(W13.weight, (E, 2 * I // ATOM_N, 8 * H), torch.uint8),
            TensorSpec(W2.weight, (E, H // ATOM_N, 8 * I), torch.uint8),
            TensorSpec(W13.weight_scale, (E, H // 32, 2 * I), torch.uint8),
            TensorSpec(W2.weight_scale, (E, I // 32, H), torch.uint8),
        ]
        if shape.has_bias:
            dt = DTYPES[shape.dtype]
            specs += [TensorSpec(W13.bias, (E, 2 * I), dt), TensorSpec(W2.bias, (E, H), dt)]
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
            W13.weight: pack_fragments(_packed_mxfp4_to_codes(block.w13)),
            W2.weight: pack_fragments(_packed_mxfp4_to_codes(block.w2)),
            W13.weight_scale: _swap_kn(as_bytes(block.w13_scale)),
            W2.weight_scale: _swap_kn(as_bytes(block.w2_scale)),
        }
        if block.w13_bias is not None:
            dt = DTYPES[shape.dtype]
            out[W13.bias] = block.w13_bias.to(dt).contiguous()
            out[W2.bias] = block.w2_bias.to(dt).contiguous()
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        kw = {
            "w13": _codes_to_packed_mxfp4(unpack_fragments(tensors[W13.weight])),
            "w2": _codes_to_packed_mxfp4(unpack_fragments(tensors[W2.weight])),
            "w13_scale": _swap_kn(tensors[W13.weight_scale]),
            "w2_scale": _swap_kn(tensors[W2.weight_scale]),
        }
        if W13.bias in tensors:
            kw["w13_bias"], kw["w2_bias"] = tensors[W13.bias], tensors[W2.bias]
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        if block.w13_bias is None:
            return block
        dt = DTYPES[shape.dtype]
        return dataclasses.replace(block, w13_bias=block.w13_bias.to(dt), w2_bias=block.w2_bias.to(dt))

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        return {"format": "mxfp4", "w13_rows": "gate_up", "packing": "fragments"}

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        """As for WNA16 in groups of 32, when a rank's I needs no padding of its own (``shape`` holds the
        padded sizes, ``extra`` the real ones; ``quantize`` pads I once for the full tensors)."""
        I = shape.extra.get("intermediate_size_unpadded", shape.intermediate_size)
        if tp_size > 1 and (I % tp_size or (I // tp_size) % self.pad_multiples[1]):
            Ir = I // tp_size
            return NotASlice(f"a TP rank's I = {Ir} is padded to {-(-Ir // 64) * 64} (a multiple of 64), the full "
                             f"tensors pad I = {I} once: a rank's atoms are not a slice of them")
        return _tp_cuts(shape, self._rank_shape(shape, scheme, tp_size), scheme)
