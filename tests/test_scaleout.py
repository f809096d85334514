"""Scale-out: the same bytes whatever runs the jobs, a lost worker's job run again, ``--resume``.

Every conversion here is the real CLI in a child process (``python -m moeconvert``), so worker
processes, Ray tasks and kills behave as they do for users. The reference output is the in-process
run (``--workers 0``); the others must equal it file for file, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CASES = {
    "w4a16": (dict(family="qwen3-moe", scheme="w4a16", num_layers=4, num_experts=16, hidden_size=512,
                   intermediate_size=256, max_shard_size="2MB"), ["repack"], "marlin"),
    "bf16-mxfp4": (dict(family="qwen3-moe", scheme="bf16", num_layers=3, num_experts=8, hidden_size=512,
                        intermediate_size=256, max_shard_size="4MB"), ["quantize", "--format", "mxfp4"], "marlin"),
}


def _cmd(verb: list[str], src: Path, out: Path, backend: str, *extra) -> list[str]:
    return [sys.executable, "-m", "moeconvert", verb[0], str(src), str(out), "--backend", backend, *verb[1:],
            *map(str, extra)]


def _run(cmd: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == expect, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}"
    return p


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _assert_identical(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between {a.name} and {b.name}"


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".moeconvert-" in p.name]


@pytest.fixture(scope="module")
def cases(example_ckpt, tmp_path_factory):
    """Each case's source and its in-process reference output."""
    built = {}
    base = tmp_path_factory.mktemp("scaleout-ref")
    for name, (kw, verb, backend) in CASES.items():
        src = example_ckpt(**kw)
        ref = base / name
        _run(_cmd(verb, src, ref, backend, "--workers", "0"))
        built[name] = (src, verb, backend, ref)
    return built


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_worker_processes_write_the_same_bytes(cases, case, workers, tmp_path):
    src, verb, backend, ref = cases[case]
    out = tmp_path / "out"
    p = _run(_cmd(verb, src, out, backend, "--workers", workers, "--json"))
    summary = json.loads(p.stdout)
    assert summary["jobs"]["ran"] == summary["jobs"]["total"] > 4
    # --workers is capped by this machine's cores (a 2-core machine runs 2 for --workers 3, and says so)
    from moeconvert.executors import available_cores

    assert f"{min(workers, available_cores())} local worker process" in summary["executor"]
    _assert_identical(ref, out)
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# killing things


def _staging(parent: Path) -> Path | None:
    found = [p for p in parent.iterdir() if ".moeconvert-partial-" in p.name]
    return found[0] if found else None


def _running_job(staging: Path) -> tuple[int, int] | None:
    """(job, pid) of a job that has started and has no record yet, from its ``.run-HOST-PID`` marker."""
    host = socket.gethostname()
    try:
        names = os.listdir(staging / ".jobs")
    except OSError:
        return None
    for name in names:
        head, sep, tail = name.partition(f".run-{host}-")
        if sep and head.isdigit() and not (staging / ".jobs" / f"{head}.json").exists():
            return int(head), int(tail)
    return None


def _kill_one_worker_mid_job(proc: subprocess.Popen, parent: Path, protect: set[int]) -> int | None:
    """Freeze a worker that is running a job, make sure the job is unfinished, kill it (SIGKILL).
    Returns the job killed, or None if the run ended before one could be caught."""
    while proc.poll() is None:
        staging = _staging(parent)
        found = _running_job(staging) if staging is not None else None
        if found is None or found[1] in protect:
            time.sleep(0.002)
            continue
        job, pid = found
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        if (staging / ".jobs" / f"{job:05d}.json").exists():  # it finished just before the stop
            os.kill(pid, signal.SIGCONT)
            continue
        os.kill(pid, signal.SIGKILL)
        return job
    return None


def test_a_killed_worker_process_has_its_job_run_again(cases, tmp_path):
    src, verb, backend, ref = cases["w4a16"]
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        proc = subprocess.Popen(_cmd(verb, src, out, backend, "--workers", 2, "--json"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killed = _kill_one_worker_mid_job(proc, tmp_path, protect={proc.pid})
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        if killed is None:
            continue  # the run was faster than the watcher: try again
        summary = json.loads(stdout)
        assert summary["jobs"]["retried"] >= 1, summary["jobs"]
        assert "ran again after a worker was lost" in stderr
        _assert_identical(ref, out)
        assert _leftovers(tmp_path) == []
        return
    pytest.fail("no job was caught running in 3 runs")


def _records(staging: Path) -> dict[str, int]:
    """How many job records of each kind the staging folder holds."""
    kinds: dict[str, int] = {}
    for n in os.listdir(staging / ".jobs"):
        if n[:5].isdigit() and n.endswith(".json"):
            try:
                kind = json.loads((staging / ".jobs" / n).read_text())["kind"]
            except (OSError, ValueError, KeyError):
                continue  # being renamed into place
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _wait_until_the_group_is_dead(pgid: int, timeout: float = 30.0) -> None:
    """Until no process of group ``pgid`` runs (only zombies, or none, are left): read from /proc."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = (Path("/proc") / entry / "stat").read_text()
            except OSError:
                continue  # it ended while we looked
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after its last ')'
            state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
            if int(pgrp) == pgid and state not in ("Z", "X"):
                alive.append(int(entry))
        if not alive:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {alive} of the killed run still run {timeout:g} s after SIGKILL")
        time.sleep(0.01)


def _kill_run_after_some_jobs(cmd: list[str], parent: Path) -> tuple[Path, int]:
    """Start ``cmd`` in its own process group, SIGKILL the whole group once every source digest and at
    least one layer or copy job have their record and some jobs have not; returns the staging folder
    left and how many layer and copy records it holds (what ``--resume`` keeps: digests are made again).

    The group is looked at while stopped (SIGSTOP), then let run for a moment (SIGCONT): a run of a few
    small jobs cannot slip from "none finished" to "all finished" between two looks, however busy the
    machine is (a poll of a running process missed that window on a loaded 2-core machine)."""
    digests = len(list(Path(cmd[4]).glob("*.safetensors")))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        while proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGSTOP)
            except ProcessLookupError:
                break
            staging = _staging(parent)
            if staging is not None:
                try:
                    plan = json.loads((staging / ".jobs" / "plan.json").read_text())
                    kinds = _records(staging)
                except (OSError, ValueError):
                    kinds, plan = {}, None
                others = sum(v for k, v in kinds.items() if k != "digest")
                if plan and kinds.get("digest", 0) == digests and 1 <= others and sum(kinds.values()) < plan["jobs"] - 1:
                    # kill, then count once no process of the run can still write: kill(2) returns before
                    # a process on another core has stopped, so a record counted right after it may be
                    # joined by one more renamed into place
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    _wait_until_the_group_is_dead(proc.pid)
                    kinds = _records(staging)
                    return staging, sum(v for k, v in kinds.items() if k != "digest")
            try:
                os.killpg(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    raise AssertionError("the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_kill_9_does_only_the_unfinished_jobs(cases, tmp_path, workers):
    src, verb, backend, ref = cases["w4a16"]
    out = tmp_path / "out"
    cmd = _cmd(verb, src, out, backend, "--workers", workers)
    staging, finished = _kill_run_after_some_jobs(cmd, tmp_path)
    assert staging.is_dir() and not out.exists()
    total = json.loads((staging / ".jobs" / "plan.json").read_text())["jobs"]
    p = _run(cmd + ["--resume", "--json"])
    jobs = json.loads(p.stdout)["jobs"]
    assert jobs == {"total": total, "kept": finished, "ran": total - finished, "retried": 0}
    assert "source files hashed again and unchanged" in p.stderr
    assert f"{finished} of " in p.stderr and "layer and copy jobs done and checked" in p.stderr
    _assert_identical(ref, out)
    assert _leftovers(tmp_path) == []


def test_resume_redoes_a_finished_job_whose_bytes_were_damaged(cases, tmp_path):
    src, verb, backend, ref = cases["w4a16"]
    out = tmp_path / "out"
    cmd = _cmd(verb, src, out, backend, "--workers", 0)
    staging, finished = _kill_run_after_some_jobs(cmd, tmp_path)
    # flip one byte inside a tensor a finished job wrote
    plan_records = sorted(n for n in os.listdir(staging / ".jobs") if n[:5].isdigit() and n.endswith(".json"))
    rec = next(r for r in (json.loads((staging / ".jobs" / n).read_text()) for n in plan_records) if "tensors" in r)
    name = next(iter(rec["tensors"]))
    shard = next(f for f in staging.glob("*.safetensors") if f'"{name}"'.encode() in f.read_bytes()[:1 << 20])
    from moeconvert.format import read_header

    info = read_header(shard)[name]
    with open(shard, "r+b") as f:
        f.seek(info.start)
        b = f.read(1)
        f.seek(info.start)
        f.write(bytes([b[0] ^ 0x10]))
    p = _run(cmd + ["--resume", "--json"])
    jobs = json.loads(p.stdout)["jobs"]
    assert jobs["kept"] == finished - 1 and "redone: 1 whose bytes no longer match their record" in p.stderr
    _assert_identical(ref, out)


def test_without_resume_a_killed_runs_staging_is_removed(cases, tmp_path):
    src, verb, backend, ref = cases["w4a16"]
    out = tmp_path / "out"
    cmd = _cmd(verb, src, out, backend, "--workers", 0)
    staging, _ = _kill_run_after_some_jobs(cmd, tmp_path)
    p = _run(cmd + ["--json"])
    assert json.loads(p.stdout)["jobs"]["kept"] == 0
    assert not staging.exists() and _leftovers(tmp_path) == []
    _assert_identical(ref, out)


def test_resume_refuses_a_different_command(cases, tmp_path):
    src, verb, backend, ref = cases["w4a16"]
    out = tmp_path / "out"
    staging, _ = _kill_run_after_some_jobs(_cmd(verb, src, out, backend, "--workers", 0), tmp_path)
    p = _run(_cmd(verb, src, out, backend, "--workers", 0, "--resume", "--max-shard-size", "3MB"), expect=2)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot resume the interrupted run: it was made with --max-shard-size" in lines[0]
    assert staging.exists() and not out.exists()  # nothing lost: the user decides


def test_resume_with_nothing_to_resume_converts_everything(cases, tmp_path):
    src, verb, backend, ref = cases["w4a16"]
    out = tmp_path / "out"
    p = _run(_cmd(verb, src, out, backend, "--workers", 0, "--resume", "--json"))
    jobs = json.loads(p.stdout)["jobs"]
    assert jobs["kept"] == 0 and jobs["ran"] == jobs["total"]
    _assert_identical(ref, out)


# --------------------------------------------------------------------------------------------------
# planning at any scale, and the options


def test_dry_run_plans_deepseek_v3_at_full_size(tmp_path):
    from helpers import cli

    src = tmp_path / "dsv3"
    cli("example", src, "--family", "deepseek-v3", "--header-only", expect=0)
    files = list(src.glob("*.safetensors"))
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    assert apparent > 1.3e12 and on_disk < 100e6  # 1.3 TB of sparse shards
    run = cli("quantize", src, tmp_path / "out", "--format", "mxfp4", "--backend", "marlin", "--dry-run", "--json",
              expect=0)
    plan = json.loads(run.out)
    assert not (tmp_path / "out").exists()
    jobs = plan["jobs"]
    layers = [j for j in jobs if j["kind"] == "layer"]
    # layers 3..60 and the multi-token-prediction layer 61, each 256 experts of 3 x 2048 x 7168 bf16
    assert len(layers) == 59 and {j["read_bytes"] for j in layers} == {256 * 3 * 2048 * 7168 * 2}
    assert sum(j["read_bytes"] for j in jobs if j["kind"] == "digest") == apparent
    copied = sum(j["read_bytes"] for j in jobs if j["kind"] == "copy")
    assert copied + sum(j["read_bytes"] for j in layers) == apparent - sum(_header_bytes(f) for f in files)
    est = plan["estimate"]
    rows = {r["workers"]: r for r in est["by_workers"]}
    assert {1, 8, 64} <= set(rows)
    assert rows[1]["seconds"] > rows[8]["seconds"] > rows[64]["seconds"] >= est["largest_job_seconds"] > 0
    assert rows[64]["bounded_by_largest_job"] and not rows[1]["bounded_by_largest_job"]
    assert all(r["peak_memory_bytes_per_worker"] < 4 << 30 for r in rows.values())


def _header_bytes(f: Path) -> int:
    with open(f, "rb") as h:
        return 8 + int.from_bytes(h.read(8), "little")


@pytest.mark.parametrize("args, needle", [
    (["--workers", "many"], "--workers: not a number of workers"),
    (["--workers", "-1"], "--workers: not a number of workers"),
    (["--executor", "slurm"], "--executor: unknown executor"),
    (["--ray-address", "127.0.0.1:1"], "--ray-address: --ray-address needs --executor ray"),
])
def test_bad_run_options_are_one_line(cases, tmp_path, args, needle):
    from helpers import cli

    src, verb, backend, _ = cases["w4a16"]
    run = cli(*_cmd(verb, src, tmp_path / "out", backend, *args)[3:], expect=2)
    assert len(run.err.strip().splitlines()) == 1 and needle in run.err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_auto_threads_fit_the_cores_the_jobs_and_the_memory():
    from moeconvert.cli.convert import auto_threads

    assert auto_threads(100, 1 << 30, 16, 64 << 30) == 16  # one per core
    assert auto_threads(3, 1 << 30, 16, 64 << 30) == 3  # no more than there are jobs
    assert auto_threads(100, 8 << 30, 16, 32 << 30) == 3  # three quarters of 32 GiB hold three 8 GiB jobs
    assert auto_threads(100, 64 << 30, 16, 8 << 30) == 1  # at least one, whatever the memory
    assert auto_threads(100, 1 << 30, 16, None) == 16  # memory unknown: the cores decide
