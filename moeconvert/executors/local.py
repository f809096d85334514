"""``--workers N``: jobs in N worker processes on this machine.

Each worker is a fresh interpreter (``spawn``: no forked torch threads or open files carried over) that
plans the conversion again from the request and refuses to work if its plan's key differs from the
driver's. It takes one job at a time over a pipe and reports progress per chunk. The driver watches
every worker's process handle: a worker that dies mid-job (``kill -9``, the OOM killer) is replaced
and its job given to the next free worker, up to ``retries`` more times. A worker whose driver is
gone stops at its next chunk.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from multiprocessing.connection import wait
from pathlib import Path

from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.jobs import Job, plan_key, run_job


class LocalProcesses:
    name = "local"

    def __init__(self, workers: int, retries: int = 2):
        if workers < 1:
            raise MoeConvertError("--workers must be at least 1", tensor="--workers", expected=">= 1", found=workers)
        self.workers = workers
        self.retries = retries

    def describe(self) -> str:
        return f"{self.workers} local worker process(es)"  # the tests look for this wording

    def run(self, plan, request, key: str, staging: Path, jobs: list[Job], progress) -> dict[int, dict]:
        from moeconvert.executors import by_cost

        if not jobs:
            return {}
        ctx = mp.get_context("spawn")
        queue = by_cost(jobs)
        by_index = {j.index: j for j in jobs}
        failures: dict[int, int] = {}
        counted: dict[int, int] = {}  # progress reported by the current attempt of each job
        out: dict[int, dict] = {}
        workers: dict[int, _Worker] = {}

        def start() -> None:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(request, key, str(staging), child),
                               name="moeconvert-worker", daemon=True)
            _start_ignoring_sigint(proc)
            child.close()
            workers[proc.sentinel] = _Worker(proc, parent)

        try:
            for _ in range(min(self.workers, len(jobs))):
                start()
            while len(out) < len(jobs):
                for w in workers.values():  # hand out work
                    if w.ready and w.job is None and queue:
                        w.job = queue.pop(0)
                        counted[w.job.index] = 0
                        w.conn.send(w.job.index)
                handles = [w.conn for w in workers.values()] + list(workers)
                for ready in wait(handles, timeout=1.0):
                    if isinstance(ready, int):
                        continue  # a dead process: handled below, after its last messages are read
                    w = next(w for w in workers.values() if w.conn is ready)
                    _drain(w, out, counted, progress)
                for sentinel, w in list(workers.items()):
                    if w.proc.is_alive():
                        continue
                    _drain(w, out, counted, progress)
                    w.proc.join()
                    del workers[sentinel]
                    w.conn.close()
                    if w.job is not None and w.job.index not in out:
                        j = w.job
                        failures[j.index] = failures.get(j.index, 0) + 1
                        progress(-counted.pop(j.index, 0))
                        if failures[j.index] > self.retries:
                            raise MoeConvertError(f"job {j.index} ({j.what}): its worker process died "
                                                  f"{failures[j.index]} times ({_how(w.proc.exitcode)})")
                        queue.insert(0, j)
                    elif not w.ready:
                        raise InternalError(f"a worker process ended before it was ready ({_how(w.proc.exitcode)})")
                    if queue and len(workers) < self.workers:
                        start()
                if not workers and len(out) < len(jobs):
                    raise InternalError("no worker process is left and jobs remain")
            return out
        finally:
            for w in workers.values():
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            for w in workers.values():
                w.proc.join(timeout=2)
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join()


def _start_ignoring_sigint(proc) -> None:
    """Start ``proc`` with SIGINT ignored from its first instruction: an ignored disposition survives
    exec (a blocked mask does not: spawn resets it), and Python leaves an ignored SIGINT alone. Else a
    Ctrl-C while the worker imports torch prints its KeyboardInterrupt traceback beside the driver's
    one line. Ctrl-C is the driver's to handle; it stops the workers.

    Meanwhile SIGINT is blocked here, so a Ctrl-C in that window stays pending (Linux never drops a
    blocked signal, ignored or not) and reaches the driver's own handler once it is restored."""
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal.signal works only there
        proc.start()
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, before)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class _Worker:
    def __init__(self, proc, conn):
        self.proc = proc
        self.conn = conn
        self.ready = False
        self.job: Job | None = None


def _drain(w: _Worker, out: dict, counted: dict, progress) -> None:
    """Read every message waiting from worker ``w``; a job error is raised here, in the driver."""
    while True:
        try:
            if not w.conn.poll():
                return
            msg = w.conn.recv()
        except (EOFError, OSError):
            return  # it died; the caller sees the process gone
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "progress":
            _, index, n = msg
            counted[index] = counted.get(index, 0) + n
            progress(n)
        elif kind == "done":
            _, index, record = msg
            out[index] = record
            w.job = None
        elif kind == "error":
            _, index, line, internal = msg
            if internal:
                raise InternalError(f"a worker process failed: {line}")
            raise MoeConvertError(line)
        else:
            raise InternalError(f"unknown message from a worker: {kind!r}")


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _worker_main(request, key: str, staging: str, conn) -> None:
    """One worker process: plan, check the key, then run the jobs it is sent until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it stops us
    from moeconvert.executors import one_torch_thread

    one_torch_thread()
    parent = os.getppid()
    try:
        plan, jobs = request.open()
        mine = plan_key(plan, jobs, request)
        if mine != key:
            conn.send(("error", None, "a worker process planned a different conversion from the same command "
                       "(the source changed while the run started?)", False))
            return
    except MoeConvertError as e:
        conn.send(("error", None, e.line(), False))
        return
    except Exception:  # noqa: BLE001 - reported to the driver, which stops the run
        conn.send(("error", None, traceback.format_exc(), True))
        return
    conn.send(("ready",))
    while True:
        try:
            index = conn.recv()
        except (EOFError, OSError):
            return  # the driver is gone
        if index is None:
            return
        job = jobs[index]

        def progress(n: int, job=job) -> None:
            if os.getppid() != parent:
                os._exit(3)  # orphaned (the driver was killed): stop writing into its staging folder
            conn.send(("progress", job.index, n))

        try:
            record = run_job(plan, job, Path(staging), key, request.chunk_bytes, progress)
        except MoeConvertError as e:
            conn.send(("error", index, e.line(), False))
            return
        except Exception:  # noqa: BLE001
            conn.send(("error", index, traceback.format_exc(), True))
            return
        conn.send(("done", index, record))
