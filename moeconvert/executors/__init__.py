"""Where jobs run: in this process (threads), in local worker processes, or as Ray tasks.

Every executor has one method, ``run(plan, request, key, staging, jobs, progress) -> {job index:
record}``: it runs the given jobs (:mod:`moeconvert.jobs`) into the staging folder and returns their
records, or raises the first job's error (a :class:`MoeConvertError` keeps its one line). A worker
that dies mid-job (killed, out of memory, a lost machine) has its job run again elsewhere, up to
``retries`` more times; a job's bytes are the same whoever writes them, so a rerun overwrites a half
written range with the same values.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from threading import Event

from moeconvert.executors.local import LocalProcesses
from moeconvert.jobs import Job, run_job

__all__ = ["InProcess", "LocalProcesses", "RayExecutor", "available_cores", "by_cost"]


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def by_cost(jobs: list[Job]) -> list[Job]:
    """The source digests first, then longest first (the classic list-scheduling rule): the big layers
    start early and the small jobs fill the gaps at the end, whatever the number of workers. Digests
    lead because ``--resume`` keeps a job only if the interrupted run had recorded the sha256 of every
    source file it read (:func:`moeconvert.jobs.rehash_sources`); hashing is fast beside a layer job."""
    return sorted(jobs, key=lambda j: (j.kind != "digest", -(j.read_bytes + j.write_bytes), j.index))


class _Stopped(Exception):
    pass


def one_torch_thread():
    """Run torch ops on the calling thread only (returns the previous setting).

    Parallelism is across jobs, never inside an op: a conversion's ops are many and small (stacking a
    chunk's experts, splitting nibbles, gathers), and splitting each over threads costs more than it
    saves. Measured on a 2-core machine: one layer chunk took 0.44 s with one torch thread and 4.5 s
    with two."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return before


class InProcess:
    """Jobs on ``threads`` threads of this process (torch, hashing and file I/O release the GIL)."""

    name = "in-process"

    def __init__(self, threads: int | None = None):
        self.threads = max(1, threads or available_cores())

    def describe(self) -> str:
        return f"{self.threads} thread(s) of this process"

    def run(self, plan, request, key: str, staging: Path, jobs: list[Job], progress) -> dict[int, dict]:
        stop = Event()

        def prog(n: int) -> None:
            if stop.is_set():  # another job failed, or Ctrl-C: end this one at its next piece
                raise _Stopped
            progress(n)

        out: dict[int, dict] = {}
        before = one_torch_thread()
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moeconvert-job")
        try:
            futures = {pool.submit(run_job, plan, j, staging, key, request.chunk_bytes, prog): j
                       for j in by_cost(jobs)}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                for f in finished:
                    out[futures[f].index] = f.result()  # the first failure raises here
            return out
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            import torch

            torch.set_num_threads(before)


def RayExecutor(*args, **kwargs):
    """``--executor ray``: imported only when asked for (Ray is an optional extra)."""
    from moeconvert.executors.ray import RayExecutor as _Ray

    return _Ray(*args, **kwargs)
