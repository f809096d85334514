"""MXFP4 quantization and dequantization: e2m1 elements, one e8m0 scale per 32 along the last dim.

``quantize_mxfp4(w)`` returns the canonical MXFP4 pair (``canonical.py``): packed uint8 ``[..., K/2]``
(element 2j in the low nibble of byte j) and e8m0 scale bytes uint8 ``[..., K/32]``. Three rules,
all described bit for bit in ``docs/mxfp4-rounding.md``:

``"vllm"`` (default)
    What vLLM 0.33.0's online MoE quantizer (``Mxfp4OnlineMoEMethod`` → ``mxfp4_utils.py:
    downcast_to_mxfp``) writes (docs/mxfp4-rounding.md): the block max is rounded to one mantissa bit
    ("even" scale), ``S = max(E - 2, 0)`` (254 when E = 255), elements round half to even and
    saturate at ±6, the sign bit is kept on zero. Where the compiled CUDA kernel and the spec's
    reading differ, this follows the kernel as measured on an H200: S = 0 blocks come out as all ±0
    (its ``exp2(-127)`` flushes to zero) and NaN elements as code 7 (the GPU's NaN is positive).
    fp32 input, which vLLM refuses, gets the kernel's arithmetic on fp32 tiles.
``"ocp"``
    The OCP MX v1.0 reference rule (§1.4): ``X = 2^(floor(log2 amax) - 2)``, elements RNE, saturate.
``"triton_kernels"``
    triton_kernels' ``downcast_to_mxfp`` with its default ``ROUND_UP`` (§2.4):
    ``X = 2^ceil(log2(amax / 6))``, elements round half away from zero, saturate.

Why the arithmetic looks the way it does: the result must be the same bytes on every device, so no
step may depend on how a device rounds, flushes subnormals or propagates NaN. Everything after
reading the input is integer arithmetic on fp32 bit patterns. Multiplying by a power of two is exact,
so instead of forming ``q = x / X`` (inexact once q is subnormal, and subject to flush-to-zero) each
block's seven rounding boundaries ``t * X`` are computed as exact fp32 bit patterns and the element
code is the number of boundaries that ``|x|`` reaches: positive floats order like their bit patterns.

Memory: for a bf16 input the temporaries peak at about 4x its size (an int32 copy of the magnitude
bits, the sign, the uint8 codes and a bool mask; measured 3.95x on CUDA), so callers quantize a chunk
of experts at a time. Speed: ~13 G elements/s on an H200, ~0.1 G/s on 2 CPU cores.
"""

from __future__ import annotations

import math

import torch

from moeconvert.errors import MoeConvertError

MXFP4_BLOCK_SIZE = 32
ROUNDINGS = ("vllm", "ocp", "triton_kernels")

#: E2M1 code (0..15) -> value; bit 3 is the sign (docs/mxfp4-rounding.md).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_INF = 0x7F800000  # fp32 bits of +inf; anything above is a NaN
_NAN = 0x7FC00000
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The seven boundaries between neighbouring magnitude codes c and c+1, as (biased fp32 exponent,
# fp32 mantissa bits) of t: 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0.
_BOUNDARIES = ((125, 0x000000), (126, 0x400000), (127, 0x200000), (127, 0x600000),
               (128, 0x200000), (128, 0x600000), (129, 0x200000))
# The e2m1 magnitudes 0.5 .. 6 as (biased fp32 exponent, fp32 mantissa bits); code 0 is zero.
_MAGNITUDES = ((0, 0), (126, 0), (127, 0), (127, 0x400000), (128, 0), (128, 0x400000), (129, 0), (129, 0x400000))


# --------------------------------------------------------------------------------------------------
# public API


def quantize_mxfp4(
    w: torch.Tensor, rounding: str = "vllm", *, tensor: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., K]`` (bf16/fp16/fp32, K % 32 == 0) along its last dim.

    Returns ``(packed uint8 [..., K/2], scales e8m0 uint8 [..., K/32])`` on ``w``'s device.
    Non-finite values are not refused here (the engine's behaviour is reproduced, see the docs);
    call :func:`require_finite` first to refuse them. ``tensor`` names ``w`` in error messages.
    """
    _check_input(w, rounding, tensor)
    lead, k = w.shape[:-1], w.shape[-1]
    nb = k // MXFP4_BLOCK_SIZE
    if w.numel() == 0:
        return (torch.empty(*lead, k // 2, dtype=torch.uint8, device=w.device),
                torch.empty(*lead, nb, dtype=torch.uint8, device=w.device))

    mag, neg = _fp32_magnitude_bits(w)  # int32 |x| bits, bool sign
    mag = mag.view(*lead, nb, MXFP4_BLOCK_SIZE)
    neg = neg.view(*lead, nb, MXFP4_BLOCK_SIZE)
    scale = _scale_bytes(mag, rounding)  # int32 [..., nb], 0..255

    # code = 8 * sign + (number of boundaries |x| reaches); NaN bits exceed every boundary -> 7.
    codes = neg.to(torch.uint8) << 3
    del neg
    table = _threshold_table(rounding, w.device)
    for boundary in table:
        codes += mag >= boundary[scale].unsqueeze(-1)
    if bool((mag > _INF).any()):
        # NaN * scale is the GPU's canonical NaN 0x7FFFFFFF: code 7 whatever the input's sign
        codes = torch.where(mag > _INF, 7, codes)

    # Blocks whose quant scale is zero: every element becomes x * 0 = ±0 (NaN for ±inf/NaN).
    # vllm: S = 0, because the compiled kernel's exp2(-127) flushes to zero (ex2.approx.ftz.f32);
    # triton_kernels: S = 0 and S = 255 (amax = inf). ocp: a NaN scale (255) voids the block.
    dead = {"vllm": scale == 0, "ocp": scale == 255, "triton_kernels": (scale == 0) | (scale == 255)}[rounding]
    if bool(dead.any()):
        codes = torch.where(dead.unsqueeze(-1), torch.where(mag >= _INF, 7, codes & 8), codes)
    del mag

    codes = codes.view(*lead, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale.to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1(code) * 2^(S - 127)`` per element (docs/mxfp4-rounding.md), exact in fp32.

    Scale byte 0 means 2^-127 (OCP; triton_kernels' own upcast reads it as 0), 255 means NaN.
    S = 254 with a magnitude >= 2 overflows to inf. The fp32 result is cast to ``dtype``.
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MoeConvertError("MXFP4 packed values and scales must be uint8",
                              expected="uint8, uint8", found=f"{packed.dtype}, {scales.dtype}")
    kb = packed.shape[-1] if packed.dim() else 0
    if (packed.dim() == 0 or kb % (MXFP4_BLOCK_SIZE // 2) or packed.shape[:-1] != scales.shape[:-1]
            or scales.shape[-1] * (MXFP4_BLOCK_SIZE // 2) != kb):
        raise MoeConvertError("MXFP4 packed [..., K/2] and scales [..., K/32] do not match",
                              expected="packed [..., 16*G], scales [..., G]",
                              found=f"{tuple(packed.shape)}, {tuple(scales.shape)}")
    lead, nb = packed.shape[:-1], scales.shape[-1]
    index = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(*lead, nb, MXFP4_BLOCK_SIZE).int()
    index += scales.int().unsqueeze(-1) << 4  # (S, code) -> S * 16 + code
    # index_select, not ``table[index]``: the same values, ten times faster on the CPU
    bits = torch.index_select(_dequant_table(packed.device), 0, index.view(-1))
    return bits.view(torch.float32).view(*lead, nb * MXFP4_BLOCK_SIZE).to(dtype)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    """NVFP4 (canonical.py): ``E2M1(code) * scale * multiplier`` in fp32, ``packed [..., N, K/2]``, e4m3
    ``scales [..., N, K/16]``, fp32 ``multiplier`` broadcast over ``[..., N, 1]``. The first product is
    exact (a 2-bit by a 4-bit significand); the second rounds once."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1_VALUES, device=packed.device)[codes]
    return values * scales.float().repeat_interleave(codes.shape[-1] // scales.shape[-1], -1) * multiplier


_DEQUANT_TABLES: dict[torch.device, torch.Tensor] = {}


def _dequant_table(device: torch.device) -> torch.Tensor:
    """int32 fp32 bits of E2M1(code) * 2^(S - 127) for all 256 x 16 (S, code), computed exactly."""
    if device not in _DEQUANT_TABLES:
        lut = torch.tensor(_MAGNITUDES, dtype=torch.int32)
        exponent, mantissa = lut[:, 0].repeat(2), lut[:, 1].repeat(2)  # codes 0..15
        s = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
        bits = torch.where(exponent == 0, 0, _times_pow2(exponent, mantissa, s - 127))
        bits = torch.where(s == 255, _NAN, bits)
        bits = bits | torch.where(torch.arange(16) >= 8, -(2**31), 0).to(torch.int32)
        _DEQUANT_TABLES[device] = bits.flatten().contiguous().to(device)
    return _DEQUANT_TABLES[device]


def mxfp4_error_sums(w: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> tuple[float, float, float, int]:
    """``(sum (w - w_q)^2, sum w^2, max |w - w_q|, saturated blocks)`` with ``w_q = dequantize(packed, scales)``:
    the additive pieces of :func:`mxfp4_error_stats`, for accumulating over chunks."""
    ref = w.float()
    err = ref - dequantize_mxfp4(packed, scales).view(ref.shape)
    max_abs = float(err.abs().max()) if err.numel() else 0.0
    sq_err, sq_ref = _sum_of_squares(err), _sum_of_squares(ref)
    del err, ref
    return sq_err, sq_ref, max_abs, saturated_blocks(w, scales)


def _sum_of_squares(x: torch.Tensor) -> float:
    """The sum of squares of a float32 tensor ``[..., K]``, the same whatever the number of threads.

    A float32 value squared in float64 is exact (24 + 24 bits < 53); each row (along K) is summed by one
    thread in a fixed order, and the rows' sums are added exactly rounded (``math.fsum``). A whole-tensor
    ``dot`` would split its sum by thread. Float32 partial sums are 10x cheaper but leave the CPU's and
    the GPU's reports 1e-9 apart (measured on the H200), so the report pays for float64."""
    if x.numel() == 0:
        return 0.0
    rows = x.reshape(-1, x.shape[-1]).double()
    return math.fsum((rows * rows).sum(dim=1).tolist())


def mxfp4_error_stats(w: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> dict:
    """How far ``dequantize(packed, scales)`` is from ``w``, for the quality report.

    ``rel_fro_error`` = ||w - w_q||_F / ||w||_F (0 when both are 0), ``max_abs_error``, and
    ``saturated_block_fraction``: the fraction of 32-blocks with an element clipped, i.e. |x| > 6·X.
    """
    sq_err, sq_ref, max_abs, saturated = mxfp4_error_sums(w, packed, scales)
    num, den = sq_err ** 0.5, sq_ref ** 0.5
    n_blocks = w.numel() // MXFP4_BLOCK_SIZE
    return {
        "rel_fro_error": 0.0 if den == 0.0 and num == 0.0 else num / den,
        "max_abs_error": max_abs,
        "saturated_block_fraction": saturated / n_blocks if n_blocks else 0.0,
    }


def saturated_blocks(w: torch.Tensor, scales: torch.Tensor) -> int:
    """Number of 32-blocks of ``w`` with an element clipped to ±6·X (|x| > 6·X, X = 2^(S - 127))."""
    if w.numel() == 0:
        return 0
    k = w.shape[-1]
    mag, _ = _fp32_magnitude_bits(w)
    mag = mag.view(*w.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)
    six_x = _times_pow2(torch.tensor(129, dtype=torch.int32, device=w.device), 0x400000,
                        scales.to(torch.int32) - 127)  # 6 * X, exact
    return int((mag > six_x.unsqueeze(-1)).any(-1).sum())


def count_nonfinite(w: torch.Tensor) -> int:
    """Number of NaN/±inf elements of ``w``."""
    return int((~torch.isfinite(w)).sum())


def nonfinite_experts(w: torch.Tensor) -> dict[int, int]:
    """``{expert index (dim 0): number of NaN/±inf elements}`` for the experts that have any."""
    if w.dim() == 0:
        return {0: count_nonfinite(w)} if count_nonfinite(w) else {}
    counts = (~torch.isfinite(w)).reshape(w.shape[0], -1).sum(-1)
    return {int(e): int(counts[e]) for e in torch.nonzero(counts).flatten().tolist()}


def require_finite(w: torch.Tensor, *, tensor: str, expert_offset: int = 0) -> None:
    """Refuse NaN/inf weights (docs/mxfp4-rounding.md: vLLM quantizes them silently to ±6 or S = 254).

    ``w`` is a chunk of experts ``[E, ...]`` whose first expert is ``expert_offset`` in the layer.
    """
    bad = nonfinite_experts(w)
    if bad:
        where = ", ".join(f"expert {e + expert_offset}: {n}" for e, n in list(bad.items())[:8])
        more = "" if len(bad) <= 8 else f" and {len(bad) - 8} more experts"
        raise MoeConvertError(f"non-finite weights cannot be quantized to MXFP4 ({where}{more})",
                              tensor=tensor, expected="finite values", found=f"{sum(bad.values())} NaN/inf")


# --------------------------------------------------------------------------------------------------
# the rules


def _check_input(w: torch.Tensor, rounding: str, tensor: str | None) -> None:
    if rounding not in ROUNDINGS:
        raise MoeConvertError("unknown MXFP4 rounding rule", tensor=tensor,
                              expected=" | ".join(ROUNDINGS), found=repr(rounding))
    if w.dtype not in _INPUT_DTYPES:
        raise MoeConvertError("MXFP4 quantization takes bf16, fp16 or fp32 weights", tensor=tensor,
                              expected="bfloat16 | float16 | float32", found=str(w.dtype))
    if w.dim() == 0 or w.shape[-1] % MXFP4_BLOCK_SIZE:
        raise MoeConvertError("MXFP4 needs the last (K) dim to be a multiple of 32", tensor=tensor,
                              expected="K % 32 == 0", found=f"shape {tuple(w.shape)}")


def _fp32_magnitude_bits(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 fp32 bit pattern of |w|, bool sign bit), exact for every input, by integer ops only."""
    w = w.contiguous()
    if w.dtype == torch.float32:
        v = w.view(torch.int32)
        return v & 0x7FFFFFFF, v < 0  # (a copy: w itself is never written)
    u = w.view(torch.int16)
    neg = u < 0
    h = u.to(torch.int32)
    h &= 0x7FFF
    if w.dtype == torch.bfloat16:  # bf16 is the top half of an fp32
        h <<= 16
        return h, neg
    # fp16: 5-bit exponent (bias 15), 10-bit mantissa; every fp16 is a normal fp32.
    e, m = h >> 10, h & 0x3FF
    normal = ((e + 112) << 23) | (m << 13)
    special = _INF | (m << 13)
    # subnormal m * 2^-24: an int of < 2^10 converts to fp32 exactly on any device; rescale its bits
    sub = torch.where(m > 0, m.to(torch.float32).view(torch.int32) - (24 << 23), 0)
    return torch.where(e == 31, special, torch.where(e == 0, sub, normal)), neg


def _block_max(mag: torch.Tensor, drop_nan: bool) -> torch.Tensor:
    """Block max of the magnitude bits, int64 ``[..., nb]``.

    ``drop_nan``: like Triton's ``tl.max`` in both kernels, NaN elements are ignored (docs/mxfp4-rounding.md
    §2.2 step 1). The max of an all-NaN block is the GPU's canonical NaN 0x7FFFFFFF (the CPU
    interpreter would return the input's NaN payload instead).
    """
    if drop_nan and bool((mag > _INF).any()):
        m = torch.where(mag > _INF, -1, mag).amax(-1).long()
        return torch.where(m < 0, 0x7FFFFFFF, m)
    return mag.amax(-1).long()


def _scale_bytes(mag: torch.Tensor, rounding: str) -> torch.Tensor:
    """The e8m0 byte S of every block, int32 ``[..., nb]``."""
    m = _block_max(mag, drop_nan=rounding != "ocp")
    exponent, mantissa = m >> 23, m & 0x7FFFFF  # of the fp32 amax (exponent 255: inf/NaN)
    if rounding == "vllm":
        # §2.2 steps 2-3: round amax to one mantissa bit (carry at significand >= 1.75, in 32 bits
        # like the kernel's uint32 add), then S = E - 2 clamped to [0, 127 + 127].
        e = (((m + 0x200000) & 0xFFFFFFFF) >> 23) & 0xFF  # a NaN max can carry into the sign bit
        s = torch.where(e == 255, 254, (e - 2).clamp(min=0))
    elif rounding == "ocp":
        # X = 2^(floor(log2 amax) - 2), S clamped to [0, 254]; amax = 0 -> S = 0; inf/NaN -> 255.
        # floor(log2) of an fp32 subnormal: the msb of its mantissa (an int of < 2^23, exact as fp32).
        msb = (mantissa.to(torch.float32).view(torch.int32).long() >> 23) - 127
        floor_log2_biased = torch.where(exponent == 0, msb - 149 + 127, exponent)
        s = (floor_log2_biased - 2).clamp(0, 254)
        s = torch.where(m == 0, 0, torch.where(exponent == 255, 255, s))
    else:
        # §2.4: S = exponent field of ceil_pow2(fl(amax / 6)). amax / 6 = (sig / 1.5) * 2^(E-129):
        # ceil_pow2 is 2^(E-129) for sig <= 1.5 and 2^(E-128) above; below 2^-126 it is 2^-126
        # (S = 1). The fp32 division rounds the quotient to 0 for amax <= 3 * 2^-149 (S = 0);
        # elsewhere its rounding cannot move the quotient across a power of two (docs).
        s = (exponent - 2 + (mantissa > 0x400000).long()).clamp(min=1)
        s = torch.where(m <= 3, 0, s)
        s = torch.where(exponent == 255, torch.where(mantissa == 0, 255, 0), s)  # inf: 255; NaN: 0
    return s.to(torch.int32)


_THRESHOLD_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _threshold_table(rounding: str, device: torch.device) -> torch.Tensor:
    """:func:`_thresholds` for every scale byte: int32 ``[7, 256]`` (boundary, S), built once per device."""
    key = (rounding, torch.device(device))
    if key not in _THRESHOLD_TABLES:
        every_scale = torch.arange(256, dtype=torch.int32)
        _THRESHOLD_TABLES[key] = torch.stack(_thresholds(every_scale, rounding)).to(device)
    return _THRESHOLD_TABLES[key]


def _thresholds(scale: torch.Tensor, rounding: str) -> list[torch.Tensor]:
    """For each boundary t between codes c and c+1: the least fp32 bit pattern |x| that gets code c+1.

    That is bits(t·X) when a tie rounds up, bits(t·X) + 1 (the next float) when it rounds down.
    Round half to even ("vllm", "ocp"): ties round down at 0.25, 1.25, 2.5, 5 and up at 0.75,
    1.75, 3.5. Round half away ("triton_kernels"): all ties round up.
    """
    shift = scale.long() - 127
    out = []
    for i, (e_t, m_t) in enumerate(_BOUNDARIES):
        t = _times_pow2(torch.full_like(shift, e_t), m_t, shift)
        if rounding != "triton_kernels" and i % 2 == 0:
            step = 1
            if rounding == "vllm" and i == 0:
                # vLLM's kernel drops the last fp32 mantissa bit of q before its sticky-bit
                # shift, so q = 0.25 + 1 ulp still rounds to 0. This only shows on fp32 inputs
                # (bf16/fp16 values times 2^k never set that bit) and only where 0.25·X is a
                # normal number (S >= 3); below, the next float above 0.25·X is already > it.
                step = torch.where(scale >= 3, 2, 1)  # (S = 0 blocks are all ±0 anyway)
            t = t + step
        out.append(t.clamp(max=_INF).to(torch.int32))
    return out


def _times_pow2(exponent: torch.Tensor, mantissa, shift: torch.Tensor) -> torch.Tensor:
    """fp32 bits of (the normal fp32 with biased ``exponent`` and ``mantissa``) * 2^shift, exactly.

    Overflow gives +inf. A subnormal result is exact when the mantissa's low bits allow (always, for
    the few-bit values used here).
    """
    f = exponent + shift
    mantissa = torch.as_tensor(mantissa, dtype=f.dtype, device=f.device)
    normal = (f.clamp(min=1, max=254) << 23) | mantissa
    subnormal = (mantissa | 0x800000) >> (1 - f).clamp(min=0, max=31)
    return torch.where(f >= 255, _INF, torch.where(f >= 1, normal, subnormal))


# ---------------------------------------------------------------------------------------------------
# what the MXFP4 layouts share: the canonical block they encode, and their scales' bytes


def e8m0_bytes(s: torch.Tensor, layout: str) -> torch.Tensor:
    """A layout's stored e8m0 scales as their bytes (``float8_e8m0fnu`` or already ``uint8``)."""
    from moeconvert.errors import InternalError

    if s.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise InternalError(f"{layout} MXFP4 scales must be float8_e8m0fnu (or their uint8 bytes), not {s.dtype}")
    return s.view(torch.uint8)


def require_padded_block(block, shape) -> None:
    """The canonical MXFP4 block of a padded layer (``canonical.ExpertBlock`` and ``LayerShape``): packed
    e2m1 codes and e8m0 scale bytes of H x Ip, biases in the model dtype. An encoder given anything else is
    called wrongly (the planner pads), so this is an internal error, not a user's."""
    from moeconvert.errors import InternalError

    E, Hp, Ip = block.num_experts, shape.hidden_size, shape.intermediate_size
    want = {"w13": (E, 2 * Ip, Hp // 2), "w13_scale": (E, 2 * Ip, Hp // MXFP4_BLOCK_SIZE),
            "w2": (E, Hp, Ip // 2), "w2_scale": (E, Hp, Ip // MXFP4_BLOCK_SIZE)}
    if block.w13_bias is not None:
        want.update(w13_bias=(E, 2 * Ip), w2_bias=(E, Hp))
    for name, dims in want.items():
        t = getattr(block, name)
        if t is None or tuple(t.shape) != dims or (name[-4:] != "bias" and t.dtype != torch.uint8):
            found = None if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise InternalError(f"MXFP4 block {name} is {found}, the padded layer Hp={Hp} Ip={Ip} needs {dims} uint8")
