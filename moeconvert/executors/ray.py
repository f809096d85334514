"""``--executor ray``: the jobs as Ray core tasks, for conversions that outgrow one machine.

Nothing here is cluster code of our own: Ray schedules the tasks, retries a task whose worker or node
dies (``max_retries``), and carries the progress. What the cluster must provide: every node sees the
source at the same path (or has it in its Hugging Face cache) and the output's parent folder on shared
storage at the same path, since each task writes its tensors into the staging folder there. A task
plans the conversion again from the request (once per worker process) and refuses to work if its plan
differs from the driver's, so a node with another copy of the source cannot write into the output.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.jobs import Job, plan_key, run_job

_plans: dict[str, tuple] = {}  # plan key -> (plan, jobs), per worker process


def _task(request, key: str, staging: str, index: int, reporter) -> dict:
    """One job, on a Ray worker."""
    from moeconvert.executors import one_torch_thread

    one_torch_thread()
    if key not in _plans:
        plan, jobs = request.open()
        if plan_key(plan, jobs, request) != key:
            raise MoeConvertError("a Ray worker planned a different conversion from the same command: every "
                                  "node must see the same source at the same path")
        _plans.clear()
        _plans[key] = (plan, jobs)
    plan, jobs = _plans[key]
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n
        reporter.set.remote(index, done)

    return run_job(plan, jobs[index], Path(staging), key, request.chunk_bytes, progress)


class _Reporter:
    """A tiny actor holding each job's bytes done in its current attempt (a retry starts again at 0)."""

    def __init__(self):
        self.done: dict[int, int] = {}

    def set(self, index: int, n: int) -> None:
        self.done[index] = n

    def snapshot(self) -> dict[int, int]:
        return dict(self.done)


class RayExecutor:
    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None, retries: int = 3,
                 cpus_per_task: float = 1):
        self.address = address
        self.workers = workers
        self.retries = retries
        self.cpus_per_task = cpus_per_task

    def describe(self) -> str:
        where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
        return f"Ray tasks on {where}" + (f", at most {self.workers} at a time" if self.workers else "")

    def run(self, plan, request, key: str, staging: Path, jobs: list[Job], progress) -> dict[int, dict]:
        # Ray's driver prints what its cluster reports (a worker died, a task retried) on stdout: send it
        # to stderr, beside our own notes, so that stdout stays ours (``--json``)
        with contextlib.redirect_stdout(sys.stderr):
            return self._run(plan, request, key, staging, jobs, progress)

    def _run(self, plan, request, key: str, staging: Path, jobs: list[Job], progress) -> dict[int, dict]:
        from moeconvert.executors import by_cost

        try:
            import ray
            from ray.exceptions import RayError, RayTaskError
        except ImportError as e:
            raise MoeConvertError("--executor ray needs Ray: pip install 'moeconvert[ray]'") from e
        if not jobs:
            return {}
        try:
            ray.init(address=self.address, log_to_driver=False, include_dashboard=False,
                     configure_logging=False, ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise MoeConvertError(f"cannot connect to Ray: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                                  tensor="--ray-address", found=self.address or "(start a local one)") from e
        in_flight: dict = {}
        try:
            reporter = ray.remote(num_cpus=0)(_Reporter).remote()
            task = ray.remote(_task).options(max_retries=self.retries, retry_exceptions=False,
                                             num_cpus=self.cpus_per_task)
            queue = by_cost(jobs)
            limit = self.workers or len(queue)
            out: dict[int, dict] = {}
            shown = 0
            while queue or in_flight:
                while queue and len(in_flight) < limit:
                    j = queue.pop(0)
                    in_flight[task.remote(request, key, str(staging), j.index, reporter)] = j
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.5)
                for ref in ready:
                    j = in_flight.pop(ref)
                    try:
                        out[j.index] = ray.get(ref)
                    except RayTaskError as e:
                        cause = getattr(e, "cause", None)
                        if isinstance(cause, MoeConvertError):
                            raise MoeConvertError(cause.line()) from e
                        raise InternalError(f"job {j.index} ({j.what}) failed on a Ray worker: {e}") from e
                    except RayError as e:  # the worker or its node died more times than max_retries
                        raise MoeConvertError(f"job {j.index} ({j.what}): Ray gave up after {self.retries} "
                                              f"retries: {type(e).__name__}") from e
                snap = ray.get(reporter.snapshot.remote())
                now = sum(snap.get(i, 0) for i in (j.index for j in jobs) if i not in out) + \
                    sum(j.work_bytes for j in jobs if j.index in out)
                if now != shown:
                    progress(now - shown)
                    shown = now
            return out
        finally:
            for ref in in_flight:  # a failed run stops the rest: nothing keeps writing into its staging folder
                ray.cancel(ref, force=True)
            ray.shutdown()
