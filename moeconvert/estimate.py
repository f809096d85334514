"""``--dry-run``'s time estimate: this machine's throughput, measured on the plan itself, and the jobs
scheduled on N workers.

Each job kind's rate is measured on one core on a small piece of this conversion: the largest MoE
layer's first expert decoded, (quantized,) encoded and hashed as a layer job does it; up to 64 MB of the
largest pass-through tensor read and hashed; 64 MB hashed as a source digest. Storage is not measured
(a checkpoint of only headers reads back zeros from holes): the estimate is the compute bound, and a
run whose disk or network is slower than the summed rates is limited by that instead. The jobs are
then placed longest first on the least loaded of N workers (one core each); no number of workers
beats the largest job.
"""

from __future__ import annotations

import hashlib
import time

PROCESS_BYTES = 512 << 20  # a worker process's own memory (interpreter, torch) beside its job's
# the most working memory measuring one expert may take: a DeepSeek-V3 expert quantized to MXFP4 takes about
# 2.1 GB and is measured; an expert beyond any published model is not, rather than a dry run failing
MEASURE_BYTES = 4 << 30


def _expert_working_bytes(lp) -> int:
    """Working memory of decoding (and quantizing) and encoding one expert of a layer (jobs.chunk_factor)."""
    from moeconvert.jobs import chunk_factor

    per_expert = sum(t.nbytes for t in lp.tensors.values()) // max(lp.shape.num_experts, 1)
    return per_expert * chunk_factor(lp)


def _measure_layer(plan) -> float | None:
    """Source bytes per second of a layer job, on the first expert of the largest layer whose one expert
    fits :data:`MEASURE_BYTES` of working memory (rates are per byte, so a smaller layer of the same
    scheme measures the same work). None when no expert is that small: the layer jobs' time is then
    not estimated, rather than a dry run allocating tens of GiB (or failing) to measure it."""
    from moeconvert.jobs import layer_output_block
    from moeconvert.plan import planned_as
    from moeconvert.quantize import Quality
    from moeconvert.writer import tensor_bytes

    small = [lp for lp in plan.layers if _expert_working_bytes(lp) <= MEASURE_BYTES]
    if not small:
        return None
    lp = max(small, key=lambda lp: sum(t.nbytes for t in lp.tensors.values()))
    read = sum(plan.source.info(n).nbytes for n in lp.map.source_tensors()) / max(lp.map.num_experts, 1)
    best = None
    for _ in range(2):  # the first pass pays one-off costs (allocator, kernels' first use)
        t0 = time.perf_counter()
        block = layer_output_block(plan, lp, 0, 1, Quality() if lp.quantized else None)
        encoded = plan.layout.encode(block, planned_as(plan.model, lp.shape))  # a plan-only family's stand-in
        for t in encoded.values():
            hashlib.sha256(tensor_bytes(t))
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return read / max(best, 1e-9)


def _measure_copy(plan) -> float | None:
    copied = [t for t in plan.tensors if t.source is not None]
    if not copied:
        return None
    t = max(copied, key=lambda t: t.nbytes)
    t0, n = time.perf_counter(), 0
    for buf in plan.source.read_raw(t.source):
        hashlib.sha256(buf)
        n += len(buf)
        if n >= 64 << 20:
            break
    return n / max(time.perf_counter() - t0, 1e-9)


def _measure_digest() -> float:
    buf = bytes(64 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(buf)
    return len(buf) / max(time.perf_counter() - t0, 1e-9)


def measure_rates(plan) -> dict[str, float]:
    """Bytes per second of each job kind on one core of this machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {"layer": _measure_layer(plan), "copy": _measure_copy(plan), "digest": _measure_digest()}
    finally:
        torch.set_num_threads(threads)
    return {k: v for k, v in rates.items() if v}


def job_seconds(job, rates: dict[str, float]) -> float:
    rate = rates.get(job.kind)
    return job.read_bytes / rate if rate else 0.0


def schedule(times: list[float], workers: int) -> float:
    """The time the last worker finishes, with jobs placed longest first on the least loaded worker."""
    load = [0.0] * max(1, workers)
    for t in sorted(times, reverse=True):
        i = min(range(len(load)), key=load.__getitem__)
        load[i] += t
    return max(load)


def estimate(plan, jobs, workers: list[int]) -> dict:
    rates = measure_rates(plan)
    times = [job_seconds(j, rates) for j in jobs]
    largest = max(times, default=0.0)
    peak = max((j.peak_bytes for j in jobs), default=0) + PROCESS_BYTES
    rows = []
    for n in workers:
        s = schedule(times, n)
        rows.append({"workers": n, "seconds": round(s, 1), "peak_memory_bytes_per_worker": peak,
                     "bounded_by_largest_job": s <= largest * 1.0001 and len(jobs) > 1})
    unmeasured = sorted({j.kind for j in jobs} - set(rates))
    return {"rates": {k: round(v) for k, v in rates.items()}, "cores_per_worker": 1,
            "largest_job_seconds": round(largest, 1), "by_workers": rows,
            # job kinds whose time is left out of the seconds above (a layer whose one expert is larger
            # than MEASURE_BYTES of working memory is not measured)
            "not_measured": unmeasured}
