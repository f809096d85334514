"""``moeconvert bench``: measurements users can rerun on their own machines.

``bench convert`` times whole-process conversions (``python -m moeconvert repack|quantize ...``, a
fresh interpreter each, as a user runs them) interleaved with ``cp -r`` of the same source folder, so
that both see the same machine state; it reports per-run times, the median of the per-pair ratios, and
each conversion's peak RSS (from ``wait4``). Each pair also times the same command with ``--dry-run
--no-estimate`` (interpreter start, imports, reading headers and planning, no tensor bytes): the fixed cost a
conversion pays whatever its size, reported so that small inputs are read right.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moeconvert.errors import MoeConvertError


@dataclass
class Run:
    seconds: float
    peak_rss: int  # bytes


def _timed(cmd: list[str]) -> Run:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise MoeConvertError(f"benchmark command failed (exit {code}): {' '.join(cmd)}: "
                              f"{stderr.strip().splitlines()[-1] if stderr.strip() else ''}")
    return Run(dt, usage.ru_maxrss * 1024)


def _folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def bench_convert(src: Path, backend: str, fmt: str | None, runs: int, extra: list[str],
                  workdir: Path | None = None) -> dict:
    """``runs`` pairs of (conversion, cp -r) on ``src``; returns the figures."""
    if not src.is_dir():
        raise MoeConvertError("bench convert needs a local checkpoint folder", file=str(src))
    base = Path(tempfile.mkdtemp(prefix="moeconvert-bench-", dir=workdir))
    src_bytes = _folder_bytes(src)
    conv, copies, fixed, out_bytes = [], [], [], 0
    try:
        for i in range(runs):
            out, cp_out = base / f"out{i}", base / f"cp{i}"
            verb = ["quantize", "--format", fmt] if fmt else ["repack"]
            cmd = [sys.executable, "-m", "moeconvert", verb[0], str(src), str(out), "--backend", backend,
                   *verb[1:], *extra]
            fixed.append(_timed([*cmd, "--dry-run", "--no-estimate"]))
            conv.append(_timed(cmd))
            copies.append(_timed(["cp", "-r", str(src), str(cp_out)]))
            out_bytes = _folder_bytes(out)
            shutil.rmtree(out)
            shutil.rmtree(cp_out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ratios = [c.seconds / k.seconds for c, k in zip(conv, copies)]
    # Each median is taken over the figures as reported (4 decimals), so it lies between the listed runs.
    conv_s, cp_s, dry_s = ([round(r.seconds, 4) for r in rs] for rs in (conv, copies, fixed))
    return {
        "source": str(src), "backend": backend, "format": fmt, "runs": runs,
        "source_bytes": src_bytes, "output_bytes": out_bytes,
        "convert_seconds": conv_s,
        "cp_seconds": cp_s,
        "convert_peak_rss_bytes": [r.peak_rss for r in conv],
        "median_convert_seconds": statistics.median(conv_s),
        "median_cp_seconds": statistics.median(cp_s),
        "dry_run_seconds": dry_s,
        "median_dry_run_seconds": statistics.median(dry_s),
        "median_time_ratio_vs_cp": statistics.median(ratios),
        "median_throughput_bytes_per_s": src_bytes / statistics.median(r.seconds for r in conv),
        "max_peak_rss_bytes": max(r.peak_rss for r in conv),
    }
