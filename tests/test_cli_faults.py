"""Faults at the command line: mistyped options, unusable paths, signals, killed runs.

Every case ends as the README promises: exactly one line on stderr (``moeconvert: error: ...`` with exit
code 2, or ``moeconvert: interrupted ...`` with 130 / 143), and nothing beside the output that looks like
one (no ``OUT``, no ``.OUT.moeconvert-partial-PID`` or ``.OUT.moeconvert-old-PID``). A run killed with
``kill -9`` cannot clean up; the next run on the same output must, and must then write exactly what an
uninterrupted run writes.

Signals go to real ``python -m moeconvert`` processes. To be sure a signal lands mid-conversion, and at
the point asked for (staging folder made, shards half written), the process is frozen (SIGSTOP) as soon
as its staging folder exists and then let run in 1 ms steps until that point; a run that finished first
is retried on a bigger checkpoint, never counted as a pass.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cli  # tests/ is on sys.path under pytest
from moeconvert.example import make_example

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and POSIX signals")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_example(tmp_path_factory.mktemp("pristine") / "bf16", "qwen3-moe", "bf16", num_layers=2,
                        num_experts=4)


@pytest.fixture(scope="module")
def bigger(tmp_path_factory):
    """``bigger(n)``: the n-th (0, 1, ...) and ever larger checkpoint, for runs that must last a while."""
    made: dict[int, Path] = {}

    def make(n: int) -> Path:
        if n not in made:
            made[n] = make_example(tmp_path_factory.mktemp(f"big{n}") / "ckpt", "qwen3-moe", "bf16",
                                   num_layers=2, num_experts=16 * 4**n)
        return made[n]

    return make


@pytest.fixture
def src(pristine, tmp_path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(pristine, dst)
    return dst


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "moeconvert-partial" in p.name or "moeconvert-old" in p.name)


def refused(args, capsys, *phrases, out: Path | None = None) -> str:
    """Exit 2, one ``moeconvert: error:`` line holding every phrase, and (given ``out``) no trace of it."""
    code, _, err = cli(*args)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moeconvert: error: "), (code, err)
    for p in phrases:
        assert p in lines[0], lines[0]
    if out is not None:
        assert not os.path.lexists(out)
        assert leftovers(out.parent) == []
    return lines[0]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- options -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, phrases", [
    pytest.param(["repack", "{src}", "{out}", "--backend", "plain", "--bogus"],
                 ["repack: no such option: --bogus", "see moeconvert repack --help"], id="unknown-option"),
    pytest.param(["repack", "{src}", "{out}", "--backnd", "plain"],
                 ["no such option: --backnd", "did you mean --backend"], id="mistyped-option"),
    pytest.param(["repack"], ["repack: missing argument", "SRC"], id="missing-argument"),
    pytest.param(["repack", "{src}"], ["repack: missing argument", "OUT"], id="missing-second-argument"),
    pytest.param(["repack", "{src}", "{out}"], ["repack: missing option '--backend'"], id="missing-option"),
    pytest.param(["repack", "{src}", "{out}", "--backend"], ["repack: option '--backend' requires an argument"],
                 id="option-without-value"),
    pytest.param(["repack", "{src}", "{out}", "-b", "plain", "--tp-size", "0"],
                 ["'--tp-size'", "greater than or equal to 1", "found '0'"], id="tp-size-0"),
    pytest.param(["repack", "{src}", "{out}", "-b", "plain", "--chunk-mb=0"], ["'--chunk-mb'", "found '0'"],
                 id="chunk-mb-0"),
    pytest.param(["quantize", "{src}", "{out}", "-b", "plain", "--chunk-mb", "lots"],
                 ["quantize: invalid value for '--chunk-mb'", "integer", "found 'lots'"], id="not-an-integer"),
    pytest.param(["repack", "{src}", "{out}", "-b", "plain", "--tp-size", "2", "--tp-rank", "2"],
                 ["--tp-rank", "below"], id="tp-rank-too-big"),
    pytest.param(["repack", "{src}", "{out}", "extra", "-b", "plain"], ["unexpected extra argument", "extra"],
                 id="extra-argument"),
    pytest.param(["repackk", "{src}", "{out}"],
                 ["no such command 'repackk'", "expected one of: inspect, repack", "see moeconvert --help"],
                 id="unknown-command"),
    pytest.param(["bench", "nope"], ["bench: no such command 'nope'", "see moeconvert bench --help"],
                 id="unknown-subcommand"),
    pytest.param(["--bogus"], ["no such option: --bogus", "see moeconvert --help"], id="unknown-top-option"),
    pytest.param(["repack", "{src}", "{out}", "--backend", "nope"],
                 ["--backend: unknown backend", "found nope", "| marlin |", "plain"], id="unknown-backend"),
    pytest.param(["quantize", "{src}", "{out}", "--backend", "nope"],
                 ["--backend: unknown backend", "flashinfer-cutlass"], id="unknown-quantize-backend"),
])
def test_usage_error_is_one_line_exit_2(args, phrases, src, tmp_path, capsys):
    out = tmp_path / "out"
    refused([a.format(src=src, out=out) for a in args], capsys, *phrases, out=out)


def test_usage_error_with_debug_adds_the_traceback(capsys):
    code, _, err = cli(*["--debug", "repack", "--bogus"])
    assert code == 2 and "Traceback" in err
    assert err.splitlines()[-1].startswith("moeconvert: error: repack: no such option: --bogus")


def test_help_lists_the_backends_and_exits_0(capsys):
    from moeconvert.layouts import layout_kinds, layout_names

    code, out, err = cli(*["repack", "--help"])
    assert code == 0 and not err
    assert " | ".join(layout_names()) in " ".join(out.split())
    code, out, err = cli(*["quantize", "--help"])
    assert code == 0 and not err
    assert " | ".join(n for n in layout_names() if "mxfp4" in layout_kinds(n)) in " ".join(out.split())


@pytest.mark.parametrize("args", [[], ["bench"]])
def test_no_arguments_show_the_help(args, capsys):
    before = signal.getsignal(signal.SIGINT)
    code, out, err = cli(*args)
    assert code == 0 and out.startswith("Usage: moeconvert") and not err
    assert signal.getsignal(signal.SIGINT) is before  # main() gives the signal handlers back


def test_a_bug_is_an_internal_error(src, tmp_path, capsys, monkeypatch):
    import moeconvert.cli.convert

    def broken(*a, **k):
        raise ValueError("a bug\nover two lines")

    monkeypatch.setattr(moeconvert.cli.convert, "_convert", broken)
    code, _, err = cli(*["repack", src, tmp_path / "out", "-b", "plain"])
    assert code == 1 and err.splitlines() == ["moeconvert: internal error: ValueError: a bug over two lines "
                                              "(rerun with --debug for the traceback)"]


# -- paths -------------------------------------------------------------------------------------------


def test_output_name_too_long(src, tmp_path, capsys):
    out = tmp_path / ("o" * 300)
    refused(["repack", src, out, "-b", "plain"], capsys, "longer than the file system allows")
    assert leftovers(tmp_path) == []


def test_output_name_fits_but_its_staging_folder_would_not(src, tmp_path, capsys):
    out = tmp_path / ("o" * 240)
    refused(["repack", src, out, "-b", "plain"], capsys, "staging folder", "longer than the file system allows",
            out=out)


def test_output_under_a_name_too_long(src, tmp_path, capsys):
    out = tmp_path / ("d" * 300) / "out"
    refused(["repack", src, out, "-b", "plain"], capsys, "longer than the file system allows")
    assert leftovers(tmp_path) == []


def test_source_name_too_long(tmp_path, capsys):
    out = tmp_path / "out"
    refused(["repack", tmp_path / ("s" * 300), out, "-b", "plain"], capsys, "cannot open the checkpoint folder",
            "longer than the file system allows", out=out)


def test_output_is_a_symlink_loop(src, tmp_path, capsys):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "loop")
    (tmp_path / "loop").symlink_to(out)
    refused(["repack", src, out, "-b", "plain", "--overwrite"], capsys, "symbolic link loop")
    assert out.is_symlink() and leftovers(tmp_path) == []


def test_output_is_a_dangling_symlink(src, tmp_path, capsys):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere")
    refused(["repack", src, out, "-b", "plain"], capsys, "symbolic link to nothing", "nowhere")
    assert out.is_symlink() and not (tmp_path / "nowhere").exists() and leftovers(tmp_path) == []


def test_source_folder_is_a_symlink_loop(tmp_path, capsys):
    a, out = tmp_path / "a", tmp_path / "out"
    a.symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(a)
    refused(["repack", a, out, "-b", "plain"], capsys, "symbolic link loop", out=out)


def test_source_shard_is_a_symlink_loop(src, tmp_path, capsys):
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to("other.safetensors")
    (src / "other.safetensors").symlink_to("model.safetensors")
    out = tmp_path / "out"
    refused(["repack", src, out, "-b", "plain"], capsys, "model.safetensors", "loop", out=out)


@pytest.mark.parametrize("spec", ["./ckpt-typo", "/nonexistent-moeconvert/ckpt", "some/dir/that/does/not/exist",
                                  "~/nonexistent-moeconvert-ckpt", "ckpt-typo"])
def test_mistyped_local_path_is_no_such_folder(spec, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    line = refused(["repack", spec, out, "-b", "plain"], capsys, out=out)
    assert line == f"moeconvert: error: {spec}: no such folder"


def test_repo_id_neither_here_nor_in_the_cache(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    out = tmp_path / "out"
    refused(["repack", "nobody-moeconvert/nothing", out, "-b", "plain"], capsys, "nobody-moeconvert/nothing: ",
            "no such local folder, and not in the Hugging Face cache", out=out)


def test_overwrite_through_a_symlinked_output_replaces_its_folder(src, tmp_path, capsys):
    disk = tmp_path / "disk"
    real = disk / "real"
    real.mkdir(parents=True)
    (real / "previous.txt").write_text("previous")
    out = tmp_path / "out"
    out.symlink_to(real)
    refused(["repack", src, out, "-b", "plain"], capsys, "not empty", "--overwrite")
    assert (real / "previous.txt").exists()
    code, _, err = cli(*["repack", src, out, "-b", "plain", "--overwrite"])
    assert code == 0 and not err
    assert out.is_symlink() and out.resolve() == real.resolve()  # the link is kept, its folder replaced
    assert (real / "moeconvert.json").is_file() and not (real / "previous.txt").exists()
    assert leftovers(tmp_path) == [] and leftovers(disk) == []


# -- what killed runs left ---------------------------------------------------------------------------


def test_next_run_removes_staging_of_dead_runs_only(src, tmp_path, capsys):
    out, pid = tmp_path / "out", dead_pid()
    dead = tmp_path / f".out.moeconvert-partial-{pid}"
    (dead / "sub").mkdir(parents=True)
    (dead / "model-00001-of-00001.safetensors").write_bytes(b"half")
    dead_old = tmp_path / f".out.moeconvert-old-{pid}"
    dead_old.mkdir()
    live = tmp_path / f".out.moeconvert-partial-{os.getppid()}"  # a running process: maybe another run
    live.mkdir()
    not_ours = [tmp_path / f".out.moeconvert-partial-{pid}x", tmp_path / f".out2.moeconvert-partial-{pid}",
                tmp_path / f".out.moeconvert-partial-0"]
    for p in not_ours:
        p.mkdir()
    code, _, err = cli(*["repack", src, out, "-b", "plain"])
    assert code == 0 and not err and (out / "moeconvert.json").is_file()
    assert not dead.exists() and not dead_old.exists()  # `out` exists: the replaced output is not needed
    assert live.is_dir() and all(p.is_dir() for p in not_ours)


def test_output_moved_aside_by_a_killed_overwrite_is_put_back(src, tmp_path, capsys):
    out = tmp_path / "out"
    old = tmp_path / f".out.moeconvert-old-{dead_pid()}"
    old.mkdir()
    (old / "previous.txt").write_text("previous")
    refused(["repack", src, out, "-b", "plain"], capsys, "not empty", "--overwrite")
    assert (out / "previous.txt").read_text() == "previous" and leftovers(tmp_path) == []


def test_example_removes_dead_staging_and_refuses_a_loop(tmp_path, capsys):
    out = tmp_path / "ex"
    dead = tmp_path / f".ex.moeconvert-partial-{dead_pid()}"
    dead.mkdir()
    code, _, err = cli(*["example", out, "--scheme", "bf16", "--layers", "1", "--experts", "2"])
    assert code == 0 and not err and (out / "config.json").is_file() and leftovers(tmp_path) == []
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    refused(["example", loop, "--scheme", "bf16"], capsys, "symbolic link loop")
    assert leftovers(tmp_path) == []


# -- signals and kill -9 -----------------------------------------------------------------------------


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _freeze(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    while _state(pid) not in ("T", "t", "Z"):
        time.sleep(0.0005)


def _half_written(staging: Path) -> bool:
    """Half the shard data really on disk (shards are made at full size, sparse, then filled)."""
    try:
        shards = [p.stat() for p in staging.glob("*.safetensors")]
    except OSError:
        return False
    return bool(shards) and 2 * sum(st.st_blocks * 512 for st in shards) >= sum(st.st_size for st in shards)


def signal_mid_run(args: list, out: Path, sig: int, ready=lambda staging: True, timeout: float = 120):
    """Run ``moeconvert ARGS`` and send ``sig`` at the first moment ``ready(staging)`` holds.

    The run is frozen as soon as its staging folder exists, then let run in 1 ms steps, frozen again
    after each, until ``ready``: so even a fast run is caught where asked. Returns (exit code, stderr),
    or None when the run finished before (its staging folder gone while it was frozen).
    """
    proc = subprocess.Popen([sys.executable, "-m", "moeconvert", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    staging = out.parent / f".{out.name}.moeconvert-partial-{proc.pid}"
    deadline = time.monotonic() + timeout
    caught = False
    try:
        while proc.poll() is None and time.monotonic() < deadline and not staging.is_dir():
            time.sleep(0.0005)
        if proc.poll() is None:
            _freeze(proc.pid)
            # Frozen with its staging folder in place: the swap that makes OUT appear has not happened.
            while staging.is_dir() and not ready(staging) and time.monotonic() < deadline:
                os.kill(proc.pid, signal.SIGCONT)
                time.sleep(0.001)
                _freeze(proc.pid)
            caught = staging.is_dir() and ready(staging)
            if caught:
                os.kill(proc.pid, sig)
            os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    finished = proc.returncode == 0 or (out / "moeconvert.json").exists()
    return None if not caught or finished else (proc.returncode, err.decode())


def repack_args(src: Path, out: Path, *extra) -> list:
    return ["repack", src, out, "--backend", "plain", "--chunk-mb", "1", *extra]


def interrupted(bigger, tmp_path, sig, prepare=lambda out: None, extra=(), ready=lambda staging: True):
    """(exit code, stderr, out, n) of a run hit by ``sig``, retried on bigger checkpoints until one is hit."""
    for n in range(3):
        out = tmp_path / f"out{n}"
        prepare(out)
        result = signal_mid_run(repack_args(bigger(n), out, *extra), out, sig, ready)
        if result is not None:
            return (*result, out, n)
    pytest.fail("every run finished before it could be signalled")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_removes_staging_and_says_so(sig, code, bigger, tmp_path):
    rc, err, out, _ = interrupted(bigger, tmp_path, sig, ready=_half_written)
    assert rc == code, err
    assert err.splitlines() == [f"moeconvert: interrupted ({signal.Signals(sig).name}); "
                                "no unfinished output was left behind"]
    assert not os.path.lexists(out) and leftovers(tmp_path) == []


def test_sigterm_during_overwrite_keeps_the_previous_output(bigger, tmp_path):
    def previous(out):
        out.mkdir()
        (out / "previous.txt").write_text("previous")

    rc, err, out, _ = interrupted(bigger, tmp_path, signal.SIGTERM, prepare=previous, extra=["--overwrite"])
    assert rc == 143 and len(err.splitlines()) == 1 and err.startswith("moeconvert: interrupted (SIGTERM)"), err
    assert [p.name for p in out.iterdir()] == ["previous.txt"] and leftovers(tmp_path) == []


@pytest.mark.parametrize("ready", [lambda staging: True, _half_written], ids=["staging-made", "half-written"])
def test_kill_9_then_the_same_command_gives_the_same_bytes(ready, bigger, tmp_path, capsys):
    rc, _, out, n = interrupted(bigger, tmp_path, signal.SIGKILL, ready=ready)
    assert rc == -signal.SIGKILL and leftovers(tmp_path)  # it could not clean up: the next run must
    code, _, err = cli(*repack_args(bigger(n), out))
    assert code == 0 and not err and leftovers(tmp_path) == [], err
    ref = tmp_path / "reference"
    code, _, err = cli(*repack_args(bigger(n), ref))
    assert code == 0 and files(out) == files(ref), err
