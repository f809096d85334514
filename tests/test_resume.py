"""``--resume`` after a crash: whatever a power cut, a changed source or a hostile hand left in the staging
folder, the finished output is byte for byte the one an uninterrupted run writes, or the run is refused in
one line. And the run options around it (``--workers``, Ctrl-C, ``OUT``) keep the same promise.

Each case kills a real run (``kill -9`` of its whole process group, :func:`_kill_run_after_some_jobs`),
damages one thing, resumes, and compares every file of the output with an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_scaleout import CASES, _assert_identical, _cmd, _kill_run_after_some_jobs, _leftovers, _run


def _reference(example_ckpt, tmp_path_factory, case: str):
    kw, verb, backend = CASES[case]
    src = example_ckpt(**kw)
    ref = tmp_path_factory.mktemp(f"resume-ref-{case}") / "ref"
    _run(_cmd(verb, src, ref, backend, "--workers", "0"))
    return src, verb, backend, ref


@pytest.fixture(scope="module")
def w4a16(example_ckpt, tmp_path_factory):
    """The w4a16 case's source (shared: copy it before changing it) and its uninterrupted output."""
    return _reference(example_ckpt, tmp_path_factory, "w4a16")


def _killed(case, tmp_path, *extra):
    """A run of ``case`` into ``tmp_path/out`` killed mid-way: (command, staging folder, layer/copy records)."""
    src, verb, backend, _ = case
    cmd = _cmd(verb, src, tmp_path / "out", backend, "--workers", 0, *extra)
    staging, finished = _kill_run_after_some_jobs(cmd, tmp_path)
    return cmd, staging, finished


def _records(staging: Path) -> dict[str, dict]:
    """The job records in the staging folder, by file name."""
    jobs = staging / ".jobs"
    return {n: json.loads((jobs / n).read_text()) for n in sorted(os.listdir(jobs))
            if n[:5].isdigit() and n.endswith(".json")}


def _tensor_record(staging: Path, at_least: int = 1) -> tuple[str, dict]:
    """A finished layer or copy job's record with at least ``at_least`` tensors."""
    return next((n, r) for n, r in _records(staging).items() if len(r.get("tensors", {})) >= at_least)


def _where(staging: Path, name: str) -> tuple[Path, int, int]:
    """(shard, first byte, size) of tensor ``name`` in the staging folder, from the shard's header."""
    from moeconvert.format import read_header

    for shard in sorted(staging.glob("*.safetensors")):
        header = read_header(shard)
        if name in header:
            info = header[name]
            return shard, info.start, info.nbytes
    raise AssertionError(f"{name} in no shard")


def _one_line(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeconvert: error: "), p.stderr
    return lines[0]


def _verify(out: Path) -> None:
    _run([sys.executable, "-m", "moeconvert", "verify", str(out)])


# --------------------------------------------------------------------------------------------------
# what a power cut leaves


@pytest.mark.parametrize("damage", ["truncated to 0 bytes", "header page zeroed"])
def test_resume_rewrites_a_damaged_shard(w4a16, tmp_path, damage):
    cmd, staging, finished = _killed(w4a16, tmp_path)
    _, rec = _tensor_record(staging)
    shard, _, _ = _where(staging, next(iter(rec["tensors"])))  # a shard holding a finished job's bytes
    if damage == "truncated to 0 bytes":
        os.truncate(shard, 0)
    else:
        with open(shard, "r+b") as f:
            f.write(bytes(4096))
    p = _run(cmd + ["--resume", "--json"])
    if damage == "truncated to 0 bytes":
        assert json.loads(p.stdout)["jobs"]["kept"] < finished  # what was in that shard was redone
    _assert_identical(w4a16[3], tmp_path / "out")
    _verify(tmp_path / "out")


def test_resume_checks_every_byte_of_every_tensor_of_a_job(w4a16, tmp_path):
    """The last byte of the last tensor of a job that wrote several: a check of only the first tensor
    (or the first bytes) of a record would keep it."""
    cmd, staging, finished = _killed(w4a16, tmp_path)
    _, rec = _tensor_record(staging, at_least=2)
    shard, start, size = _where(staging, sorted(rec["tensors"])[-1])
    with open(shard, "r+b") as f:
        f.seek(start + size - 1)
        b = f.read(1)
        f.seek(start + size - 1)
        f.write(bytes([b[0] ^ 0x01]))
    p = _run(cmd + ["--resume", "--json"])
    assert json.loads(p.stdout)["jobs"]["kept"] == finished - 1
    assert "redone: 1 whose bytes no longer match their record" in p.stderr
    _assert_identical(w4a16[3], tmp_path / "out")


def test_resume_of_a_quantized_run_is_byte_identical(example_ckpt, tmp_path_factory, tmp_path):
    """The manifest too: its quality reports come from records read back from JSON on resume."""
    case = _reference(example_ckpt, tmp_path_factory, "bf16-mxfp4")
    cmd, staging, finished = _killed(case, tmp_path)
    p = _run(cmd + ["--resume", "--json"])
    assert json.loads(p.stdout)["jobs"]["kept"] == finished >= 1
    _assert_identical(case[3], tmp_path / "out")


# --------------------------------------------------------------------------------------------------
# the source changed under the interrupted run


@pytest.fixture
def private_w4a16(w4a16, tmp_path):
    """A private copy of the w4a16 source (times kept, as ``cp -p`` does), safe to change."""
    src, verb, backend, ref = w4a16
    dst = tmp_path / "src"
    shutil.copytree(src, dst)  # copy2: contents and times
    return dst, verb, backend, ref


def test_resume_refuses_a_source_changed_in_place_with_its_size_and_time(private_w4a16, tmp_path):
    src = private_w4a16[0]
    cmd, staging, _ = _killed(private_w4a16, tmp_path)
    victim = sorted(src.glob("*.safetensors"))[0]
    st = os.stat(victim)
    with open(victim, "r+b") as f:  # one byte of tensor data, as `cp -p` of a retrained file would leave it
        f.seek(st.st_size - 1)
        b = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(victim).st_size == st.st_size and os.stat(victim).st_mtime_ns == st.st_mtime_ns
    before = sorted(p.name for p in staging.iterdir())
    p = _run(cmd + ["--resume"], expect=2)
    line = _one_line(p)
    assert victim.name in line and "other bytes than when the interrupted run read it" in line
    assert "run without --resume" in line
    assert not (tmp_path / "out").exists()
    assert staging.is_dir() and sorted(p.name for p in staging.iterdir()) == before  # handed back as it was
    _run(cmd)  # and starting over works, from the new bytes
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("tamper", [{}, {"sha256": "", "size": 0}, {"sha256": "AB" * 32, "size": None}, "x"])
def test_a_damaged_source_digest_record_is_made_again(w4a16, tmp_path, tamper):
    cmd, staging, _ = _killed(w4a16, tmp_path)
    name, rec = next((n, r) for n, r in _records(staging).items() if r["kind"] == "digest")
    rec["digest"] = tamper
    (staging / ".jobs" / name).write_text(json.dumps(rec))
    _run(cmd + ["--resume"])
    _assert_identical(w4a16[3], tmp_path / "out")  # the manifest holds the source's real sha256
    _verify(tmp_path / "out")


def test_a_source_digest_record_of_other_bytes_refuses_the_resume(w4a16, tmp_path):
    """Well formed but not the file's sha256: the record cannot be told from a changed source."""
    cmd, staging, _ = _killed(w4a16, tmp_path)
    name, rec = next((n, r) for n, r in _records(staging).items() if r["kind"] == "digest")
    rec["digest"]["sha256"] = "0" * 64
    (staging / ".jobs" / name).write_text(json.dumps(rec))
    line = _one_line(_run(cmd + ["--resume"], expect=2))
    assert rec["file"] in line and "run without --resume" in line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# links, FIFOs, devices and junk in the staging folder


def _no_links(folder: Path) -> None:
    assert [p.name for p in folder.iterdir() if p.is_symlink() or not p.is_file()] == []


@pytest.mark.parametrize("what", ["shard", ".jobs", "record", "staging folder"])
def test_resume_never_writes_through_a_symlink(w4a16, tmp_path, what):
    """A shard or a record that is a link is made afresh (its job reruns); a staging folder that is a
    link is not taken over (the link is removed, all jobs run); a ``.jobs`` that is a link has no job
    plan to trust: the resume is refused. In no case is anything outside OUT written."""
    cmd, staging, _ = _killed(w4a16, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if what == "shard":
        _, rec = _tensor_record(staging)
        victim, _, _ = _where(staging, next(iter(rec["tensors"])))
    elif what == ".jobs":
        victim = staging / ".jobs"
    elif what == "record":
        victim = staging / ".jobs" / _tensor_record(staging)[0]
    else:
        victim = staging
    target = outside / victim.name
    shutil.move(victim, target)
    os.symlink(target, victim)
    snapshot = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} if target.is_dir() else \
        {target: target.read_bytes()}
    if what == ".jobs":
        assert "no readable job plan" in _one_line(_run(cmd + ["--resume"], expect=2))
        assert {p: p.read_bytes() for p in snapshot} == snapshot
        _run(cmd)  # starting over removes the link, never what it points to
    else:
        _run(cmd + ["--resume"])
    assert {p: p.read_bytes() for p in snapshot} == snapshot  # nothing outside OUT was written
    _no_links(tmp_path / "out")
    _assert_identical(w4a16[3], tmp_path / "out")
    assert _leftovers(tmp_path) == []


def test_resume_removes_what_is_not_its_own_from_the_staging_folder(w4a16, tmp_path):
    cmd, staging, _ = _killed(w4a16, tmp_path)
    os.symlink("/etc/passwd", staging / "extra.safetensors")
    os.mkfifo(staging / "fifo")
    _run(cmd + ["--resume"], )
    _no_links(tmp_path / "out")
    _assert_identical(w4a16[3], tmp_path / "out")


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "device"])
def test_a_job_record_that_is_not_a_regular_file_is_rerun(w4a16, tmp_path, kind):
    cmd, staging, finished = _killed(w4a16, tmp_path)
    path = staging / ".jobs" / _tensor_record(staging)[0]
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        try:
            os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's numbers
        except PermissionError:
            pytest.skip("making a device file needs root")
    p = _run(cmd + ["--resume", "--json"])  # _run's timeout is the hang guard (a FIFO read blocks)
    assert json.loads(p.stdout)["jobs"]["kept"] == finished - 1
    _assert_identical(w4a16[3], tmp_path / "out")


@pytest.mark.parametrize("plan", [
    {"key": 5, "request": [], "source_stat": "x", "jobs": "many", "tool_version": 1},
    {"key": "k", "request": {}, "source_stat": {"model.safetensors": "big"}, "jobs": 3, "tool_version": "1"},
    [1, 2, 3],
])
def test_a_job_plan_of_the_wrong_types_is_refused_in_one_line(w4a16, tmp_path, plan):
    cmd, staging, _ = _killed(w4a16, tmp_path)
    (staging / ".jobs" / "plan.json").write_text(json.dumps(plan))
    line = _one_line(_run(cmd + ["--resume"], expect=2))
    assert "cannot resume the interrupted run" in line and "run without --resume" in line
    assert staging.is_dir() and not (tmp_path / "out").exists()


def test_a_different_chunk_size_names_the_option_typed(w4a16, tmp_path):
    cmd, staging, _ = _killed(w4a16, tmp_path)
    line = _one_line(_run(cmd + ["--resume", "--chunk-mb", "128"], expect=2))
    assert "it was made with --chunk-mb 256, this run has --chunk-mb 128" in line, line


# --------------------------------------------------------------------------------------------------
# one run at a time


def test_a_second_run_on_the_same_output_is_refused_at_once(w4a16, tmp_path):
    src, verb, backend, ref = w4a16
    out = tmp_path / "out"
    cmd = _cmd(verb, src, out, backend, "--workers", 0)
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(".moeconvert-partial-" in p.name for p in tmp_path.iterdir()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run ended before it could be caught"
            time.sleep(0.005)
        os.killpg(first.pid, signal.SIGSTOP)  # alive, holding the output, going nowhere
        second = _run(cmd + ["--resume"], expect=2)
        line = _one_line(second)
        assert f"PID {first.pid}" in line and str(out) in line
        assert not out.exists()
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert first.wait(timeout=600) == 0, first.stderr.read().decode()[-2000:]
    _assert_identical(ref, out)
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# the run options around it


def test_output_dot_is_refused_before_anything_is_done(w4a16, tmp_path):
    src, verb, backend, _ = w4a16
    here = tmp_path / "empty"
    here.mkdir()
    p = subprocess.run(_cmd(verb, src, Path("."), backend), cwd=here, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2
    assert "not '.' or '..'" in _one_line(p)
    assert list(here.iterdir()) == [] and _leftovers(tmp_path) == []


def test_worker_processes_are_capped_by_the_cores_and_the_memory():
    from moeconvert.cli.convert import cap_workers
    from moeconvert.estimate import PROCESS_BYTES

    assert cap_workers(64, 100, 1 << 30, 2, 64 << 30) == (2, "2 core(s)")
    assert cap_workers(4, 3, 1 << 30, 16, 64 << 30) == (3, "3 job(s)")
    # three quarters of 12 GiB hold two processes of a 4 GiB job and their own memory, not three
    n, why = cap_workers(8, 100, 4 << 30, 16, 12 << 30)
    assert n == 9 * (1 << 30) // ((4 << 30) + PROCESS_BYTES) == 2 and "memory" in why
    assert cap_workers(2, 100, 1 << 30, 16, None) == (2, "")  # what was asked, when it fits


def test_workers_beyond_the_cores_are_capped_with_one_notice(w4a16, tmp_path):
    src, verb, backend, _ = w4a16
    from moeconvert.executors import available_cores

    p = _run(_cmd(verb, src, tmp_path / "out", backend, "--workers", 64, "--dry-run", "--no-estimate", "--json"))
    used = min(64, available_cores())
    assert json.loads(p.stdout)["executor"] == f"{used} local worker process(es)"
    assert p.stderr.strip().splitlines() == [f"--workers 64: using {used} worker process(es) ({available_cores()} core(s))"]


def test_ctrl_c_while_worker_processes_start_is_one_line(w4a16, tmp_path):
    src, verb, backend, _ = w4a16
    cmd = _cmd(verb, src, tmp_path / "out", backend, "--workers", 2)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(".moeconvert-partial-" in p.name for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(0.3)  # the workers are importing torch now
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_progress_counts_source_bytes_read_and_hashed(w4a16, tmp_path):
    """One quantity: every source tensor is read once by its job and every source file hashed once for
    the manifest; the bar's total and its advances are exactly that, advancing chunk by chunk."""
    from moeconvert.convert import plan_conversion, run_conversion
    from moeconvert.jobs import plan_jobs
    from moeconvert.sources import open_source

    src = w4a16[0]
    files = sorted(src.glob("*.safetensors"))
    data = 0
    for f in files:
        with open(f, "rb") as h:
            data += f.stat().st_size - 8 - int.from_bytes(h.read(8), "little")
    expected = sum(f.stat().st_size for f in files) + data
    plan = plan_conversion(open_source(str(src)), "marlin")
    jobs = plan_jobs(plan, 1 << 20)
    assert sum(j.work_bytes for j in jobs) == expected
    advances = []
    run_conversion(plan, tmp_path / "out", chunk_bytes=1 << 20, progress=advances.append)
    assert sum(advances) == expected
    layers = [j for j in jobs if j.kind == "layer"]
    assert len(advances) > len(jobs) + len(layers)  # layer jobs advance per chunk, not once at their end


def test_resume_of_a_humming_run_keeps_the_layers_sign_magnitude_facts(example_ckpt, tmp_path_factory, tmp_path):
    """humming decides sign-magnitude per sublayer from a scan of the whole layer (docs/layouts/humming.md):
    each kept layer job's record carries the scan's facts, and the resumed folder is byte for byte the
    uninterrupted one, manifest included (the choice is in its layout_metadata)."""
    kw, _, _ = CASES["w4a16"]
    src = example_ckpt(**{**kw, "group_size": 32}, experts_without_zero_code=tuple(range(8, 16)))
    ref = tmp_path_factory.mktemp("resume-ref-humming") / "ref"
    _run(_cmd(["repack"], src, ref, "humming", "--workers", "0", "--ep-size", "2", "--ep-rank", "1"))
    metadata = json.loads((ref / "moeconvert.json").read_text())["moe_layers"][0]["layout_metadata"]
    assert metadata["w13"]["b_dtype"] == "float4e0m3"  # rank 1's experts 8..15 have no 0 code
    cmd = _cmd(["repack"], src, tmp_path / "out", "humming", "--workers", "0", "--ep-size", "2", "--ep-rank", "1")
    staging, finished = _kill_run_after_some_jobs(cmd, tmp_path)
    layer_records = [r for r in _records(staging).values() if r["kind"] == "layer"]
    assert layer_records, "no layer job had finished"
    for rec in layer_records:
        assert rec["layout_facts"] == [{sub: {"experts_without_zero_code": list(range(8, 16))}
                                        for sub in ("w13", "w2")}]
    _run(cmd + ["--resume"])
    _assert_identical(ref, tmp_path / "out")


def test_a_humming_record_whose_facts_are_not_this_layers_is_rerun(example_ckpt, tmp_path):
    """A kept record's facts must be what a scan of this layer can find (expert indices of the rank): one
    naming other experts is not kept, its job runs again, and the output is still the uninterrupted one."""
    kw, _, _ = CASES["w4a16"]
    src = example_ckpt(**{**kw, "group_size": 32}, experts_without_zero_code=tuple(range(8, 16)))
    cmd = _cmd(["repack"], src, tmp_path / "out", "humming", "--workers", "0", "--ep-size", "2", "--ep-rank", "1")
    staging, finished = _kill_run_after_some_jobs(cmd, tmp_path)
    name, rec = next((n, r) for n, r in _records(staging).items() if r["kind"] == "layer")
    rec["layout_facts"][0]["w2"]["experts_without_zero_code"] = [0, 1]  # experts of the other rank
    (staging / ".jobs" / name).write_text(json.dumps(rec))
    p = _run(cmd + ["--resume"])
    said = " ".join(p.stderr.split())
    assert f"; {finished - 1} of " in said and "layer and copy jobs done and checked" in said, said
    out = json.loads((tmp_path / "out" / "moeconvert.json").read_text())
    assert all(m["layout_metadata"]["w2"]["experts_without_zero_code"] == list(range(8, 16))
               for m in out["moe_layers"])
    assert _run([sys.executable, "-m", "moeconvert", "verify", str(tmp_path / "out"), "--against", str(src)])


def test_a_humming_record_with_plausible_but_false_facts_is_rerun(example_ckpt, tmp_path):
    """Facts that a scan of this rank could find (its own experts) but that the source does not give:
    expert 15 said to have a 0 code in w2, which would make w2 unsigned while its bytes were written in
    sign-magnitude. --resume finds the facts again from the source and reruns the job, so the manifest
    still records what the bytes are."""
    kw, _, _ = CASES["w4a16"]
    src = example_ckpt(**{**kw, "group_size": 32}, experts_without_zero_code=tuple(range(8, 16)))
    cmd = _cmd(["repack"], src, tmp_path / "out", "humming", "--workers", "0", "--ep-size", "2", "--ep-rank", "1")
    staging, finished = _kill_run_after_some_jobs(cmd, tmp_path)
    name, rec = next((n, r) for n, r in _records(staging).items() if r["kind"] == "layer")
    rec["layout_facts"][0]["w2"]["experts_without_zero_code"] = list(range(8, 15))
    (staging / ".jobs" / name).write_text(json.dumps(rec))
    p = _run(cmd + ["--resume"])
    said = " ".join(p.stderr.split())
    assert f"; {finished - 1} of " in said and "redone: 1 whose bytes no longer match their record" in said, said
    out = json.loads((tmp_path / "out" / "moeconvert.json").read_text())
    assert all(m["layout_metadata"]["w2"]["b_dtype"] == "float4e0m3" for m in out["moe_layers"])
    assert _run([sys.executable, "-m", "moeconvert", "verify", str(tmp_path / "out"), "--against", str(src)])


def _files(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` (hidden ones too): a file's bytes, a folder's None."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def test_a_dry_run_leaves_a_killed_runs_leftovers_as_they_are_and_the_next_run_tidies_them(
        w4a16, example_ckpt, tmp_path):
    """A killed run leaves its staging folder and its lock file beside OUT (the kernel drops the lock, the
    file stays). Every verb's --dry-run, with --resume or --overwrite, writes nothing in OUT or beside it;
    the next run that checks OUT tidies them, the lock file too, even when it is refused."""
    from helpers import cli

    src, verb, backend, _ = w4a16
    _killed(w4a16, tmp_path)
    out = tmp_path / "out"
    assert sorted(_leftovers(tmp_path)) == [".out.moeconvert-lock", _staging_name(tmp_path)]
    out.mkdir()
    (out / "theirs").write_text("not ours")
    before = _files(tmp_path)
    bf16 = example_ckpt("qwen3-moe", "bf16", num_layers=1, num_experts=4)
    for args in (["repack", src, out, "--backend", backend], ["quantize", bf16, out, "--format", "mxfp4", "--backend", backend]):
        for extra in ((), ("--resume",), ("--overwrite",), ("--resume", "--json")):
            cli(*args, *extra, "--dry-run", "--no-estimate", expect=0)
            assert _files(tmp_path) == before, (args[0], extra)
    r = cli("repack", src, out, "--backend", backend, expect=2)
    assert "output folder exists and is not empty" in r.err
    assert _leftovers(tmp_path) == [] and _files(out) == {"theirs": b"not ours"}


def _staging_name(parent: Path) -> str:
    return next(p.name for p in parent.iterdir() if ".moeconvert-partial-" in p.name)
