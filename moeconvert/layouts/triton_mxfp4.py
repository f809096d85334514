"""``triton`` for MXFP4: experts as OpenAI triton_kernels' Hopper ``matmul_ogs`` reads them
(docs/layouts/triton-mxfp4.md).

The bytes equal the storage of the ``triton_kernels.tensor.Tensor`` objects vLLM 0.33.0 builds in
``_swizzle_mxfp4`` on an SM90 GPU (``HopperMXValueLayout(mx_axis=1)``, ``HopperMXScaleLayout(mx_axis=1,
num_warps=8)``, the "3.5.1" triton_kernels API generation vendored in the vLLM wheel), for backends
TRITON and TRITON_UNFUSED, as its gpt-oss MXFP4 checkpoint path produces them. Each buffer is written
contiguous; the engine holds its ``.mT`` view, so a loader takes ``.mT`` and wraps it (no data moves;
docs/layouts/triton-mxfp4.md gives the recipe, ``layer_metadata`` every number it needs).

For one GEMM weight with N output rows and K inputs (w13: N = 2Ip, K = Hp; w2: N = Hp, K = Ip),
``Kb = K/2`` packed bytes, ``N' = round_up(N, 16)``, ``Kb' = round_up(Kb, 32)``, ``N'' = round_up(N, 256)``,
``Ks4 = round_up(K/32, 4)``:

=================  =================================  ================================================
tensor             shape                              content
=================  =================================  ================================================
w13_weight         ``[E, N'/4, 4 Kb']`` uint8         32-bit words of 8 e2m1 values (value swizzle)
w2_weight          ``[E, N'/4, 4 Kb']`` uint8
w13_weight_scale   ``[E, N''/32, 32 Ks4]`` uint8      e8m0 bytes (scale swizzle)
w2_weight_scale    ``[E, N''/32, 32 Ks4]`` uint8
w13_bias, w2_bias  ``[E, 2Ip]``, ``[E, Hp]`` float32  (if the model has expert bias)
=================  =================================  ================================================

Row order of w13 (and of its scales and bias): for ``swigluoai`` (gpt-oss) the rows are interleaved,
``2j = gate_j, 2j+1 = up_j``, which the fused swiglu epilogue reads (even/odd columns) and in which the
gpt-oss checkpoint arrives; for ``silu`` they stay ``[gate; up]``, which TRITON_UNFUSED's
``silu_and_mul`` reads (the fused TRITON backend runs swigluoai only). Padding everywhere is zero: zero
codes, scale byte 0.

Every transform is a reshape/permute of a whole chunk of experts plus a table lookup for the bit
scatter; the tables are built once per device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.errors import InternalError
from moeconvert.layouts import register
from moeconvert.layouts.base import Layout, NotASlice, TensorSpec, TPCut, expert_bias_cuts
from moeconvert.schemes import Scheme

MXFP4_BLOCK = 32
TRITON_KERNELS_API = "3.5.1"  # vllm/third_party/triton_kernels; vLLM's get_triton_kernels_version()
# opt_flags_nvidia.compute_block_n: BLOCK_N = 256 only for N > 128 (else min(128, next_pow2(N))), and the
# HOPPER_SCALE branch of the matmul kernel static-asserts BLOCK_N % (2 * 8 warps * 2 * 8) == 0: seen on an H200
KERNEL_MIN_N = 128
# GEMM1's K (= H) not a multiple of 64 (the value swizzle's 32-byte K tile) gives wrong results: seen on an H200
KERNEL_K_MULTIPLE = 64
MX_AXIS = 1  # the K axis of the logical [E, K, N] weight
MMA_VERSION = 3  # HopperMXValueLayout's default, wgmma (mma_version 2 would pack 4 bytes along K)
SCALE_NUM_WARPS = 8  # _swizzle_mxfp4(num_warps=8); the matmul takes its num_warps from the scale layout
VALUE_ROW_TILE, VALUE_KBYTE_TILE = 16, 32  # N padded to 16, packed K to 32 bytes (= 64 values)
SCALE_ROW_TILE = 2 * SCALE_NUM_WARPS * 2 * 8  # 256 rows
SCALE_GROUP_MULTIPLE = 4  # vLLM pads K/32 to 0 mod 4 on SM90 (patch for issue #47303); the layout's 2 divides it

#: activation -> (w13 row order, vLLM 0.33.0 backends whose kernels read that order)
ROW_ORDERS = {
    "swigluoai": ("interleaved", ("TRITON", "TRITON_UNFUSED")),
    "silu": ("gate_up", ("TRITON_UNFUSED",)),
}

#: The bit scatter of one 32-bit word (§6.4, the same table as §6.3): a word holds four bytes
#: ("slots") b0..b3; the low 16 bits take their low nibbles, the high 16 bits their high nibbles. For
#: each slot, the bit (within a 16-bit half) of nibble bits 3 (sign), 2 (e1), 1 (e0), 0 (m).
SLOT_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 11, 10, 13))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class GemmSizes:
    """The storage sizes of one GEMM weight of N rows and K inputs."""

    n: int
    k: int

    @property
    def kb(self) -> int:
        return self.k // 2

    @property
    def n_value(self) -> int:  # N'
        return round_up(self.n, VALUE_ROW_TILE)

    @property
    def kb_value(self) -> int:  # Kb'
        return round_up(self.kb, VALUE_KBYTE_TILE)

    @property
    def groups(self) -> int:  # K/32
        return self.k // MXFP4_BLOCK

    @property
    def groups_padded(self) -> int:  # Ks4
        return round_up(self.groups, SCALE_GROUP_MULTIPLE)

    @property
    def n_scale(self) -> int:  # N''
        return round_up(self.n, SCALE_ROW_TILE)

    @property
    def value_shape(self) -> tuple[int, int]:
        return self.n_value // 4, 4 * self.kb_value

    @property
    def scale_shape(self) -> tuple[int, int]:
        return self.n_scale // 32, 32 * self.groups_padded

    def metadata(self, num_experts: int) -> dict:
        """What a loader passes to triton_kernels to rebuild the objects (docs/layouts/triton-mxfp4.md)."""
        E = num_experts
        return {
            "n": self.n,
            "k": self.k,
            "logical_shape": [E, self.k, self.n],
            "value_layout": {
                "name": "HOPPER_VALUE", "shape": [E, self.kb, self.n], "mx_axis": MX_AXIS,
                "mma_version": MMA_VERSION,
            },
            "value_storage_shape": [E, self.value_shape[1], self.value_shape[0]],
            "scale_shape": [E, self.groups_padded, self.n],
            "scale_layout": {
                "name": "HOPPER_SCALE", "shape": [E, self.groups_padded, self.n], "mx_axis": MX_AXIS,
                "num_warps": SCALE_NUM_WARPS,
            },
            "scale_storage_shape": [E, self.scale_shape[1], self.scale_shape[0]],
            "padded": {"n_value": self.n_value, "kb_value": self.kb_value, "n_scale": self.n_scale,
                       "scale_groups": self.groups_padded},
        }


def _pad2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad the last two dims of ``[E, r, c]`` to ``[E, rows, cols]``."""
    if x.shape[1:] == (rows, cols):
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, cols - x.shape[2], 0, rows - x.shape[1]))


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


# ---------------------------------------------------------------------------------------------------
# the bit scatter inside a word


@functools.lru_cache(maxsize=None)
def _slot_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 ``[4, 16]``: the 16-bit half a nibble sets from each slot, int64 ``[65536]``: the four
    nibbles, slot j at bits 4j, that a half holds)."""
    code = torch.arange(16)
    halves = torch.stack([
        sum(((code >> (3 - i)) & 1) << pos for i, pos in enumerate(bits)) for bits in SLOT_BITS
    ])
    v = torch.arange(1 << 16)
    nibbles = [(v >> (4 * j)) & 15 for j in range(4)]
    half = halves[0][nibbles[0]] | halves[1][nibbles[1]] | halves[2][nibbles[2]] | halves[3][nibbles[3]]
    inverse = torch.empty(1 << 16, dtype=torch.int64)
    inverse[half] = v
    if not torch.equal(torch.sort(half).values, v):
        raise InternalError("the Hopper value bit table is not a bijection")
    return halves.to(device), inverse.to(device)


def scatter_bits(slots: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4]`` (bytes b0..b3 of each word) -> uint8 ``[..., 4]``, the word little-endian."""
    halves, _ = _slot_tables(slots.device)
    which = torch.arange(4, device=slots.device)
    low = halves[which, (slots & 15).long()].sum(-1)  # disjoint bits: the sum is the OR
    high = halves[which, (slots >> 4).long()].sum(-1)
    return torch.stack([low & 0xFF, low >> 8, high & 0xFF, high >> 8], -1).to(torch.uint8)


def gather_bits(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`scatter_bits`."""
    _, inverse = _slot_tables(words.device)
    w = words.long()
    low = inverse[w[..., 0] | (w[..., 1] << 8)]
    high = inverse[w[..., 2] | (w[..., 3] << 8)]
    shift = 4 * torch.arange(4, device=words.device)
    lo = (low.unsqueeze(-1) >> shift) & 15
    hi = (high.unsqueeze(-1) >> shift) & 15
    return (lo | (hi << 4)).to(torch.uint8)


# ---------------------------------------------------------------------------------------------------
# value swizzle (§6.4 "Values")

# D [E, N', Kb'] viewed with n = 16 R0 + 8 w0 + 2 c0 + s0 and kb = 32 R1 + 8 a1 + 4 w1 + c1:
# dims 0 E, 1 R0, 2 w0, 3 c0, 4 s0, 5 R1, 6 a1, 7 w1, 8 c1. Word (row, q) has row = 4 R0 + c0 and
# q = 32 R1 + 16 s0 + 4 c1 + a1; its slot 2 w1 + w0 holds D[n, kb] (so its four bytes are
# D[n, kb], D[n+8, kb], D[n, kb+4], D[n+8, kb+4]).
_VALUE_ORDER = (0, 1, 3, 5, 4, 8, 6, 7, 2)  # E R0 c0 | R1 s0 c1 a1 | w1 w0
_VALUE_INVERSE = _inverse(_VALUE_ORDER)


def _value_view(E: int, s: GemmSizes) -> tuple[int, ...]:
    return (E, s.n_value // 16, 2, 4, 2, s.kb_value // 32, 4, 2, 4)


def swizzle_values(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed e2m1 ``[E, N, K/2]`` -> the contiguous value buffer ``[E, N'/4, 4 Kb']``."""
    E, n, kb = packed.shape
    s = GemmSizes(n, 2 * kb)
    d = _pad2(packed, s.n_value, s.kb_value)
    slots = d.view(_value_view(E, s)).permute(_VALUE_ORDER).reshape(E, s.n_value // 4, s.kb_value, 4)
    return scatter_bits(slots).view(E, *s.value_shape)


def unswizzle_values(buf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_values`, storage padding dropped: ``[E, N, K/2]``."""
    E, s = buf.shape[0], GemmSizes(n, k)
    view = _value_view(E, s)
    slots = gather_bits(buf.reshape(E, s.value_shape[0], s.kb_value, 4))
    d = slots.reshape(*(view[i] for i in _VALUE_ORDER)).permute(_VALUE_INVERSE).reshape(E, s.n_value, s.kb_value)
    return d[:, :n, :s.kb].contiguous()


# ---------------------------------------------------------------------------------------------------
# scale swizzle (§6.4 "Scales")

# S [E, N'', Ks4] viewed with m = 256 d0 + 128 d1 + 16 d2 + 8 d3 + d4 and k = 2 d5 + d6 (d2 runs over
# the 8 warps): dims 0 E, 1 d0, 2 d1, 3 d2, 4 d3, 5 d4, 6 d5, 7 d6. Out row 8 d0 + d2, column
# 64 d5 + 32 d1 + 4 d4 + 2 d6 + d3.
_SCALE_ORDER = (0, 1, 3, 6, 2, 5, 7, 4)  # E d0 d2 | d5 d1 d4 d6 d3
_SCALE_INVERSE = _inverse(_SCALE_ORDER)


def _scale_view(E: int, s: GemmSizes) -> tuple[int, ...]:
    return (E, s.n_scale // SCALE_ROW_TILE, 2, SCALE_NUM_WARPS, 2, 8, s.groups_padded // 2, 2)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Canonical e8m0 ``[E, N, K/32]`` -> the contiguous scale buffer ``[E, N''/32, 32 Ks4]``."""
    E, n, g = scales.shape
    s = GemmSizes(n, MXFP4_BLOCK * g)
    d = _pad2(scales, s.n_scale, s.groups_padded)
    return d.view(_scale_view(E, s)).permute(_SCALE_ORDER).reshape(E, *s.scale_shape)


def unswizzle_scales(buf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`, padding dropped: ``[E, N, K/32]``."""
    E, s = buf.shape[0], GemmSizes(n, k)
    view = _scale_view(E, s)
    d = buf.reshape(*(view[i] for i in _SCALE_ORDER)).permute(_SCALE_INVERSE).reshape(E, s.n_scale, s.groups_padded)
    return d[:, :n, :s.groups].contiguous()


# ---------------------------------------------------------------------------------------------------
# gate / up rows


def interleave_gate_up(x: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` as ``[gate; up]`` -> rows ``2j = gate_j, 2j+1 = up_j``."""
    E, two_i, *rest = x.shape
    return x.reshape(E, 2, two_i // 2, *rest).transpose(1, 2).reshape(E, two_i, *rest).contiguous()


def deinterleave_gate_up(x: torch.Tensor) -> torch.Tensor:
    E, two_i, *rest = x.shape
    return x.reshape(E, two_i // 2, 2, *rest).transpose(1, 2).reshape(E, two_i, *rest).contiguous()


# ---------------------------------------------------------------------------------------------------


@register
class TritonMXFP4Layout(Layout):
    name = "triton"
    version = 1
    schemes = ("mxfp4",)
    # not the runtime's ``triton`` (moeconvert's own kernels read other bytes); triton_kernels' matmul_ogs is
    # not called by the runtime (yet)
    runtime_kernels = ()
    kernel = "triton_kernels.matmul_ogs (HopperMXValueLayout / HopperMXScaleLayout), vLLM TRITON / TRITON_UNFUSED"
    made_for = {"vllm": ["0.33.0", "0.34.0"], "triton_kernels": f"{TRITON_KERNELS_API} API (vendored in vLLM 0.33.0)"}
    vllm_method = "TritonMXFP4Method"
    # vLLM's round-up for TRITON (mxfp4_round_up_hidden_size_and_intermediate_size, generic branch):
    # I to 64, H unchanged; H must then be whole MXFP4 blocks already, which _check demands (§5.3, §8).
    pad_multiples = (1, 64)

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        H, I = shape.hidden_size, shape.intermediate_size
        problems = []
        if H % MXFP4_BLOCK:
            problems.append(
                f"hidden_size H = {H} must be a multiple of the MXFP4 block 32: vLLM's TRITON backends do not pad "
                "H (its online MXFP4 method refuses such a layer)"
            )
        if I % 64:
            problems.append(
                f"intermediate_size per TP rank = {I} must be a multiple of 64, the size vLLM rounds it up to for "
                "its TRITON backends"
            )
        if shape.activation not in ROW_ORDERS:
            problems.append(
                f"activation '{shape.activation}' has no triton_kernels MoE in vLLM 0.33.0 for this layout: it "
                "takes swigluoai (TRITON, TRITON_UNFUSED) or silu (TRITON_UNFUSED)"
            )
        if H % MXFP4_BLOCK == 0 and H % KERNEL_K_MULTIPLE:
            problems.append(
                f"hidden_size H = {H} must be a multiple of {KERNEL_K_MULTIPLE}: triton_kernels' matmul_ogs computes "
                "GEMM1 (K = H) wrong otherwise (seen on an H200: relative error 0.34 at H = 160, 0.002 at "
                "H = 2880), and vLLM's TRITON backends do not pad H"
            )
        for what, n in (("w13 rows 2*I", 2 * I), ("w2 rows H", H)):
            if n <= KERNEL_MIN_N:
                problems.append(
                    f"{what} = {n} must exceed {KERNEL_MIN_N}: triton_kernels' matmul_ogs takes BLOCK_N = 256 only "
                    f"for N > {KERNEL_MIN_N}, and with the 8-warp Hopper scale swizzle it asserts BLOCK_N % 256 == 0 "
                    "(it fails to compile for such a layer, in vLLM too)"
                )
        if shape.num_experts < 1:
            problems.append(f"num_experts = {shape.num_experts}: the layer must hold at least one expert")
        return problems

    @staticmethod
    def _gemms(shape: LayerShape) -> tuple[GemmSizes, GemmSizes]:
        H, I = shape.hidden_size, shape.intermediate_size
        return GemmSizes(2 * I, H), GemmSizes(H, I)

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E = shape.num_experts
        g13, g2 = self._gemms(shape)
        specs = [
            TensorSpec("w13_weight", (E, *g13.value_shape), torch.uint8),
            TensorSpec("w2_weight", (E, *g2.value_shape), torch.uint8),
            TensorSpec("w13_weight_scale", (E, *g13.scale_shape), torch.uint8),
            TensorSpec("w2_weight_scale", (E, *g2.scale_shape), torch.uint8),
        ]
        if shape.has_bias:
            specs += [TensorSpec("w13_bias", (E, g13.n), torch.float32),
                      TensorSpec("w2_bias", (E, g2.n), torch.float32)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        H, I = shape.hidden_size, shape.intermediate_size
        if (block.hidden_size, block.intermediate_size) != (H, I) or block.w13_scale is None:
            raise InternalError(f"block is H={block.hidden_size} I={block.intermediate_size}, layer says H={H} I={I}")
        rows = self._rows(shape)
        out = {
            "w13_weight": swizzle_values(rows(block.w13)),
            "w2_weight": swizzle_values(block.w2),
            "w13_weight_scale": swizzle_scales(rows(block.w13_scale)),
            "w2_weight_scale": swizzle_scales(block.w2_scale),
        }
        if block.w13_bias is not None:
            # vLLM casts the (model-dtype) bias parameters to fp32 for triton_kernels; exact.
            out["w13_bias"] = rows(block.w13_bias.to(torch.float32))
            out["w2_bias"] = block.w2_bias.to(torch.float32).contiguous()
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical block (rows ``[gate; up]``, storage padding dropped); biases stay fp32."""
        g13, g2 = self._gemms(shape)
        rows = self._unrows(shape)
        kw: dict[str, torch.Tensor | None] = {
            "w13": rows(unswizzle_values(tensors["w13_weight"], g13.n, g13.k)),
            "w2": unswizzle_values(tensors["w2_weight"], g2.n, g2.k),
            "w13_scale": rows(unswizzle_scales(tensors["w13_weight_scale"], g13.n, g13.k)),
            "w2_scale": unswizzle_scales(tensors["w2_weight_scale"], g2.n, g2.k),
        }
        if "w13_bias" in tensors:
            kw["w13_bias"] = rows(tensors["w13_bias"])
            kw["w2_bias"] = tensors["w2_bias"]
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """The source block with its biases in fp32, as vLLM casts them for triton_kernels."""
        if block.w13_bias is None:
            return block
        return dataclasses.replace(block, w13_bias=block.w13_bias.to(torch.float32),
                                   w2_bias=block.w2_bias.to(torch.float32))

    @staticmethod
    def _rows(shape: LayerShape):
        return interleave_gate_up if ROW_ORDERS[shape.activation][0] == "interleaved" else (lambda x: x.contiguous())

    @staticmethod
    def _unrows(shape: LayerShape):
        return deinterleave_gate_up if ROW_ORDERS[shape.activation][0] == "interleaved" else (lambda x: x)

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        """Both swizzles keep whole tiles together: a value buffer row holds 16 rows of N (``R0``) and a run of
        128 bytes of it one 64-value K tile (``R1``); a scale buffer row holds 256 rows of N (``d0``) and a run
        of 64 bytes of it two K groups (``d5``). So a rank is rows of w13 (N = 2Ip) and columns of w2 (K = Ip)
        of the full buffers exactly when its rows are whole 256-row scale tiles (interleaved rows: I / T a
        multiple of 128; ``[gate; up]`` halves: of 256) and its K groups need no padding to 4 of their own
        (I / T a multiple of 128); then neither the full tensors nor a rank's are padded (vLLM pads I to 64)."""
        I = shape.extra.get("intermediate_size_unpadded", shape.intermediate_size)
        interleaved = ROW_ORDERS.get(shape.activation, ("gate_up",))[0] == "interleaved"
        unit = SCALE_ROW_TILE // 2 if interleaved else SCALE_ROW_TILE  # a rank's 2 I / T rows, or I / T per half
        if tp_size > 1 and (I % tp_size or (I // tp_size) % unit):
            return NotASlice(f"a TP rank's I = {I / tp_size:g} is not a multiple of {unit}: its rows are not whole "
                             f"{SCALE_ROW_TILE}-row scale tiles or its K groups are padded to {SCALE_GROUP_MULTIPLE} "
                             "on their own, so a rank's buffers are not a slice of the full ones")
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        runs = 1 if interleaved else 2
        cuts = {"w13_weight": TPCut(1, runs=runs), "w13_weight_scale": TPCut(1, runs=runs),
                "w2_weight": TPCut(2), "w2_weight_scale": TPCut(2)}
        if shape.has_bias:
            bias = expert_bias_cuts(shape, runs)
            if isinstance(bias, NotASlice):
                return bias
            cuts.update(bias)
        return cuts

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        g13, g2 = self._gemms(shape)
        order, backends = ROW_ORDERS.get(shape.activation, ("gate_up", ()))
        return {
            "triton_kernels_api": TRITON_KERNELS_API,
            "w13_row_order": order,
            "vllm_backends": list(backends),
            "opt_flags_constraints": {"split_k": 1},
            "bias_dtype": "float32",
            "w13": g13.metadata(shape.num_experts),
            "w2": g2.metadata(shape.num_experts),
        }

    def warnings(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        out = []
        if shape.activation == "silu":
            out.append(
                "activation silu: vLLM 0.33.0 runs this layout with --moe-backend triton_unfused only (its fused "
                "TRITON backend takes swigluoai only); w13 rows are kept [gate; up] for its silu_and_mul"
            )
        if shape.dtype != "bfloat16":
            out.append(
                f"model dtype {shape.dtype}: vLLM's fused triton_kernels MoE asserts bfloat16 activations"
            )
        return out
