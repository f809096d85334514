"""Triton helpers both fused-MoE GEMMs use (moe_fast.py, moe_wna16.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_program_tile(pid, EM, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid``: GROUP_M row blocks side by side walk the same
    column blocks, so the weight tiles they share are still in L2."""
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % (GROUP_M * num_pid_n)) % group_rows)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows
    return pid_m, pid_n
