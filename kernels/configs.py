"""Default tile configs of the fused WNA16 MoE kernel, by the number of tokens M.

UNTUNED: these are starting points in the spirit of vLLM's defaults for its WNA16 Triton kernel
(small BLOCK_M for decode, larger tiles for prefill), not measured on any GPU. A tuning table per
(E, N, K, bits, GPU) and ``moeconvert bench kernel`` are still to come (docs/kernels.md).
"""

from __future__ import annotations

# (largest M, config): the first row whose bound is >= M is used
_DEFAULTS = [
    (32, dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)),
    (256, dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)),
]


def get_config(M: int, num_experts: int, top_k: int) -> dict:
    """The default config for ``M`` tokens (``num_experts`` and ``top_k`` unused until there is a table)."""
    for bound, cfg in _DEFAULTS:
        if bound is None or M <= bound:
            return dict(cfg)
    raise AssertionError("unreachable")
