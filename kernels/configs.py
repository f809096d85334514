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

from moeconvert.errors import MoeConvertError

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


# ---------------------------------------------------------------------------------------------------
# what a table accepts (docs/kernels.md, "What a table accepts"): checked once per file version, so
# nothing a table holds reaches Triton unchecked

#: a tile config's keys: the value the kernel takes when one is left out (None: required), and what a
#: value must be (``moe_fast.launch_gemm`` passes each to the GEMM; ``gemm.py`` reads them as constexprs)
TILE_KEYS = {"BLOCK_M": None, "BLOCK_N": None, "BLOCK_K": None, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
             "num_stages": 3, "OPERAND_SCALE": 0, "GROUP_DOTS": 0}
_POW2 = {
    # tl.arange and tl.dot need powers of two; 16 is the smallest MMA tile side, 256 the widest tile
    # the sweep tries (kernels/tune.py)
    "BLOCK_M": ((16, 32, 64, 128, 256), "a power of two from 16 to 256"),
    "BLOCK_N": ((16, 32, 64, 128, 256), "a power of two from 16 to 256"),
    "BLOCK_K": ((16, 32, 64, 128, 256), "a power of two from 16 to 256"),
    # Triton takes a power of two; a CUDA block holds at most 32 warps (1024 threads)
    "num_warps": ((1, 2, 4, 8, 16, 32), "a power of two from 1 to 32"),
}
_FLAGS = ("OPERAND_SCALE", "GROUP_DOTS")
_AT_LEAST_ONE = ("GROUP_M", "SPLIT_K", "num_stages")
#: the smallest BLOCK_K of each format: weights are read in whole fragment atoms (moe_fast.FastWeights)
MIN_BLOCK_K = {"int4": 64, "mxfp4": 64, "int8": 32}
#: an entry's key (:func:`entry_key`): the format and its group, the experts held, top-k, w13's K, w2's K
_ENTRY_KEY = re.compile(r"(?:(int4|int8)/(?:g[1-9][0-9]*|gch)|(mxfp4)/mx32) E=[1-9][0-9]* k=[1-9][0-9]* "
                        r"H=[1-9][0-9]* I=[1-9][0-9]*")
_TOKENS = re.compile(r"[1-9][0-9]*")
_TABLE_KEYS = ("device", "triton", "entries")


def _refuse(why: str, where: str, expected, found, path=None):
    raise MoeConvertError(why, file=None if path is None else str(path), tensor=where, expected=expected,
                          found=json.dumps(found)[:80] if not isinstance(found, str) else found)


def check_config(cfg, fmt: str | None = None, where: str = "config", path=None) -> None:
    """Refuse (MoeConvertError, one line naming ``where``) a tile config the kernel cannot run: unknown or
    missing keys, values that are not integers, tiles that are not powers of two or not whole weight
    atoms of ``fmt`` (None: the format-free checks only)."""
    if not isinstance(cfg, dict):
        _refuse("a tile config is a JSON object", where, "{\"BLOCK_M\": ..., ...}", cfg, path)
    for key in cfg:
        if key not in TILE_KEYS:
            _refuse("unknown tile config key", f"{where}.{key}", " ".join(TILE_KEYS), key, path)
    for key, default in TILE_KEYS.items():
        if key not in cfg:
            if default is None:
                _refuse("a tile config needs its tile sizes", where, "BLOCK_M, BLOCK_N, BLOCK_K", f"no {key}", path)
            continue
        v = cfg[key]
        if type(v) is not int:  # JSON true, 16.0 or "16" are not what the kernel's constexprs take
            _refuse("a tile config value is an integer", f"{where}.{key}", "an integer", v, path)
        if key in _POW2 and v not in _POW2[key][0]:
            _refuse("the kernel cannot run this tile", f"{where}.{key}", _POW2[key][1], v, path)
        if key in _FLAGS and v not in (0, 1):
            _refuse("the kernel cannot run this tile", f"{where}.{key}", "0 or 1", v, path)
        if key in _AT_LEAST_ONE and v < 1:
            _refuse("the kernel cannot run this tile", f"{where}.{key}", ">= 1", v, path)
    if cfg.get("GROUP_DOTS", 0) and cfg["BLOCK_K"] > 128:  # gemm.py: one or two atom columns a step
        _refuse("the kernel cannot run this tile", f"{where}.BLOCK_K", "<= 128 with GROUP_DOTS = 1",
                cfg["BLOCK_K"], path)
    if fmt is not None and cfg["BLOCK_K"] < MIN_BLOCK_K[fmt]:
        _refuse(f"{fmt} weights are read in {MIN_BLOCK_K[fmt]}-input fragment atoms", f"{where}.BLOCK_K",
                f">= {MIN_BLOCK_K[fmt]}", cfg["BLOCK_K"], path)


def check_pair(pair, fmt: str | None = None, where: str = "pair", path=None) -> None:
    """(GEMM1, GEMM2) configs: two valid configs with one BLOCK_M (the two GEMMs share one alignment)."""
    if not (isinstance(pair, list | tuple) and len(pair) == 2):
        _refuse("a config pair is a list of two objects (GEMM1, GEMM2)", where, "[{...}, {...}]", pair, path)
    for which, cfg in zip(("GEMM1", "GEMM2"), pair):
        check_config(cfg, fmt, f"{where} {which}", path)
    if pair[0]["BLOCK_M"] != pair[1]["BLOCK_M"]:
        _refuse("the two GEMMs share one alignment", where, "one BLOCK_M",
                f"{pair[0]['BLOCK_M']} and {pair[1]['BLOCK_M']}", path)


def check_entry(key, entry, path=None) -> None:
    """One layer's entry: a key as :func:`entry_key` writes it, and ``{"M": [GEMM1, GEMM2], ...}`` with M
    a positive token count in decimal digits."""
    m = _ENTRY_KEY.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        _refuse("an entry's key names one layer shape", f"entries[{key!r}]",
                "'int4/g128 E=128 k=8 H=2048 I=768' (int4 | int8 with g<N> | gch; mxfp4/mx32)", key, path)
    fmt = m.group(1) or m.group(2)
    if not isinstance(entry, dict) or not entry:
        _refuse("an entry maps token counts to config pairs", f"entries[{key!r}]", '{"1": [{...}, {...}], ...}',
                entry, path)
    for tokens, pair in entry.items():
        if not (isinstance(tokens, str) and _TOKENS.fullmatch(tokens)):
            _refuse("an entry's token count is a positive integer in digits", f"entries[{key!r}][{tokens!r}]",
                    '"1", "16", "4096"', tokens, path)
        check_pair(pair, fmt, f"entries[{key!r}][{tokens!r}]", path)


def check_table(data, path=None) -> dict:
    """A whole table (every entry, :func:`check_entry`); returns its entries."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        _refuse("a kernel config table is an object with an 'entries' object", "entries",
                '{"device": ..., "triton": ..., "entries": {...}}', data if not isinstance(data, dict) else
                data.get("entries"), path)
    for key in data:
        if key not in _TABLE_KEYS:
            _refuse("unknown table key", key, " ".join(_TABLE_KEYS), key, path)
    for key, entry in data["entries"].items():
        check_entry(key, entry, path)
    return data["entries"]


def _read_json(path: Path):
    """The table file's JSON; MoeConvertError naming the file if it cannot be read or parsed."""
    try:
        return json.loads(path.read_bytes().decode())
    except OSError as e:
        _refuse("cannot read the kernel config table", "table", None, e.strerror or str(e), path)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # a truncated or binary file
        _refuse("the kernel config table is not valid JSON", "table", "a JSON object", str(e), path)


@functools.lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> dict:
    """The entries of the table at ``path`` (checked whole; kept per file version)."""
    try:
        return check_table(_read_json(Path(path)), path)
    except MoeConvertError as e:
        raise MoeConvertError(f"{e.what()}; fix or delete the table (bench kernel --tune writes a new one)",
                              file=e.file, tensor=e.tensor) from None


def named_table() -> Path | None:
    """``$MOECONVERT_KERNEL_CONFIGS``: unset or empty, None; else a table file, which must exist."""
    env = os.environ.get(ENV_TABLE, "")
    if not env:
        return None
    if not Path(env).is_file():
        raise MoeConvertError("names no file", tensor=ENV_TABLE, expected="a kernel config table (JSON file), or unset",
                              found=env)
    return Path(env)


def _tables(device_name: str) -> list[Path]:
    out = [p for p in (named_table(),) if p is not None]
    out += [p for p in (user_table_path(device_name), SHIPPED / f"{device_slug(device_name)}.json") if p.is_file()]
    return out


def lookup(key: str, M: int, device_name: str) -> tuple[dict, dict] | None:
    """The tuned (GEMM1, GEMM2) configs for ``key`` nearest to ``M``, or None.

    Answers are kept per (``$MOECONVERT_KERNEL_CONFIGS``, key, M, device) for the process: finding the
    tables costs file-system calls, tens of µs, as much as a decode layer's kernels. ``clear_cache()``
    (``bench kernel --tune`` calls it after writing) makes the next call read the tables again. A table
    that breaks :func:`check_table` is refused whole (MoeConvertError naming the file and the key)."""
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


def check_writable(path) -> None:
    """Refuse, before a sweep, a table path whose folder cannot be written (the sweep's result would be lost)."""
    import tempfile

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not path.is_file():
            raise IsADirectoryError(f"{path} is not a file")
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise MoeConvertError("cannot write the tuned table there", file=str(path), tensor="table",
                              expected="a writable folder", found=e.strerror or str(e)) from None


def _kept_entries(path: Path, log) -> dict:
    """The entries of the table already at ``path`` that pass :func:`check_entry`; what is dropped is said."""
    if not path.is_file():
        return {}
    try:
        data = _read_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            _refuse("a kernel config table is an object with an 'entries' object", "entries", None, None, path)
    except MoeConvertError as e:
        log(f"replacing the unreadable table {path} ({e.what()})")
        return {}
    kept = {}
    for key, entry in data["entries"].items():
        try:
            check_entry(key, entry, path)
            kept[key] = entry
        except MoeConvertError as e:
            log(f"dropping an entry the kernel cannot run from {path}: {e.tensor}: {e.what()}")
    return kept


def write_table(path, device_name: str, entries: dict, log=print) -> None:
    """Merge ``entries`` into the table at ``path`` (other layers' valid entries kept; an unreadable table
    or entry is replaced, and said so through ``log``), atomically (a temporary file renamed over it),
    under a lock file beside it: the ranks of one model may tune the same GPU's table at once."""
    import fcntl

    import triton

    for key, entry in entries.items():
        check_entry(key, entry, path)
    path = Path(path)
    check_writable(path)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = {"device": device_name, "triton": triton.__version__, "entries": _kept_entries(path, log)}
        data["entries"].update(entries)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
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
