"""The ``triton-fast`` GEMM compiled ahead of time for sm_90 (Hopper) on any machine: Triton's own
compiler and its bundled ``ptxas``, no GPU. Every GPU-path variant of the kernel (each format's inline
PTX unpacking, zero points, scale forms, fp16 and bf16) must assemble, run its MMA as wgmma from
registers and keep its accumulators out of local memory; the numbers themselves are the GPU tests'
(tests/test_kernels_fast.py, ``-m gpu``). Skipped, with the reason, where the installed Triton has no
NVIDIA backend or no ``ptxas``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest


def _toolchain():
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return None, f"Triton's ahead-of-time compiler is not importable ({e})"
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bin_dir, "ptxas")):
        return None, f"the installed Triton {triton.__version__} bundles no ptxas"
    return bin_dir, ""


BIN_DIR, WHY = _toolchain()
pytestmark = pytest.mark.skipif(BIN_DIR is None, reason=WHY)

_POINTERS = ("a_ptr", "b_ptr", "s_ptr", "z_ptr", "bias_ptr", "c_ptr", "topk_weights_ptr", "sorted_ids_ptr",
             "expert_ids_ptr", "ntpp_ptr", "ws_ptr", "tile_count_ptr")


def compile_sm90(fmt: int, group: int, has_zp: bool, gated: bool, dtype: str, block: tuple[int, int, int],
                 warps: int, stages: int, operand_scale: bool = False, mx_fold: bool = False):
    """moe_gemm compiled for sm_90 as moe_fast.py launches it on the GPU path (FAST): (PTX, cubin
    resource usage line)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moeconvert.kernels.gemm import moe_gemm

    types = {"a_ptr": dtype, "b_ptr": "u8", "s_ptr": "u8" if fmt == 2 else dtype, "z_ptr": "u8", "bias_ptr": dtype,
             "c_ptr": dtype, "topk_weights_ptr": "fp32", "sorted_ids_ptr": "i32", "expert_ids_ptr": "i32",
             "ntpp_ptr": "i32", "ws_ptr": "fp32", "tile_count_ptr": "i32"}
    consts = dict(FMT=fmt, GROUP=group, HAS_ZP=has_zp, HAS_BIAS=fmt == 2, GATED=gated, ACT=1 if fmt == 2 else 0,
                  MUL_ROUTED_WEIGHT=not gated, A_ROW_DIV=8 if gated else 1, ATOMIC_ROW_DIV=0, SPLIT_K=1, FAST=True,
                  GROUP_DOTS=False, MX_FOLD=mx_fold, PAIR_BLOCKS=False,
                  compute_type=tl.bfloat16 if dtype == "bf16" else tl.float16, DOT_PRECISION="tf32",
                  BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2], GROUP_M=8, OPERAND_SCALE=operand_scale,
                  PDL=False)
    names = list(moe_gemm.arg_names)
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in _POINTERS:
            signature[name] = "*" + types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("alpha", "limit"):
            signature[name] = "fp32"
        else:  # Triton specializes integers that are multiples of 16 as such: the layer's sizes and strides are
            signature[name] = "i32"
            if name.startswith("stride") or name in ("N", "K", "EM", "up_offset"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(moe_gemm, signature, {(names.index(k),): v for k, v in consts.items()}, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps,
                                                                                   num_stages=stages))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(BIN_DIR, "cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([os.path.join(BIN_DIR, "cuobjdump"), "-sass", path], capture_output=True,
                              text=True, check=True).stdout
    return kernel.asm["ptx"], usage, sass


def k_loop(sass: str) -> list[str]:
    """The instructions of the kernel's K loop: the body of its longest backward branch."""
    at = {}
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            at[int(m.group(1), 16)] = m.group(2)
    longest = None
    for offset, text in at.items():
        m = re.search(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else offset
        if target < offset and (longest is None or offset - target > longest[1] - longest[0]):
            longest = (target, offset)
    return [] if longest is None else [at[o] for o in sorted(at) if longest[0] <= o <= longest[1]]


# (format, group, zero points, dtype, BLOCK_M x BLOCK_N x BLOCK_K, warps, stages, scale in the operand,
#  the PTX the variant must hold)
VARIANTS = [
    (0, 128, False, "bf16", (16, 64, 128), 4, 4, False, "lop3.b32"),
    (0, 128, False, "bf16", (128, 128, 64), 8, 4, True, "fma.rn.bf16x2"),
    (0, 32, True, "bf16", (16, 64, 128), 4, 4, False, "sub.rn.bf16x2"),  # several groups a step
    (0, 128, True, "bf16", (16, 64, 128), 4, 4, False, "lop3.b32"),  # one group a step
    (0, 32, True, "fp16", (64, 128, 64), 4, 4, False, "sub.rn.f16x2"),
    (1, 128, False, "bf16", (16, 64, 128), 4, 4, False, "sub.f32"),
    (1, 32, True, "bf16", (16, 64, 128), 4, 4, False, "prmt.b32"),  # codes as fp32 2^23 + u
    (1, 64, True, "fp16", (16, 64, 128), 4, 4, False, "sub.rn.f16x2"),
    (1, 128, False, "fp16", (128, 128, 64), 8, 4, True, "sub.f16x2"),
    (2, 32, False, "bf16", (16, 64, 64), 4, 4, False, "fma.rn.bf16x2"),
]


@pytest.mark.parametrize("fmt,group,zp,dtype,block,warps,stages,operand,needle", VARIANTS,
                         ids=[f"{('int4', 'int8', 'mxfp4')[v[0]]}-g{v[1]}{'-asym' if v[2] else ''}-{v[3]}-"
                              f"{'x'.join(map(str, v[4]))}{'-operand' if v[7] else ''}" for v in VARIANTS])
def test_gpu_path_assembles_for_sm90(fmt, group, zp, dtype, block, warps, stages, operand, needle):
    for gated in (True, False):
        ptx, usage, _ = compile_sm90(fmt, group, zp, gated, dtype, block, warps, stages, operand)
        assert "wgmma.mma_async" in ptx, "the MMA is not a wgmma"
        assert needle in ptx, f"no {needle} in the PTX: another unpacking path was taken"
        assert "STACK:0" in usage, f"local memory used (spills?): {usage.strip()}"


# The formats the heuristic serves, by family: (name, FMT, group, zero points, dtype)
HEURISTIC_FORMATS = [("int4-g128", 0, 128, False, "bf16"), ("int4-g32-asym", 0, 32, True, "bf16"),
                     ("int4-g128", 0, 128, False, "fp16"), ("int8-g128", 1, 128, False, "bf16"),
                     ("int8-g128-asym", 1, 128, True, "bf16"), ("int8-g128", 1, 128, False, "fp16"),
                     ("mxfp4", 2, 32, False, "bf16")]
# pairs an expert at which heuristic_configs changes tiles: 16-row, 32-row, 64-row, 128-row (two kinds)
HEURISTIC_PAIRS = (4, 16, 64, 128, 256)


def _triton_at_least(major: int, minor: int) -> bool:
    import triton

    return tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) >= (major, minor)


def _known(name: str, dtype: str, pairs: int):
    """The one tile known to reach local memory inside its K loop, with the Triton that does it."""
    if (name, dtype, pairs) == ("int8-g128", "fp16", 64) and BIN_DIR is not None and _triton_at_least(3, 9):
        return pytest.mark.xfail(strict=True, reason="Triton 3.9 spills int8 fp16 GEMM1 64x128x64 at 4 warps "
                                                     "(255 registers; 5 local loads a step); Triton 3.6 does not")
    return ()


@pytest.mark.parametrize("name,fmt,group,zp,dtype,pairs",
                         [pytest.param(*f, p, marks=_known(f[0], f[4], p), id=f"{f[0]}-{f[4]}-{p}pairs")
                          for f in HEURISTIC_FORMATS for p in HEURISTIC_PAIRS])
def test_the_heuristics_tiles_keep_the_k_loop_out_of_local_memory(name, fmt, group, zp, dtype, pairs):
    """A tile whose K loop reads or writes local memory pays for it at every step; what spills outside the
    loop (a few bytes of the epilogue's addresses, at 255 registers) costs once a tile and is allowed."""
    from moeconvert.kernels.configs import heuristic_configs

    # 1024 experts, top-1, M = pairs x 1024: ``pairs`` pairs an expert, and programs enough that K is not split
    c1, c2 = heuristic_configs(name, 1024, 1, 7168, 2048, pairs * 1024, num_sms=1)
    for gated, c in ((True, c1), (False, c2)):
        ptx, usage, sass = compile_sm90(fmt, group, zp, gated, dtype, (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]),
                                        c["num_warps"], c["num_stages"], bool(c.get("OPERAND_SCALE", 0)),
                                        mx_fold=fmt == 2)
        loop = k_loop(sass)
        assert sum("HGMMA" in op for op in loop) >= 2, f"no K loop of wgmma found in the SASS ({len(loop)} lines)"
        local = [op for op in loop if re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b", op)]
        assert not local, (f"{'GEMM1' if gated else 'GEMM2'} {c}: {len(local)} local-memory accesses in the K loop "
                           f"of {len(loop)} instructions ({usage.strip()})")
