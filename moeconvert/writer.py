"""The writer: sharded safetensors written in place from a plan, inside a staging folder.

The whole file layout (shards, headers, every tensor's offsets) is fixed before the first byte is
written, so each tensor can be filled piece by piece (a chunk of experts at a time) with ``pwrite`` and
hashed as it goes: peak memory is one chunk, whatever the size of the model. The output folder only
appears, by one rename, once every shard, the index, the copied files and finally ``moeconvert.json``
are on disk; a failure removes the staging folder and leaves any earlier output untouched.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format import INDEX_NAME, MANIFEST_NAME
# the plan's file layout: re-exported, it was defined here before moeconvert.plan existed
from moeconvert.plan import JOBS_DIR, PLAN_FILE, PlannedTensor, Shard, dtype_code, layout_shards  # noqa: F401


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def leftover_path(out: Path, what: str, pid: int | None = None) -> Path:
    """``.OUT.moeconvert-partial-PID`` (the staging folder) or ``.OUT.moeconvert-old-PID`` (the output
    being replaced): hidden, named after the output and the process, so a later run can tell them apart."""
    return out.parent / f".{out.name}.moeconvert-{what}-{os.getpid() if pid is None else pid}"


def _pid_gone(pid: int) -> bool:
    """True only when no process ``pid`` runs (a zombie counts as gone: it will never clean up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False  # someone else's process, or not a pid a process of ours could have had
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def clear_leftovers(out: Path, keep_partial: bool = False) -> None:
    """Tidy what runs on ``out`` that were killed (``kill -9``, a crash, power loss) left beside it.

    Only names of exactly our pattern whose process no longer runs are touched; a live run's folders
    are left alone. A staging folder is removed. A replaced output (the run died between its two
    renames) is put back as ``out`` when ``out`` is missing, else removed, so a killed ``--overwrite``
    never loses the previous output.
    """
    prefix = f".{out.name}.moeconvert-"
    try:
        names = sorted(e.name for e in os.scandir(out.parent) if e.name.startswith(prefix))
    except OSError:
        return  # no parent (yet), or unreadable: nothing of ours can be there, and the checks say why
    for name in names:
        m = re.fullmatch(r"(partial|old)-([1-9][0-9]{0,9})", name[len(prefix):])
        if not m or int(m[2]) == os.getpid() or not _pid_gone(int(m[2])):
            continue
        if keep_partial and m[1] == "partial":
            continue  # --resume may take it over
        path = out.parent / name
        try:
            if path.is_symlink():
                path.unlink()  # only the link: never what it points to
            elif not path.is_dir():
                continue  # a file of that name is not ours
            elif m[1] == "old" and not os.path.lexists(out):
                os.rename(path, out)
            else:
                shutil.rmtree(path)
        except OSError:
            pass  # a concurrent run got there first, or we may not: it stays, harmlessly hidden


def _write_json_durably(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _dead_partials(out: Path) -> list[Path]:
    """Staging folders beside ``out`` of runs that no longer run (newest first)."""
    prefix = f".{out.name}.moeconvert-partial-"
    try:
        entries = [e for e in os.scandir(out.parent) if e.name.startswith(prefix)]
    except OSError:
        return []
    found = []
    for e in entries:
        pid = e.name[len(prefix):]
        if not re.fullmatch(r"[1-9][0-9]{0,9}", pid) or int(pid) == os.getpid() or not _pid_gone(int(pid)):
            continue
        if e.is_dir(follow_symlinks=False):
            found.append(Path(e.path))
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _claim_partial(out: Path, staging: Path, plan: dict) -> Path | None:
    """Take over the staging folder a killed run of the same plan left beside ``out`` (one rename, so
    two runs cannot both take it). None when there is none. A killed run of a different command, or of
    this one on a source changed since, is refused: resuming it would mix two outputs."""
    refusals = []
    for cand in _dead_partials(out):
        try:
            earlier = json.loads((cand / JOBS_DIR / PLAN_FILE).read_text())
        except (OSError, ValueError):
            refusals.append((cand, "it has no readable job plan (made before --resume existed, or damaged)"))
            continue
        if not isinstance(earlier, dict):
            refusals.append((cand, "its job plan is damaged"))
            continue
        if earlier.get("key") != plan["key"]:
            refusals.append((cand, _plan_difference(earlier, plan)))
            continue
        changed = [name for name, st in plan["source_stat"].items() if earlier.get("source_stat", {}).get(name) != st]
        if changed:
            raise MoeConvertError(f"cannot resume: source file {changed[0]} changed since the interrupted run "
                                  "(size or modification time); run without --resume to start over",
                                  file=str(cand.name))
        os.rename(cand, staging)
        return cand
    if refusals:
        cand, why = refusals[0]
        raise MoeConvertError(f"cannot resume the interrupted run: {why}; run without --resume to start over "
                              "(that removes it)", file=str(cand.name))
    return None


def _plan_difference(earlier: dict, plan: dict) -> str:
    """What makes an earlier job plan another conversion, in a few words."""
    a, b = earlier.get("request") or {}, plan.get("request") or {}
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"it was made with {k} = {json.dumps(a.get(k))}, this run has {json.dumps(b.get(k))}"
    if earlier.get("tool_version") != plan.get("tool_version"):
        return f"it was made by moeconvert {earlier.get('tool_version')}, this is {plan.get('tool_version')}"
    return "it converted another source or planned other jobs"


def _path_problem(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "the path is a symbolic link loop"
    if e.errno == errno.ENAMETOOLONG:
        return "the name is longer than the file system allows"
    return e.strerror


def output_folder(out: Path) -> Path:
    """The folder a run on ``out`` writes: ``out`` itself, or the folder ``out`` is a symbolic link to.

    A link to a folder (often onto a bigger disk) is kept and its target replaced: staging goes next to
    the target, on the target's file system, where the final rename has to happen. A dangling link or a
    link loop is refused.
    """
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return out
    except OSError as e:
        raise MoeConvertError(f"cannot use the output path: {_path_problem(e)}", file=str(out)) from e
    if not stat.S_ISLNK(st.st_mode):
        return out
    try:
        return out.resolve(strict=True)
    except FileNotFoundError as e:
        raise MoeConvertError("the output path is a symbolic link to nothing", file=str(out),
                              found=os.readlink(out)) from e
    except RuntimeError as e:  # pathlib before Python 3.13 reports a loop so
        raise MoeConvertError("the output path is a symbolic link loop", file=str(out)) from e
    except OSError as e:
        raise MoeConvertError(f"cannot use the output path: {_path_problem(e)}", file=str(out)) from e


def _hold_signals():
    """Block SIGINT / SIGTERM in this thread until :func:`_release_signals`: a signal then arrives
    after the two renames that swap an output in, never between them."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _release_signals(mask) -> None:
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class StagedOutput:
    """Shard files being filled in a staging folder next to the final output.

    ``out`` may be a symbolic link to a folder: the folder it points to is what gets replaced. With no
    shards, the staging folder is simply made, for a caller to fill before :meth:`publish`.

    ``plan``: the job plan's fingerprint and the record kept for ``--resume`` (written to
    ``.jobs/plan.json``); with ``resume``, the staging folder a killed run of the same plan left beside
    ``out`` is taken over (renamed to this process's name) instead of starting empty.
    """

    def __init__(self, out: Path, shards: list[Shard], overwrite: bool, plan: dict | None = None,
                 resume: bool = False):
        self.out = output_folder(Path(out))
        self.overwrite = overwrite
        self.shards = shards
        self.plan = plan
        self.resume = resume
        self.resumed_from: Path | None = None  # the folder taken over by --resume
        self.staging = leftover_path(self.out, "partial")
        self._old: Path | None = None  # the replaced output, while it is moved aside

    def __enter__(self) -> "StagedOutput":
        if not self.resume:
            clear_leftovers(self.out)
        try:
            if os.path.lexists(self.staging):  # ours, from an earlier run in this same process
                shutil.rmtree(self.staging)
            if self.resume and self.plan is not None:
                self.resumed_from = _claim_partial(self.out, self.staging, self.plan)
            clear_leftovers(self.out)  # what --resume did not take over
            if self.resumed_from is None:
                self._create()
        except OSError as e:
            self._cleanup()
            raise MoeConvertError(f"cannot write the output: {e.strerror}", file=str(self.out)) from e
        except BaseException:  # a signal while setting up: __exit__ will not run for a failed __enter__
            self._cleanup()
            raise
        return self

    def _create(self) -> None:
        self.staging.mkdir(parents=True)
        for shard in self.shards:
            fd = os.open(self.staging / shard.filename, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(fd, shard.header, 0)
                os.ftruncate(fd, shard.size)
            finally:
                os.close(fd)
        if self.plan is not None:
            jobs = self.staging / JOBS_DIR
            jobs.mkdir()
            _write_json_durably(jobs / PLAN_FILE, self.plan)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._cleanup()

    def _cleanup(self) -> None:
        """Leave things as they were: no staging folder, and the previous output (if any) in place."""
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._old is not None:
            try:
                if os.path.lexists(self.out):  # the new output is in: the old one was being removed
                    shutil.rmtree(self._old)
                else:
                    os.rename(self._old, self.out)
                self._old = None
            except OSError:
                pass  # left hidden beside the output; the next run on it puts it back or removes it

    def finish(self, index: dict, copies: list[Path], manifest: dict, rewritten: dict[str, bytes] | None = None) -> None:
        """Index, copied files (``rewritten``: those written with other bytes), then the manifest (last),
        then the one rename that makes it visible."""
        try:
            for shard in self.shards:  # each job synced its own writes; the headers are ours
                fd = os.open(self.staging / shard.filename, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            shutil.rmtree(self.staging / JOBS_DIR, ignore_errors=True)
            (self.staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            for p in copies:
                if p.name in (rewritten or {}):
                    (self.staging / p.name).write_bytes(rewritten[p.name])
                else:
                    shutil.copyfile(p, self.staging / p.name)
            tmp = self.staging / (MANIFEST_NAME + ".tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps(manifest, indent=1, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.staging / MANIFEST_NAME)
            self._publish()
        except OSError as e:
            self._cleanup()
            raise MoeConvertError(f"cannot finish the output: {e.strerror}", file=str(self.out)) from e

    def publish(self) -> None:
        """Make the filled staging folder the output (for callers that fill it themselves)."""
        self._publish()

    def _publish(self) -> None:
        out = self.out
        mask = _hold_signals()
        try:
            if os.path.lexists(out):
                if any(out.iterdir()):
                    if not self.overwrite:  # checked before converting too; something appeared meanwhile
                        raise MoeConvertError("output folder exists and is not empty (use --overwrite)",
                                              file=str(out))
                    self._old = leftover_path(out, "old")
                    os.rename(out, self._old)
                else:
                    out.rmdir()
            os.rename(self.staging, out)
        finally:
            _release_signals(mask)
        if self._old is not None:
            shutil.rmtree(self._old, ignore_errors=True)
            self._old = None


def check_output_target(out: Path, source_root: Path | None, overwrite: bool,
                        make_parents: bool = False, resume: bool = False) -> None:
    """Refuse, before any work, outputs that would clobber data or that the file system cannot hold.

    Also tidies what killed runs left beside the output (:func:`clear_leftovers`) first, so that a
    previous output they had moved aside is back in place before it is judged. ``make_parents``: a
    missing parent folder is fine (the staging folder is made with its parents).
    """
    real = output_folder(out)
    staging = leftover_path(real, "partial")
    try:
        os.lstat(staging)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise MoeConvertError(f"the name is too long: the staging folder beside it adds "
                                  f"{len(staging.name) - len(real.name)} characters and would be longer than "
                                  "the file system allows", file=str(out)) from e
        raise MoeConvertError(f"cannot use the output path: {_path_problem(e)}", file=str(out)) from e
    clear_leftovers(real, keep_partial=resume)
    out_r = real.resolve()
    if source_root is not None:
        src_r = source_root.resolve()
        if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
            raise MoeConvertError("the output folder must be outside the source checkpoint (and not contain it)",
                                  file=str(out))
    if os.path.lexists(real):
        if not real.is_dir():
            raise MoeConvertError("output path exists and is not a folder", file=str(out))
        try:
            non_empty = any(real.iterdir())
        except OSError as e:
            raise MoeConvertError(f"cannot read the output folder: {e.strerror}", file=str(out)) from e
        if non_empty and not overwrite:
            raise MoeConvertError("output folder exists and is not empty (use --overwrite to replace it)",
                                  file=str(out))
    parent = out_r.parent
    if make_parents and not os.path.lexists(parent):
        return
    if not parent.is_dir():
        raise MoeConvertError("the output's parent folder does not exist", file=str(parent))
    if not os.access(parent, os.W_OK):
        raise MoeConvertError("cannot write in the output's parent folder", file=str(parent))
