"""Tile configs of the fused-MoE kernels: a tuned table per GPU, else a heuristic.

``triton-fast`` (moe_fast.py): :func:`get_configs` gives the (GEMM1, GEMM2) configs of one layer call,
keys ``BLOCK_M BLOCK_N BLOCK_K GROUP_M SPLIT_K num_warps num_stages`` (both GEMMs share BLOCK_M: they
share one alignment; a split-K GEMM1's last split of a tile sums the partials and runs the epilogue).

Tables are JSON files written by ``moeconvert bench kernel --tune`` or the opt-in tune on first use
(kernels/tune.py), merged by :func:`write_table`::

    {"device": "NVIDIA H200", "triton": "3.6.0", "entries": {
        "int4/g128 E=128 k=8 H=2048 I=768": {"1": [cfg1, cfg2], "16": [...], ...}, ...}}

Looked up, first hit wins: ``$MOECONVERT_KERNEL_CONFIGS`` (a file), the user's
``~/.cache/moeconvert/kernel-configs/<device>.json`` (what ``--tune`` writes by default), the table
shipped in ``kernels/tuned/<device>.json``. Within an entry the tuned M nearest to the call's M (on a
log scale) is used. A layer with no entry gets :func:`heuristic_configs`.

``triton`` (moe_wna16.py, vLLM's own Triton layout): :func:`get_config`, a default by M (untuned).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

ENV_TABLE = "MOECONVERT_KERNEL_CONFIGS"
SHIPPED = Path(__file__).resolve().parent / "tuned"


def device_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200`` (file names of the tables)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def user_table_path(device_name: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "moeconvert" / "kernel-configs" / f"{device_slug(device_name)}.json"


def entry_key(fmt: str, group: int, E: int, top_k: int, H: int, I: int) -> str:
    g = "mx32" if fmt == "mxfp4" else ("gch" if group <= 0 else f"g{group}")
    return f"{fmt}/{g} E={E} k={top_k} H={H} I={I}"


@functools.lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{path}: a kernel config table needs an 'entries' object")
    return data["entries"]


def _tables(device_name: str) -> list[Path]:
    out = []
    env = os.environ.get(ENV_TABLE)
    if env:
        out.append(Path(env))
    out += [user_table_path(device_name), SHIPPED / f"{device_slug(device_name)}.json"]
    return [p for p in out if p.is_file()]


def lookup(key: str, M: int, device_name: str) -> tuple[dict, dict] | None:
    """The tuned (GEMM1, GEMM2) configs for ``key`` nearest to ``M``, or None.

    Answers are kept per (``$MOECONVERT_KERNEL_CONFIGS``, key, M, device) for the process: finding the
    tables costs file-system calls, tens of µs, as much as a decode layer's kernels. ``clear_cache()``
    (``bench kernel --tune`` calls it after writing) makes the next call read the tables again."""
    hit = _lookup(os.environ.get(ENV_TABLE), key, M, device_name)
    return None if hit is None else (dict(hit[0]), dict(hit[1]))


@functools.lru_cache(maxsize=4096)
def _lookup(env: str | None, key: str, M: int, device_name: str) -> tuple[dict, dict] | None:
    for path in _tables(device_name):
        entry = _load(str(path), path.stat().st_mtime).get(key)
        if entry:
            best = min(entry, key=lambda m: abs(math.log(int(m)) - math.log(max(M, 1))))
            c1, c2 = entry[best]
            return dict(c1), dict(c2)
    return None


def has_entry(key: str, device_name: str) -> bool:
    """A table the kernel reads for ``device_name`` has ``key`` (read now, not from the process's cache)."""
    return any(_load(str(p), p.stat().st_mtime).get(key) for p in _tables(device_name))


def clear_cache() -> None:
    _lookup.cache_clear()


def write_table(path, device_name: str, entries: dict) -> None:
    """Merge ``entries`` into the table at ``path`` (other layers' entries kept), atomically, under a lock
    file beside it: the ranks of one model may tune the same GPU's table at once."""
    import fcntl

    import triton

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = {"device": device_name, "triton": triton.__version__, "entries": {}}
        if path.is_file():
            try:
                data["entries"] = dict(json.loads(path.read_text()).get("entries", {}))
            except (OSError, json.JSONDecodeError, AttributeError):
                pass  # an unreadable table is replaced by the entries written now
        data["entries"].update(entries)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    clear_cache()


def heuristic_configs(fmt: str, E: int, top_k: int, H: int, I: int, M: int, num_sms: int = 132) -> tuple[dict, dict]:
    """Tiles from the expected pairs per expert (uniform routing), for GPUs or shapes with no table."""
    # decode: what --tune picked on the H200 for the bench shapes (kernels/tuned/nvidia-h200.json); from
    # 48 pairs an expert on: the fastest of the tiles timed side by side on an H100 at M = 1024 and 4096
    # (docs/kernels.md, "Prefill: tiles and the scale form side by side"), integer scales in the operand
    per_expert = M * top_k / E
    # 16-row blocks while an expert's pairs rarely need a second one: the H200's --tune kept 16 rows at 8
    # pairs an expert and took 32 at 16 (Qwen3-30B-A3B, Qwen3-235B-A22B at M = 256, Mixtral at M = 64)
    bm = 16 if per_expert < 12 else 32 if per_expert <= 48 else 64 if per_expert < 80 else 128
    small = bm <= 32
    if small:  # weight streaming, 4 stages: GEMM1 64 x 128 (columns x inputs), GEMM2 128 columns (MXFP4
        # 128 x 64), what --tune picked at 14 of the 16 int4 points M <= 256 and for gpt-oss at M = 64, 256
        c1 = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=4)
        c2 = dict(c1, BLOCK_N=128, BLOCK_K=64 if fmt == "mxfp4" else 128)
    elif bm == 64:  # 48-80 pairs an expert: 64 x 128 x 64 tiles, 4 stages, both GEMMs
        c1 = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4,
                  OPERAND_SCALE=1)
        c2 = dict(c1)
    elif per_expert >= 192:  # MMA-bound, many pairs an expert: wide GEMM1 steps, narrow GEMM2 tiles
        c1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64 if fmt == "mxfp4" else 128, GROUP_M=8, SPLIT_K=1,
                  num_warps=8, num_stages=3, OPERAND_SCALE=1)
        c2 = dict(c1, BLOCK_N=64, BLOCK_K=64, num_warps=4)
    else:  # 80-192 pairs an expert (large experts: DeepSeek-V3, Kimi-K2 at M = 4096): deeper GEMM1, wide GEMM2
        c1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=4,
                  OPERAND_SCALE=1)
        c2 = dict(c1, BLOCK_N=256, num_stages=3)
    # split K when the blocks x column tiles would leave SMs idle (GEMM1: N = I, K = H; GEMM2: N = H, K = I),
    # into enough parts for twice the SMs, rounded up: where the H200's --tune kept these column tiles it
    # split at least that much (of 1, 2, 4; DeepSeek-V3 GEMM1 at M = 1: 256 programs, split 2; Mixtral
    # GEMM2 at M = 16: 256, 2), docs/kernels.md "Split-K rounds up"
    blocks = min(E, M * top_k)
    for c, n, k, most in ((c1, I, H, 4), (c2, H, I, 8)):
        programs = blocks * math.ceil(n / c["BLOCK_N"])
        if small and programs < 2 * num_sms:
            steps = max(1, k // c["BLOCK_K"])
            c["SPLIT_K"] = max(1, min(most, math.ceil(2 * num_sms / max(programs, 1)), steps))
    return c1, c2


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[str, int]:
    import torch

    p = torch.cuda.get_device_properties(index)
    return p.name, p.multi_processor_count


def get_configs(fmt: str, E: int, top_k: int, *, H: int, I: int, M: int, group: int = 0,
                device=None) -> tuple[dict, dict]:
    """(GEMM1, GEMM2) configs for one call on ``device`` (a torch device; CPU: the heuristic)."""
    name, sms = ("cpu", 132)
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        name, sms = _device_facts(device.index if device.index is not None else 0)
        hit = lookup(entry_key(fmt, group, E, top_k, H, I), M, name)
        if hit is not None:
            return hit
    return heuristic_configs(fmt, E, top_k, H, I, M, sms)


# ---------------------------------------------------------------------------------------------------
# the ``triton`` layout's kernel (moe_wna16.py)

# (largest M, config): the first row whose bound is >= M is used
_DEFAULTS = [
    (32, dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)),
    (256, dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)),
]


def get_config(M: int, num_experts: int, top_k: int) -> dict:
    """The ``triton`` layout kernel's default config for ``M`` tokens (untuned; ``num_experts`` and
    ``top_k`` unused)."""
    for bound, cfg in _DEFAULTS:
        if bound is None or M <= bound:
            return dict(cfg)
    raise AssertionError("unreachable")
