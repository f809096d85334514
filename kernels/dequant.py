"""Dequantization of the fragment bytes (int4, MXFP4: 64-input atoms; int8: 32-input atoms) into the
swapped MMA's first operand.

Why this shape (one 16-byte load per thread and atom, unpacked in registers, no shuffle and no
integer-to-float conversion): docs/kernels.md, "A GEMM program" and "Dequantization, GPU"; the
fragment order itself: docs/layouts/triton-fast.md. Here: the inline PTX, generated once at import
(4-bit: one 32-bit word = 8 codes = 4 bf16x2 / f16x2 registers, register ``c`` = nibbles ``c`` and
``c + 4``; int8: one word = 4 codes = 2 registers), the portable path with the same values
(interpreter, fp32, ``MOECONVERT_PORTABLE_DEQUANT``; ``FAST`` selects, moe_fast.py decides), and the reshapes / permutes that turn a step's unpacked rows
into the ``[BLOCK_N, BLOCK_K]`` operand (resolved by the compiler to a renaming of registers).
"""

from __future__ import annotations

import triton
import triton.language as tl


def _shifted(dst: str, src: str, by: int) -> tuple[list[str], str]:
    """PTX lines putting src shifted left by ``by`` (right if negative) in dst, and the register that
    holds it (src itself, no line, when ``by`` is 0)."""
    if by == 0:
        return [], src
    return [f"shl.b32 {dst}, {src}, {by};" if by > 0 else f"shr.b32 {dst}, {src}, {-by};"], dst


def _i4_register(c: int) -> list[str]:
    lines, t = _shifted("t", "$4", -4 * c)
    return lines + [f"lop3.b32 ${c}, {t}, 0x000F000F, MAGIC, 0xEA;"]


def _mx_register(c: int) -> list[str]:
    """e2m1 bits s e1 e0 m at 4c+3, 4c+2..4c -> bf16 bits 15, 8..6 (and 31, 24..22 for the high half)."""
    mag, m = _shifted("m", "$4", 6 - 4 * c)
    sign, sg = _shifted("s", "$4", 12 - 4 * c)
    return mag + [f"and.b32 m, {m}, 0x01C001C0;"] + sign + [f"lop3.b32 ${c}, {sg}, 0x80008000, m, 0xEA;"]


# register c of a word holds nibbles c (bits 4c..) and c + 4 (bits 16 + 4c..), one per 16-bit half.
# int4: lop3 ORs the nibble into the mantissa of 128.0 (bf16 0x4300) / 1024.0 (fp16 0x6400), one fma
# subtracts 136 / 1032: q - 8, exact. MXFP4: the sign and e1 e0 m bits at the bf16 positions are the
# value * 2^-126 (exact, subnormals included), one fma times 2^126 (exact).
_I4_ASM = "\n".join(["{", ".reg .b32 t, one, nb;", "mov.b32 one, ONE;", "mov.b32 nb, NEGBIAS;"]
                     + [x for c in range(4) for x in _i4_register(c)]
                     + [f"fma.rn.T ${c}, ${c}, one, nb;" for c in range(4)] + ["}"])
_MX_BITS = [x for c in range(4) for x in _mx_register(c)]
_MX_ASM = "\n".join(["{", ".reg .b32 m, s, c, nz;", "mov.b32 c, 0x7E807E80;", "mov.b32 nz, 0x80008000;"] + _MX_BITS
                     + [f"fma.rn.bf16x2 ${c}, ${c}, c, nz;" for c in range(4)] + ["}"])
# the bits alone: value * 2^-126 (MX_FOLD: the 2^126 is folded into the scale)
_MX_RAW_ASM = "\n".join(["{", ".reg .b32 m, s;"] + _MX_BITS + ["}"])
# the nibbles alone: MAGIC + u (asymmetric layers subtract MAGIC + z instead: u - z, exact)
_I4_RAW_ASM = "\n".join(["{", ".reg .b32 t;"] + [x for c in range(4) for x in _i4_register(c)] + ["}"])
# operands: $0..$3 out (the two results' 4 x 16 bits each), $4 the 4 code bytes
_ASM_I4_BF16 = tl.constexpr(_I4_ASM.replace("ONE", "0x3F803F80").replace("NEGBIAS", "0xC308C308")
                            .replace("MAGIC", "0x43004300").replace(".T", ".bf16x2"))
_ASM_I4_F16 = tl.constexpr(_I4_ASM.replace("ONE", "0x3C003C00").replace("NEGBIAS", "0xE408E408")
                           .replace("MAGIC", "0x64006400").replace(".T", ".f16x2"))
_ASM_I4_RAW_BF16 = tl.constexpr(_I4_RAW_ASM.replace("MAGIC", "0x43004300"))
_ASM_I4_RAW_F16 = tl.constexpr(_I4_RAW_ASM.replace("MAGIC", "0x64006400"))
# (MAGIC + u) - (MAGIC + z), times the scale, on pairs of one row and group: $1 the codes, $2 the zero
# points and $3 the scales, each pair one value twice
_ASM_SUB_MUL_BF16 = tl.constexpr("{ .reg .b32 t; sub.rn.bf16x2 t, $1, $2; mul.rn.bf16x2 $0, t, $3; }")
_ASM_SUB_MUL_F16 = tl.constexpr("{ .reg .b32 t; sub.rn.f16x2 t, $1, $2; mul.rn.f16x2 $0, t, $3; }")
_ASM_MX = tl.constexpr(_MX_ASM)
_ASM_MX_RAW = tl.constexpr(_MX_RAW_ASM)
_C_ASM: tl.constexpr = tl.constexpr("=r,=r,=r,=r,r")

# int8: a 32-bit word = 4 codes u = q + 128 = 2 bf16x2 / f16x2 registers (bytes 0, 1 and 2, 3). bf16 (8
# significant bits) holds q exactly but not 2^k + u, so each byte goes through fp32: prmt puts it under
# the exponent of 2^23 (0x4B0000uu = 2^23 + u), one sub of 2^23 + 128 leaves q exactly, and a prmt
# keeps the two upper halves (q is a bf16 number, so that truncation is exact): 10 instructions a
# word. fp16 holds 1024 + u (11 significant bits): prmt puts two bytes under 0x64 (1024 + u each), one
# sub.f16x2 of 1152: 4 instructions a word.
_I8_BF16_ASM = "\n".join(
    ["{", ".reg .b32 f0, f1, f2, f3, m;", "mov.b32 m, 0x4B000000;"]
    + [f"prmt.b32 f{j}, $2, m, 0x{0x7440 + j:04X};" for j in range(4)]
    + [f"sub.f32 f{j}, f{j}, 0f4B000080;" for j in range(4)]
    + ["prmt.b32 $0, f0, f1, 0x7632;", "prmt.b32 $1, f2, f3, 0x7632;", "}"])
_I8_F16_ASM = "\n".join(
    ["{", ".reg .b32 m, b;", "mov.b32 m, 0x64646464;", "mov.b32 b, 0x64806480;",
     "prmt.b32 $0, $2, m, 0x4140;", "prmt.b32 $1, $2, m, 0x4342;",
     "sub.f16x2 $0, $0, b;", "sub.f16x2 $1, $1, b;", "}"])
# the codes alone (asymmetric layers subtract MAGIC + z, u - z being exact in fp32 and fp16): bf16 layers
# take each byte as the fp32 2^23 + u (a prmt a code), fp16 ones as the f16x2 1024 + u (a prmt a pair)
_I8_RAW_F32_ASM = "\n".join(["{", ".reg .b32 m;", "mov.b32 m, 0x4B000000;"]
                             + [f"prmt.b32 ${j}, $4, m, 0x{0x7440 + j:04X};" for j in range(4)] + ["}"])
_I8_RAW_F16_ASM = "\n".join(["{", ".reg .b32 m;", "mov.b32 m, 0x64646464;",
                              "prmt.b32 $0, $2, m, 0x4140;", "prmt.b32 $1, $2, m, 0x4342;", "}"])
_ASM_I8_RAW_F32 = tl.constexpr(_I8_RAW_F32_ASM)
_ASM_I8_RAW_F16 = tl.constexpr(_I8_RAW_F16_ASM)
_ASM_I8_BF16 = tl.constexpr(_I8_BF16_ASM)
_ASM_I8_F16 = tl.constexpr(_I8_F16_ASM)
_C_ASM_I8: tl.constexpr = tl.constexpr("=r,=r,r")


@triton.jit
def i4_magic(FAST: tl.constexpr, compute_type: tl.constexpr):
    """What ``unpack_fragments(..., RAW=True)`` adds to an int4 code u: 128 (1024 for fp16 on the GPU path)."""
    return 1024.0 if FAST and compute_type == tl.float16 else 128.0


@triton.jit
def unpack_fragments(raw, FMT: tl.constexpr, FAST: tl.constexpr, compute_type: tl.constexpr,
                     RAW: tl.constexpr = False):
    """Fragment bytes [R, B] -> values [R, B, 2] in compute_type: element (r, kt * 4 + h * 2 + e, kh)
    is nibble 2 kh + h + 4 e of the row's 32-bit word kt (int4: q - 8, with ``RAW`` the code u = q + 8
    plus ``i4_magic``; MXFP4: the e2m1 value, with ``RAW`` on the GPU path the value * 2^-126)."""
    if FAST:
        if FMT == 2 and RAW:
            lo, hi = tl.inline_asm_elementwise(_ASM_MX_RAW, _C_ASM, [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        elif FMT == 2:
            lo, hi = tl.inline_asm_elementwise(_ASM_MX, _C_ASM, [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        elif compute_type == tl.float16:
            lo, hi = tl.inline_asm_elementwise(_ASM_I4_RAW_F16 if RAW else _ASM_I4_F16, _C_ASM, [raw],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_ASM_I4_RAW_BF16 if RAW else _ASM_I4_BF16, _C_ASM, [raw],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        v = tl.join(lo, hi)
    else:
        R: tl.constexpr = raw.shape[0]
        B: tl.constexpr = raw.shape[1]
        b = raw.to(tl.int32).reshape(R, B // 4, 2, 2)  # word kt, byte 2 e + kh
        c = tl.join(b & 15, b >> 4)  # [R, kt, e, kh, h]
        if FMT == 2:  # e2m1 -> fp16 bits s 000 0ee m 000000000 = value * 2^-14, exact
            h16 = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
            val = h16.to(tl.float32) * 16384.0
        elif RAW:
            val = c.to(tl.float32) + i4_magic(FAST, compute_type)
        else:
            val = (c - 8).to(tl.float32)
        v = tl.permute(val, (0, 1, 4, 2, 3)).reshape(R, B, 2).to(compute_type)
    return v


@triton.jit
def sub_mul(w, z, s, FAST: tl.constexpr, compute_type: tl.constexpr):
    """(w - z) * s, each rounded to compute_type (w - z exact here). On the GPU path in inline PTX on
    the operand's own register pairs: left to the compiler, the product is paired along the scale
    tile's rows and every pair is permuted twice (2 extra instructions a pair, sm_90)."""
    if FAST and compute_type == tl.float16:
        return tl.inline_asm_elementwise(_ASM_SUB_MUL_F16, "=r,r,r,r", [w, z, s], dtype=tl.float16, is_pure=True,
                                         pack=2)
    elif FAST:
        return tl.inline_asm_elementwise(_ASM_SUB_MUL_BF16, "=r,r,r,r", [w, z, s], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)
    else:
        return (w - z) * s


@triton.jit
def i8_magic(FAST: tl.constexpr, compute_type: tl.constexpr):
    """What ``unpack_int8(..., RAW=True)`` adds to an int8 code u: 2^23 for bf16 (in fp32), 1024 for fp16
    on the GPU path, 0 on the portable one."""
    if not FAST:
        return 0.0
    elif compute_type == tl.float16:
        return 1024.0
    else:
        return 8388608.0


@triton.jit
def unpack_int8(raw, FAST: tl.constexpr, compute_type: tl.constexpr, RAW: tl.constexpr = False):
    """int8 fragment bytes [R, 16] (u = q + 128) -> q [R, 16] in compute_type, exact (bf16, fp16, fp32);
    with ``RAW`` the code u plus ``i8_magic``, in fp32 for a bf16 layer (u - z needs 9 bits)."""
    if RAW and compute_type == tl.bfloat16:
        if FAST:
            q = tl.inline_asm_elementwise(_ASM_I8_RAW_F32, "=r,=r,=r,=r,r", [raw], dtype=tl.float32, is_pure=True,
                                          pack=4)
        else:
            q = raw.to(tl.float32)
    elif RAW:
        if FAST and compute_type == tl.float16:
            q = tl.inline_asm_elementwise(_ASM_I8_RAW_F16, _C_ASM_I8, [raw], dtype=tl.float16, is_pure=True, pack=4)
        else:
            q = raw.to(tl.float32).to(compute_type)
    elif FAST and compute_type == tl.float16:
        q = tl.inline_asm_elementwise(_ASM_I8_F16, _C_ASM_I8, [raw], dtype=tl.float16, is_pure=True, pack=4)
    elif FAST:
        q = tl.inline_asm_elementwise(_ASM_I8_BF16, _C_ASM_I8, [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        q = (raw.to(tl.int32) - 128).to(tl.float32).to(compute_type)
    return q


@triton.jit
def fragment_operand8(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int8 [R, 16] values of the rows (k atom, n atom, lane g * 4 + t) -> the [BLOCK_N, BLOCK_K] tile:
    byte 8 kt + 4 kh + 2 h + e of a lane is n = n_atom * 16 + h * 8 + g, k = k_atom * 32 + kt * 16 +
    kh * 8 + t * 2 + e."""
    v = v.reshape(BLOCK_K // 32, BLOCK_N // 16, 8, 4, 2, 2, 2, 2)  # ka, na, g, t, kt, kh, h, e
    v = tl.permute(v, (1, 6, 2, 0, 4, 5, 3, 7))  # na, h, g, ka, kt, kh, t, e
    return v.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def fragment_operand(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[R, 16, 2] values of the rows (k atom, n atom, lane g * 4 + t) -> the [BLOCK_N, BLOCK_K] tile:
    n = n_atom * 16 + h * 8 + g, k = k_atom * 64 + kt * 16 + kh * 8 + t * 2 + e."""
    v = v.reshape(BLOCK_K // 64, BLOCK_N // 16, 8, 4, 4, 2, 2, 2)  # ka, na, g, t, kt, h, e, kh
    v = tl.permute(v, (1, 5, 2, 0, 4, 7, 3, 6))  # na, h, g, ka, kt, kh, t, e
    return v.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def half_operand(v, BLOCK_N: tl.constexpr):
    """[NA * 32, 8, 2] values of one 32-input half of an atom (its words kt = 2 half + j) -> the
    [BLOCK_N, 32] tile: n = n_atom * 16 + h * 8 + g, k = j * 16 + kh * 8 + t * 2 + e."""
    v = v.reshape(BLOCK_N // 16, 8, 4, 2, 2, 2, 2)  # na, g, t, j, h, e, kh
    v = tl.permute(v, (0, 4, 1, 3, 6, 2, 5))  # na, h, g, j, kh, t, e
    return v.reshape(BLOCK_N, 32)
