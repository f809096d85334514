"""Programmatic dependent launch for the kernels of one ``fused_moe_fast`` call (align, GEMM1, GEMM2).

Why, and the H200 figures that decide where it is on (not for one token's GEMMs): docs/kernels.md,
"Programmatic dependent launch". Every kernel calls :func:`kernel_start` first; its launch takes
:func:`launch_options`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper on): the next kernel is scheduled while this one runs
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: kernels are launched one after the other
    gdc_launch_dependents = gdc_wait = None

ENV_NO_PDL = "MOECONVERT_NO_PDL"  # set: no programmatic dependent launch (to compare)


@triton.jit
def kernel_start(PDL: tl.constexpr):
    """With programmatic dependent launch (``PDL``), every kernel of a layer call first lets the next
    one be scheduled, then waits until the one before has finished and its writes are visible. So the
    next kernel's programs start while this one's last wave runs, and no kernel touches memory before
    its predecessor is done (each one waits, so the order of all writes and reads stays the stream's)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def launch_options(device: torch.device, wanted: bool = True) -> dict:
    """The launch option: programmatic dependent launch on CUDA devices of compute capability 9 on
    (not under the interpreter, not with ``MOECONVERT_NO_PDL`` set). ``wanted`` False: one token's
    GEMMs (pair blocks), latency-bound, measured slower with it."""
    on = (wanted and device.type == "cuda" and gdc_wait is not None and os.environ.get("TRITON_INTERPRET") != "1"
          and not os.environ.get(ENV_NO_PDL) and _capability(device.index or 0) >= 9)
    return {"PDL": on, "launch_pdl": on}
