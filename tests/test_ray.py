"""``--executor ray``: the same bytes as in-process, a killed worker's task retried, and the user-facing
edges (an address nothing answers at, a malformed one, Ctrl-C and SIGTERM mid-run, Ray's own output).

Every run is the real CLI in a child process against a Ray head this module starts for itself: its own
temporary folder, its own port, its own authentication token (Ray 2.60 turns token authentication on
for the clusters it starts), reached at the address it reports; it is stopped by its own processes' ids,
so another Ray cluster on the machine is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_scaleout import (  # noqa: F401 (cases is a fixture)
    _assert_identical, _cmd, _kill_one_worker_mid_job, _leftovers, _staging, cases)

#: what Ray reads for token authentication (ray/_private/authentication_test_utils.py lists the same)
_RAY_AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ray_processes(temp_dir: Path) -> list:
    """This head's processes: each of Ray's processes names its temporary folder on its command line."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp_dir) in a for a in p.info["cmdline"] or ()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


class RayHead:
    def __init__(self, address: str, env: dict[str, str], temp_dir: Path):
        self.address, self.env, self.temp_dir = address, env, temp_dir

    def run(self, cmd: list[str], expect: int = 0) -> subprocess.CompletedProcess:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=self.env)
        assert p.returncode == expect, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}"
        return p

    def popen(self, cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head with two worker CPUs, token authentication with a token of its own, in a temporary
    folder of its own (short: Ray's socket paths must fit in 107 bytes)."""
    pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'moeconvert[ray]')")
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = Path(tempfile.mkdtemp(prefix="mc-ray-"))
    env = {k: v for k, v in os.environ.items() if k not in _RAY_AUTH and k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    start = [str(ray_bin), "start", "--head", "--port", "0", "--num-cpus", "2", "--include-dashboard", "false",
             "--disable-usage-stats", "--object-store-memory", str(200 << 20), "--temp-dir", str(temp_dir),
             # ports Ray would otherwise take at fixed defaults, which another cluster may hold
             "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
             "--runtime-env-agent-port", str(_free_port())]
    try:
        p = subprocess.run(start, capture_output=True, text=True, env=env, timeout=180)
        assert p.returncode == 0, p.stdout + p.stderr
        # the address the head reports (ray start writes it there): Ray resolves 127.0.0.1 to this
        # machine's own address, so a guessed loopback address is not the one it listens at
        address = (temp_dir / "ray_current_cluster").read_text().strip()
        yield RayHead(address, env, temp_dir)
    finally:
        import psutil

        procs = _ray_processes(temp_dir)
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        for proc in psutil.wait_procs(procs, timeout=15)[1]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# the same bytes, a retried task


@pytest.mark.parametrize("case", ["bf16-mxfp4", "w4a16"])
def test_ray_tasks_write_the_same_bytes(cases, ray_head, case, tmp_path):
    src, verb, backend, ref = cases[case]
    out = tmp_path / "out"
    p = ray_head.run(_cmd(verb, src, out, backend, "--executor", "ray", "--ray-address", ray_head.address, "--json"))
    summary = json.loads(p.stdout)
    assert summary["jobs"]["ran"] == summary["jobs"]["total"] and "Ray" in summary["executor"]
    _assert_identical(ref, out)
    assert _leftovers(tmp_path) == []
    # nothing of Ray's own on stderr: no token notice, no log line of its C++ client
    assert [line for line in p.stderr.splitlines() if not line.startswith("warning:")] == [], p.stderr


def test_a_killed_ray_worker_has_its_task_retried(cases, ray_head, tmp_path):
    src, verb, backend, ref = cases["w4a16"]
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        proc = ray_head.popen(_cmd(verb, src, out, backend, "--executor", "ray", "--ray-address", ray_head.address,
                                   "--json"))
        killed = _kill_one_worker_mid_job(proc, tmp_path, protect={proc.pid})
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        if killed is None:
            continue
        assert json.loads(stdout)["jobs"]["retried"] >= 1
        _assert_identical(ref, out)
        return
    pytest.fail("no task was caught running in 3 runs")


# --------------------------------------------------------------------------------------------------
# the address


@pytest.mark.parametrize("address, needle", [
    ("127.0.0.1:{closed}", "nothing accepts connections at 127.0.0.1:{closed}"),
    ("127.0.0.1:70000", "not a Ray address"),
    ("127.0.0.1:0", "not a Ray address"),
    ("head-node", "not a Ray address"),
    ("head node:6379", "not a Ray address"),
])
def test_a_bad_or_unreachable_address_is_one_line_within_seconds(cases, tmp_path, address, needle):
    src, verb, backend, _ = cases["w4a16"]
    pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'moeconvert[ray]')")
    closed = _free_port()  # bound, then released: nothing listens there
    address, needle = address.format(closed=closed), needle.format(closed=closed)
    t0 = time.monotonic()
    p = subprocess.run(_cmd(verb, src, tmp_path / "out", backend, "--executor", "ray", "--ray-address", address),
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    lines = [line for line in p.stderr.splitlines() if not line.startswith("warning:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("moeconvert: error: --ray-address: ") and needle in lines[0]
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()
    # what is measured, not asserted to the second: Ray itself retried for minutes
    print(f"{address}: refused in {took:.1f} s")


def test_a_cluster_that_refuses_our_token_is_one_line(cases, ray_head, tmp_path):
    """The port answers but the cluster's authentication refuses us: Ray's client would print a warning
    per try for tens of seconds; the user gets one line that says what to set."""
    src, verb, backend, _ = cases["w4a16"]
    env = {**ray_head.env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    p = subprocess.run(_cmd(verb, src, tmp_path / "out", backend, "--executor", "ray", "--ray-address",
                            ray_head.address), capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in p.stderr.splitlines() if not line.startswith("warning:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "cannot connect to Ray" in lines[0] and "RAY_AUTH_TOKEN" in lines[0]
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_ends_in_our_line_and_no_staging(cases, ray_head, tmp_path, signum):
    src, verb, backend, _ = cases["w4a16"]
    out = tmp_path / "out"
    proc = ray_head.popen(_cmd(verb, src, out, backend, "--executor", "ray", "--ray-address", ray_head.address,
                               "--workers", 1))
    try:
        # wait until a task runs (the staging folder has a job marker): the run is inside Ray's calls
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            staging = _staging(tmp_path)
            if staging is not None and (staging / ".jobs").is_dir() and \
                    any(".run-" in n for n in os.listdir(staging / ".jobs")):
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    name = signal.Signals(signum).name
    lines = [line for line in stderr.splitlines() if not line.startswith("warning:")]
    assert proc.returncode == 128 + signum, stderr
    assert lines == [f"moeconvert: interrupted ({name}); no unfinished output was left behind"], stderr
    assert _leftovers(tmp_path) == [] and not out.exists()


# --------------------------------------------------------------------------------------------------
# stopping the tasks of a run that ends early (a signal, a failed job): no Ray force-cancel in the way


class _FakeRay:
    """What ``RayExecutor._stop`` calls of Ray, recorded; ``wait`` ends the tasks in ``ends``."""

    def __init__(self, ends: set, stop_file: Path):
        self.ends, self.stop_file = ends, stop_file
        self.waited: list[tuple] = []
        self.cancelled: list = []

    def wait(self, refs, num_returns, timeout):
        self.waited.append((list(refs), num_returns, timeout, self.stop_file.exists()))
        return [r for r in refs if r in self.ends], [r for r in refs if r not in self.ends]

    def cancel(self, ref, force):
        self.cancelled.append((ref, force))


def _stop_with(tmp_path: Path, ends: set) -> _FakeRay:
    from moeconvert.executors.ray import STOP_WAIT_S, RayExecutor
    from moeconvert.plan import JOBS_DIR

    (tmp_path / JOBS_DIR).mkdir()
    fake = _FakeRay(ends, tmp_path / JOBS_DIR / "stop-x")
    RayExecutor._stop(fake, tmp_path, "stop-x", ["a", "b", "c"])
    assert fake.waited == [(["a", "b", "c"], 3, STOP_WAIT_S, True)]  # waited for all, with the file there
    assert not fake.stop_file.exists()  # removed once the tasks are over: a resumed run is not stopped
    return fake


def test_stopping_tasks_that_end_cancels_nothing(tmp_path):
    assert _stop_with(tmp_path, {"a", "b", "c"}).cancelled == []


def test_stopping_cancels_only_the_tasks_still_running_after_the_wait(tmp_path):
    assert _stop_with(tmp_path, {"a", "c"}).cancelled == [("b", True)]


def test_a_task_ends_at_its_next_progress_step_once_the_stop_file_appears(tmp_path, monkeypatch):
    """``_task`` on this process, with the job itself stood in for: the file appears during the second
    progress step and the task raises there (STOP_POLL_S = 0: it looks at every step), so the job's
    three other steps and its record never come."""
    from moeconvert.executors import ray as rx
    from moeconvert.plan import JOBS_DIR

    (tmp_path / JOBS_DIR).mkdir()
    stop_file = tmp_path / JOBS_DIR / "stop-x"
    steps = []

    class _Reporter:
        class set:  # noqa: N801 (the actor method's name)
            @staticmethod
            def remote(index, done):
                steps.append(done)
                if len(steps) == 2:
                    stop_file.touch()

    def job(plan, job, staging, key, chunk_bytes, progress):
        for _ in range(5):
            progress(1)
        return {"record": "written"}

    monkeypatch.setattr(rx, "STOP_POLL_S", 0.0)
    monkeypatch.setattr(rx, "run_job", job)
    monkeypatch.setitem(rx._plans, "k", (object(), [object()]))
    with pytest.raises(rx._Stopped):
        rx._task(type("R", (), {"chunk_bytes": 1})(), "k", str(tmp_path), 0, _Reporter, "stop-x")
    assert steps == [1, 2]
    # and a task that starts after the file appeared does not start the job at all
    with pytest.raises(rx._Stopped):
        rx._task(None, "k", str(tmp_path), 0, _Reporter, "stop-x")
    assert steps == [1, 2]
