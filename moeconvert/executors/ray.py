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
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.jobs import Job, plan_key, run_job
from moeconvert.plan import JOBS_DIR

_plans: dict[str, tuple] = {}  # plan key -> (plan, jobs), per worker process

#: how often a running task looks for its run's stop file (seconds), and how long a stopping run waits for
#: its tasks to see it before it cancels the ones left through Ray
STOP_POLL_S = 0.2
STOP_WAIT_S = 60.0


class _Stopped(Exception):
    """A task saw its run's stop file: the driver is ending the run and takes no more records."""


def _task(request, key: str, staging: str, index: int, reporter, stop: str) -> dict:
    """One job, on a Ray worker. It ends early, writing no record, once the file ``stop`` exists in the
    staging folder's job folder (:meth:`RayExecutor._stop`)."""
    from moeconvert.executors import one_torch_thread

    stop_file = Path(staging) / JOBS_DIR / stop
    if stop_file.exists():
        raise _Stopped(index)
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
    looked = time.monotonic()

    def progress(n: int) -> None:
        nonlocal done, looked
        done += n
        reporter.set.remote(index, done)
        if time.monotonic() - looked >= STOP_POLL_S:
            looked = time.monotonic()
            if stop_file.exists():
                raise _Stopped(index)

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
        self.endpoint = None if address is None else parse_ray_address(address)  # refused here, before any work
        self.workers = workers
        self.retries = retries
        self.cpus_per_task = cpus_per_task

    def describe(self) -> str:
        where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
        return f"Ray tasks on {where}" + (f", at most {self.workers} at a time" if self.workers else "")

    def run(self, plan, request, key: str, staging: Path, jobs: list[Job], progress) -> dict[int, dict]:
        # Ray's driver prints what its cluster reports (a worker died, a task retried) on stdout: send it
        # to stderr, beside our own notes, so that stdout stays ours (``--json``)
        with contextlib.redirect_stdout(sys.stderr), _ray_loggers_quiet(), _SignalsDeferred() as signals:
            return self._run(plan, request, key, staging, jobs, progress, signals)

    def _connect(self, ray, signals: "_SignalsDeferred") -> None:
        if self.endpoint is not None:
            probe(*self.endpoint, self.address)
        env = {}
        if self.address not in (None, "local"):
            # Connecting only: bound each of Ray's waits for the cluster's GCS (ray/_private/node.py
            # _init_gcs_client retries once a second, 20 times by default, each try waiting up to
            # RAY_py_gcs_connect_timeout_s, 30 s) unless the user set them. Not for a local instance: its
            # own start waits for its GCS with the same setting.
            env = {k: v for k, v in _CONNECT_BOUNDS.items() if k not in os.environ}
        os.environ.update(env)
        failure = None
        try:
            # ray.init's C++ client prints a warning line per failed try on the process's stderr (fd 2),
            # beside the Python loggers silenced in run(): those lines go to a file, shown only in debug
            with _fd2_to_file() as captured:
                try:
                    ray.init(address=self.address, log_to_driver=False, include_dashboard=False,
                             configure_logging=False, ignore_reinit_error=True)
                except SystemExit as e:  # the SIGTERM handler ray.init installs while it connects
                    if e.code != signal.SIGTERM:
                        raise
                    signals.caught.append(signal.SIGTERM)
                except (ConnectionError, RuntimeError, ValueError) as e:
                    failure = e
        finally:
            for k in env:
                os.environ.pop(k, None)
        if failure is not None:
            if os.environ.get("MOECONVERT_DEBUG"):
                sys.stderr.write("".join(captured))
            raise MoeConvertError(f"cannot connect to Ray: {_first_line(failure)}{_AUTH_HINT}", tensor="--ray-address",
                                  found=self.address or "(start a local one)") from failure
        signals.install()  # again: ray.init put its own SIGTERM handler (and its core worker's) in place
        signals.deliver()

    def _run(self, plan, request, key: str, staging: Path, jobs: list[Job], progress, signals) -> dict[int, dict]:
        from moeconvert.executors import by_cost

        try:
            import ray
            from ray.exceptions import RayError, RayTaskError
        except ImportError as e:
            raise MoeConvertError("--executor ray needs Ray: pip install 'moeconvert[ray]'") from e
        if not jobs:
            return {}
        in_flight: dict = {}
        stop = f"stop-{uuid.uuid4().hex}"  # this run's own: a stale one from another run stops nothing
        try:
            self._connect(ray, signals)
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
                    in_flight[task.remote(request, key, str(staging), j.index, reporter, stop)] = j
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.5)
                signals.deliver()  # here, in Python between Ray's calls, never inside one
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
            if ray.is_initialized():
                if in_flight:  # a failed run stops the rest: nothing keeps writing into its staging folder
                    self._stop(ray, staging, stop, list(in_flight))
                ray.shutdown()
            signals.deliver()  # a signal that came while Ray shut down

    @staticmethod
    def _stop(ray, staging: Path, stop: str, refs: list) -> None:
        """End the tasks ``refs`` before the staging folder goes: each sees the stop file at its next
        progress step (or before it starts) and ends without a record. Only a task that has not ended
        within ``STOP_WAIT_S`` (a worker stuck in I/O) is cancelled through Ray, which kills its worker:
        Ray's force-cancel of a task that is finishing at that moment can abort the driver ("Tried to
        complete task that was not pending"), so it is the last resort, not the way."""
        stop_file = staging / JOBS_DIR / stop
        try:
            stop_file.touch()
        except OSError:
            pass  # the staging folder is gone or read-only: cancelling below is all that is left
        try:
            if stop_file.exists():
                _, refs = ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S)
            for ref in refs:
                ray.cancel(ref, force=True)
        finally:
            with contextlib.suppress(OSError):
                stop_file.unlink()


# --------------------------------------------------------------------------------------------------
# the address, Ray's output, signals

#: Ray's connect waits, bounded (seconds): its GCS client's connection and first request, and the tries
_CONNECT_BOUNDS = {"RAY_gcs_rpc_server_connect_timeout_s": "2", "RAY_py_gcs_connect_timeout_s": "4",
                   "RAY_gcs_server_port_wait_time_s": "1"}
PROBE_TIMEOUT_S = 3.0
_AUTH_HINT = (" (if the cluster uses token authentication, set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or "
              "RAY_AUTH_TOKEN_PATH as on its head node)")
_ADDRESS_EXPECTED = "HOST:PORT with PORT in 1..65535 (e.g. 10.0.0.1:6379), or auto / local"


def parse_ray_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``--ray-address``, or None for Ray's own words ``auto`` (the cluster this machine
    runs or RAY_ADDRESS names) and ``local`` (start one); anything else is refused in one line."""
    if address in ("auto", "local"):
        return None
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [::1]:6379
        host = host[1:-1]
    if not sep or not host or any(c.isspace() or c in "/@[]" for c in host) or not port.isdigit() \
            or not 1 <= int(port) <= 65535:
        raise MoeConvertError("not a Ray address", tensor="--ray-address", expected=_ADDRESS_EXPECTED,
                              found=repr(address))
    return host, int(port)


def probe(host: str, port: int, address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Refuse in seconds an address where nothing accepts a TCP connection: Ray itself would retry for
    minutes, printing a line per try."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        why = "no answer within {:g} s".format(timeout) if isinstance(e, TimeoutError) else \
            (e.strerror or type(e).__name__).lower()
        raise MoeConvertError(f"cannot connect to Ray: nothing accepts connections at {host}:{port} ({why}); "
                              "is the head node running (ray start --head) and is this its GCS port?",
                              tensor="--ray-address", found=address) from e


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


@contextlib.contextmanager
def _ray_loggers_quiet():
    """Ray's Python loggers say nothing on our stderr (ray.init's token-authentication notice, "Started a
    local Ray instance", ...): with ``configure_logging=False`` they have no handler, so Python's last
    resort handler would print their warnings."""
    logger = logging.getLogger("ray")
    saved = (logger.handlers[:], logger.propagate)
    logger.handlers[:] = [logging.NullHandler()]
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = saved


@contextlib.contextmanager
def _fd2_to_file():
    """File descriptor 2 (where C++ code writes its log lines) into a temporary file while the block runs;
    yields a list that holds the file's text once the block is over."""
    captured: list[str] = []
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no fd 2 to move
        yield captured
        return
    with tempfile.TemporaryFile("w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            captured.append(log.read())


class _SignalsDeferred:
    """SIGINT / SIGTERM while Ray runs: recorded, and delivered to the handler that was there before (the
    CLI's, which unwinds the run: exit 130 / 143, staging removed) from Python code between Ray's calls.

    Raised inside one of Ray's Cython calls, the handler's exception surfaces as ``SystemError: <cyfunction
    CoreWorker.wait> returned a result with an exception set``; and ray.init replaces SIGTERM's handler
    with its own (ray/_private/worker.py, ``sigterm_handler``) and its core worker's C++ one, which dumps a
    stack. Outside the main thread (no signal handlers there) this does nothing.
    """

    def __init__(self):
        self.caught: list[int] = []
        self.delivered = False
        self.previous: dict[int, object] = {}
        self.active = threading.current_thread() is threading.main_thread()

    def _record(self, signum, frame) -> None:
        if self.caught:  # a second one: the previous handler decides (the CLI's stops at once)
            self._call_previous(signum)
        self.caught.append(signum)

    def install(self) -> None:
        if self.active:
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, self._record)

    def __enter__(self):
        if self.active:
            self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            self.install()
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            for s, h in self.previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)

    def deliver(self) -> None:
        """Hand the first signal caught to the previous handler (which raises, as the CLI's does), once."""
        if self.caught and self.active and not self.delivered:
            self.delivered = True
            self._call_previous(self.caught[0])

    def _call_previous(self, signum: int) -> None:
        h = self.previous.get(signum)
        if callable(h):
            h(signum, None)
        elif h == signal.SIG_IGN:
            return
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:  # the default action: end the process as the signal would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
