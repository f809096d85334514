"""``marlin`` for MXFP4 experts: what vLLM 0.33.0's Marlin MoE kernel reads (docs/layouts/marlin-mxfp4.md).

The bytes equal what vLLM holds after ``prepare_moe_mxfp4_layer_for_marlin`` (MARLIN and
BATCHED_MARLIN backends, 16-bit activations, ``VLLM_MARLIN_INPUT_DTYPE`` unset, i.e.
``is_a_8bit=False``), reached from the online path (``--quantization mxfp4`` on a bf16 checkpoint)
and from the gpt-oss MXFP4 checkpoint path alike: both hand it the loaded tensors unchanged. The
consumer is ``torch.ops._moe_C.moe_wna16_marlin_gemm`` with ``b_q_type = float4_e2m1f`` and no global
scale. On SM90 vLLM's automatic choice is another backend (spec §4), so serve with
``--moe-backend marlin``.

=================  ==========================  ==================================================
tensor             shape                       dtype, content
=================  ==========================  ==================================================
w13_weight         ``[E, Hp/16, 4Ip]``         int32: the int4 GPTQ -> Marlin repack of the e2m1
                                               codes (N = 2Ip, K = Hp)
w2_weight          ``[E, Ip/16, 2Hp]``         int32 (N = Hp, K = Ip)
w13_weight_scale   ``[E, Hp/32, 2Ip]``         float8_e8m0fnu: K-first, 8x8-transposed in runs
                                               of 64, then each run of 4 as [0, 2, 1, 3]
w2_weight_scale    ``[E, Ip/32, Hp]``          float8_e8m0fnu, the same
w13_bias, w2_bias  ``[E, 2Ip]``, ``[E, Hp]``   model dtype (bf16), single-permuted (32-cycle)
=================  ==========================  ==================================================

``Hp = round_up(H, 256)``, ``Ip = round_up(I per TP rank, 128)`` (``pad_multiples``, spec §5.3); the
canonical block arrives padded with zero codes and scale byte 0. The rows of w13 (codes, scales,
bias) are in the order the activation reads GEMM1's output columns: ``[gate; up]`` for ``silu``,
pairwise interleaved ``gate_0, up_0, gate_1, ...`` for ``swigluoai`` (gpt-oss), which is how vLLM
loads gpt-oss and never reorders for Marlin (:data:`W13_ROWS`).

Only bf16 models: vLLM 0.33.0 builds the e8m0-scale Marlin kernels for bf16 activations only, and its
load-time e8m0 -> fp16 -> e8m0 cast would also corrupt scale bytes outside [103, 142] (docs).

Everything is a reshape/permute of a whole chunk of experts; the weight tile plan is marlin.py's,
cached per (size_k, size_n).
"""

from __future__ import annotations

import torch

from moeconvert.canonical import ExpertBlock, LayerShape
from moeconvert.layouts import register
from moeconvert.layouts.base import W2, W13, Layout, NotASlice, TensorSpec, TPCut, expert_bias_cuts
from moeconvert.layouts.marlin import grouped_perm, repack_weights, single_perm, unrepack_weights
from moeconvert.mxfp4 import MXFP4_BLOCK_SIZE, e8m0_bytes, require_padded_block
from moeconvert.schemes import MXFP4Scheme, Scheme

#: vLLM's Marlin round-up of (H, I per TP rank) for MXFP4 (mxfp4_round_up_hidden_size_and_intermediate_size)
PAD_MULTIPLES = (256, 128)
MODEL_DTYPE = torch.bfloat16
#: activation -> order of the w13 rows in vLLM's memory (= GEMM1 output columns the activation reads):
#: SiLU-and-mul takes the two halves; swigluoai takes even/odd columns (``x[..., ::2]``, ``x[..., 1::2]``);
#: Kimi-K3's SITU (vLLM's ``situ_and_mul``, which MarlinExperts runs through ``apply_moe_activation``) the halves,
#: and so does Step-3.5's swiglustep (``swiglustep_and_mul_triton``, the same path)
W13_ROWS = {"silu": "gate_up", "swigluoai": "interleaved", "situ": "gate_up", "swiglustep": "gate_up"}


# ---------------------------------------------------------------------------------------------------
# e2m1 codes (spec §6.2 "Weights")


def repack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 ``[E, N, K/2]`` (low nibble = even k) -> Marlin words ``[E, K/16, 2N]``.

    A row's bytes viewed as int32 are exactly GPTQ's K-packing of 4-bit codes (element ``8p + j`` at
    bits ``4j`` of word p), so vLLM's ``gptq_marlin_repack(num_bits=4)`` of them is the int4 repack.
    """
    E, N, Kb = packed.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(E, N, 2 * Kb)
    return repack_weights(codes, 4)


def unrepack_fp4(words: torch.Tensor, size_n: int, size_k: int) -> torch.Tensor:
    """Inverse of :func:`repack_fp4`: Marlin words -> packed e2m1 ``[E, size_n, size_k/2]`` uint8."""
    codes = unrepack_weights(words, 4, size_n, size_k)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


# ---------------------------------------------------------------------------------------------------
# e8m0 scales (spec §6.2 "Scales"); both steps are involutions


def _swap_inner_pairs(x: torch.Tensor) -> torch.Tensor:
    """Each run of 4 columns reordered [0, 2, 1, 3] (``mxfp4_marlin_process_scales``, 16-bit activations)."""
    *lead, n = x.shape
    return x.reshape(*lead, n // 4, 2, 2).transpose(-1, -2).reshape(*lead, n).contiguous()


def permute_scales(s_kfirst: torch.Tensor) -> torch.Tensor:
    """K-first scale bytes ``[E, K/32, N]`` -> the kernel's order (same shape, uint8).

    ``marlin_permute_scales(group_size=32)`` takes the grouped (64-cycle) permutation, since
    32 < K always; then the fp8-dequantizer's pair swap. ``out[c] = in[64 (c//64) + 8 (s%8) + s//8]``
    with ``s = 4 ((c%64)//4) + [0, 2, 1, 3][c%4]``.
    """
    return _swap_inner_pairs(grouped_perm(s_kfirst))


def unpermute_scales(s: torch.Tensor) -> torch.Tensor:
    return grouped_perm(_swap_inner_pairs(s))


# ---------------------------------------------------------------------------------------------------
# w13 row order


def to_kernel_rows(x: torch.Tensor, rows: str) -> torch.Tensor:
    """Canonical ``[E, 2Ip, ...]`` as ``[gate; up]`` -> the rows vLLM holds for ``rows`` (see W13_ROWS).

    Interleaving the padded halves gives ``gate_j, up_j`` for j < I and zero pairs after, which is
    what vLLM's gpt-oss loader makes by copying the checkpoint's interleaved rows into rows ``[0, 2I)``
    of the zeroed, padded parameter.
    """
    if rows == "gate_up":
        return x
    E, two_ip, *rest = x.shape
    return x.reshape(E, 2, two_ip // 2, *rest).transpose(1, 2).reshape(E, two_ip, *rest).contiguous()


def from_kernel_rows(x: torch.Tensor, rows: str) -> torch.Tensor:
    if rows == "gate_up":
        return x
    E, two_ip, *rest = x.shape
    return x.reshape(E, two_ip // 2, 2, *rest).transpose(1, 2).reshape(E, two_ip, *rest).contiguous()


# ---------------------------------------------------------------------------------------------------


@register
class MarlinMXFP4Layout(Layout):
    name = "marlin"
    version = 1
    schemes = ("mxfp4",)
    runtime_kernels = ("vllm-marlin",)
    kernel = "vllm._moe_C.moe_wna16_marlin_gemm (float4_e2m1f, e8m0 scales)"
    made_for = {"vllm": ["0.33.0", "0.34.0"]}  # the versions whose processing the oracle tests check
    vllm_method = "MarlinMXFP4Method"
    pad_multiples = PAD_MULTIPLES

    def source_problems(self, source_format: str, shape: LayerShape) -> list[str]:
        """vLLM 0.33.0 / 0.34.0 repack a compressed-tensors MXFP4 checkpoint's experts for Marlin as they are
        (``CompressedTensorsW4A4Mxfp4MoEMethod`` calls ``prepare_moe_fp4_layer_for_marlin`` with no round-up);
        only gpt-oss' and the online MXFP4 method round H and I up first. Where the round-up changes a size,
        this layout's padded bytes are not what vLLM holds for such a checkpoint."""
        H = shape.extra.get("hidden_size_unpadded", shape.hidden_size)
        I = shape.extra.get("intermediate_size_unpadded", shape.intermediate_size)
        if source_format != "mxfp4-pack-quantized" or (H, I) == (shape.hidden_size, shape.intermediate_size):
            return []
        return [f"compressed-tensors MXFP4 experts with H = {H} and I per TP partition = {I}: vLLM 0.33.0 and "
                f"0.34.0 repack them for Marlin unpadded (CompressedTensorsW4A4Mxfp4MoEMethod has no MXFP4 "
                f"round-up), while this layout pads them to {shape.hidden_size} x {shape.intermediate_size} as "
                f"vLLM does for gpt-oss and online MXFP4, so its bytes would not be those vLLM holds for this "
                f"checkpoint"]

    def _check(self, shape: LayerShape, scheme: Scheme) -> list[str]:
        assert isinstance(scheme, MXFP4Scheme)
        Hp, Ip = shape.hidden_size, shape.intermediate_size
        problems = []
        if scheme.block_size != MXFP4_BLOCK_SIZE:
            problems.append(f"MXFP4 block size = {scheme.block_size}: Marlin reads one e8m0 scale per 32 "
                            "elements along K (group_size 32)")
        if Hp % PAD_MULTIPLES[0]:
            problems.append(f"hidden_size Hp = {Hp} must be a multiple of {PAD_MULTIPLES[0]} (vLLM 0.33.0 rounds H "
                            "up to it for Marlin MXFP4; the block must come padded)")
        if Ip % PAD_MULTIPLES[1]:
            problems.append(f"intermediate_size Ip = {Ip} (per TP partition) must be a multiple of "
                            f"{PAD_MULTIPLES[1]} (vLLM 0.33.0 rounds I up to it for Marlin MXFP4; the block "
                            "must come padded)")
        if shape.dtype == "float16":
            problems.append(
                "model dtype = float16: vLLM 0.33.0 has no Marlin MoE kernel for MXFP4 weights with fp16 "
                "activations (its e8m0-scale kernels are built for bf16 only), and its load-time e8m0 -> fp16 -> "
                "e8m0 cast would turn scale bytes below 103 into 0 and above 142 into NaN; use a bfloat16 model "
                "dtype (--dtype bfloat16)")
        elif shape.dtype != "bfloat16":
            problems.append(f"model dtype = {shape.dtype}: Marlin runs MXFP4 experts with bfloat16 activations "
                            "only; use a bfloat16 model dtype (--dtype bfloat16)")
        if shape.activation not in W13_ROWS:
            problems.append(f"activation = {shape.activation}: this layout knows the w13 row order vLLM's Marlin "
                            "path holds for silu and situ ([gate; up]) and swigluoai (gate/up interleaved) only")
        return problems

    def plan(self, shape: LayerShape, scheme: Scheme) -> list[TensorSpec]:
        E, Hp, Ip = shape.num_experts, shape.hidden_size, shape.intermediate_size
        e8m0 = torch.float8_e8m0fnu
        specs = [
            TensorSpec(W13.weight, (E, Hp // 16, 4 * Ip), torch.int32),
            TensorSpec(W2.weight, (E, Ip // 16, 2 * Hp), torch.int32),
            TensorSpec(W13.weight_scale, (E, Hp // 32, 2 * Ip), e8m0),
            TensorSpec(W2.weight_scale, (E, Ip // 32, Hp), e8m0),
        ]
        if shape.has_bias:
            specs += [TensorSpec(W13.bias, (E, 2 * Ip), MODEL_DTYPE), TensorSpec(W2.bias, (E, Hp), MODEL_DTYPE)]
        return specs

    def encode(self, block: ExpertBlock, shape: LayerShape) -> dict[str, torch.Tensor]:
        self.require(shape, block.scheme)
        require_padded_block(block, shape)
        rows = W13_ROWS[shape.activation]
        out = {
            W13.weight: repack_fp4(to_kernel_rows(block.w13, rows)),
            W2.weight: repack_fp4(block.w2),
            # vLLM's e8m0 -> bf16 -> e8m0 round trip is the identity on all 256 bytes (spec §6.2)
            W13.weight_scale: _as_e8m0(permute_scales(to_kernel_rows(block.w13_scale, rows).transpose(1, 2))),
            W2.weight_scale: _as_e8m0(permute_scales(block.w2_scale.transpose(1, 2))),
        }
        if block.w13_bias is not None:
            out[W13.bias] = single_perm(to_kernel_rows(block.w13_bias.to(MODEL_DTYPE), rows))
            out[W2.bias] = single_perm(block.w2_bias.to(MODEL_DTYPE))
        return out

    def decode(self, tensors: dict[str, torch.Tensor], shape: LayerShape, scheme: Scheme) -> ExpertBlock:
        """Back to the canonical (padded) block; biases stay in the file's (model) dtype."""
        Hp, Ip = shape.hidden_size, shape.intermediate_size
        rows = W13_ROWS[shape.activation]
        kw: dict[str, torch.Tensor] = {
            "w13": from_kernel_rows(unrepack_fp4(tensors[W13.weight], 2 * Ip, Hp), rows),
            "w2": unrepack_fp4(tensors[W2.weight], Hp, Ip),
            "w13_scale": from_kernel_rows(
                unpermute_scales(e8m0_bytes(tensors[W13.weight_scale], "Marlin")).transpose(1, 2), rows).contiguous(),
            "w2_scale": unpermute_scales(e8m0_bytes(tensors[W2.weight_scale], "Marlin")).transpose(1, 2).contiguous(),
        }
        if W13.bias in tensors:
            kw["w13_bias"] = from_kernel_rows(single_perm(tensors[W13.bias]), rows)
            kw["w2_bias"] = single_perm(tensors[W2.bias])
        return ExpertBlock(scheme=scheme, **kw)

    def expected_block(self, block: ExpertBlock, shape: LayerShape) -> ExpertBlock:
        """Biases come back in the model dtype: vLLM's ``bias.to(param_dtype)`` (RNE), as encode does."""
        if block.w13_bias is None:
            return block
        return ExpertBlock(scheme=block.scheme, w13=block.w13, w2=block.w2, w13_scale=block.w13_scale,
                           w2_scale=block.w2_scale, w13_bias=block.w13_bias.to(MODEL_DTYPE),
                           w2_bias=block.w2_bias.to(MODEL_DTYPE))

    def tp_cuts(self, shape: LayerShape, scheme: Scheme, tp_size: int) -> dict[str, TPCut] | NotASlice:
        """As for Marlin WNA16 (``marlin.MarlinLayout.tp_cuts``): the e2m1 repack and the e8m0 scale
        permutation stay inside 64-column runs, so a rank is columns of w13 and rows of w2 whenever its
        I is a multiple of 128 with no padding of its own (``shape`` holds the padded sizes; ``extra`` the
        real ones) and MXFP4's 32-blocks along w2's K never straddle a rank boundary (they cannot then)."""
        I = shape.extra.get("intermediate_size_unpadded", shape.intermediate_size)
        if tp_size > 1 and (I % tp_size or (I // tp_size) % PAD_MULTIPLES[1]):
            Ir = I // tp_size
            return NotASlice(f"a TP rank's I = {Ir} is padded to {-(-Ir // PAD_MULTIPLES[1]) * PAD_MULTIPLES[1]} (a multiple "
                    f"of {PAD_MULTIPLES[1]}), the full tensors pad I = {I} once: a rank's tiles are not a slice of them")
        rank = self._rank_shape(shape, scheme, tp_size)
        if isinstance(rank, NotASlice):
            return rank
        # [gate; up] rows are two runs; gpt-oss's interleaved rows keep a rank's pairs together
        runs = 2 if W13_ROWS[shape.activation] == "gate_up" else 1
        cuts = {W13.weight: TPCut(2, runs=runs), W2.weight: TPCut(1), W13.weight_scale: TPCut(2, runs=runs),
                W2.weight_scale: TPCut(1)}
        if shape.has_bias:
            bias = expert_bias_cuts(shape, runs)
            if isinstance(bias, NotASlice):
                return bias
            cuts.update(bias)  # w13's bias: the 32-cycle permutation stays inside a rank's 2 Ip / T columns
        return cuts

    def layer_metadata(self, shape: LayerShape, scheme: Scheme, facts: dict | None = None) -> dict:
        return {"w13_rows": W13_ROWS.get(shape.activation), "is_a_8bit": False}


def _as_e8m0(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.float8_e8m0fnu)
