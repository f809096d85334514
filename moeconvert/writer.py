"""The output folder's life: checked before any work, staged beside it, locked, published by one rename.

:func:`check_output_target` refuses an output that would clobber data before anything is read.
:class:`StagedOutput` takes the output's lock (:class:`OutputLock`: one run at a time), makes the staging
folder with every shard preallocated to the plan's file layout (``moeconvert.plan``: shards, headers and
every tensor's offsets are fixed before the first byte), or with ``--resume`` takes over and repairs the one
a killed run of the same plan left; the jobs (``moeconvert.jobs``) ``pwrite`` their tensors into it. The
output appears, by one rename, only once every shard, the index, the copied files and finally
``moeconvert.json`` are on disk; a failure removes the staging folder and leaves any earlier output
untouched. What killed runs leave beside an output (staging folders, a replaced output, the lock file) is
tidied by the next run that checks it (:func:`clear_leftovers`); a ``--dry-run`` reads and writes nothing there.
"""

from __future__ import annotations

import errno
import fcntl
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
from moeconvert.plan import (JOBS_DIR, PLAN_FILE, PlannedTensor, Shard, dtype_code, layout_shards,  # noqa: F401
                             read_small_file)


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
    _clear_dead_lock(out)
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


def _clear_dead_lock(out: Path) -> None:
    """A killed run's lock file: the kernel dropped its ``flock`` with the process, but the file stays. It is
    removed as ``OutputLock.release`` removes it, while locked by us: a live run's lock (ours included, which
    is another open file) refuses ours and stays; a run that opened it meanwhile locks a fresh one."""
    path = OutputLock(out).path
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # none (or not a file of ours to open)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if stat.S_ISREG(os.fstat(fd).st_mode) and os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    except OSError:
        pass  # held by a live run, or gone: nothing of a dead run's to tidy
    finally:
        os.close(fd)


def _write_json_durably(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        os.unlink(tmp)  # whatever a killed run (or anyone) left under that name: never written through
    except FileNotFoundError:
        pass
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
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
        jobs_dir = cand / JOBS_DIR
        data = None if os.path.islink(jobs_dir) else read_small_file(jobs_dir / PLAN_FILE, PLAN_MAX_BYTES)
        try:
            earlier = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):
            earlier = None
        if earlier is None:
            refusals.append((cand, "it has no readable job plan (made before --resume existed, or damaged)"))
            continue
        if not _plan_well_formed(earlier):
            refusals.append((cand, "its job plan is damaged (values of the wrong type)"))
            continue
        if earlier["key"] != plan["key"]:
            refusals.append((cand, _plan_difference(earlier, plan)))
            continue
        changed = [name for name, st in plan["source_stat"].items() if earlier["source_stat"].get(name) != st]
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


PLAN_MAX_BYTES = 1 << 20


def _plan_well_formed(p) -> bool:
    """The job plan has the types this version writes (``run_conversion``'s record)."""
    return (isinstance(p, dict) and isinstance(p.get("key"), str) and isinstance(p.get("request"), dict)
            and isinstance(p.get("tool_version"), str) and type(p.get("jobs")) is int
            and isinstance(p.get("source_stat"), dict)
            and all(isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)
                    for v in p["source_stat"].values()))


#: the request's fields as the user typed them: (option, how its value is shown)
_OPTION_OF = {
    "chunk_bytes": ("--chunk-mb", lambda v: v >> 20 if type(v) is int else v),
    "max_shard_size": ("--max-shard-size", lambda v: v),
    "backend": ("--backend", lambda v: v),
    "dtype": ("--dtype", lambda v: v),
    "revision": ("--revision", lambda v: v),
    "src": ("SRC", lambda v: v),
}


def _plan_difference(earlier: dict, plan: dict) -> str:
    """What makes an earlier job plan another conversion, in a few words, naming the option typed."""
    a, b = earlier.get("request") or {}, plan.get("request") or {}
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            option, shown = _OPTION_OF.get(k, (k, lambda v: v))
            return (f"it was made with {option} {json.dumps(shown(a.get(k)))}, this run has "
                    f"{option} {json.dumps(shown(b.get(k)))}")
    if earlier.get("tool_version") != plan.get("tool_version"):
        return f"it was made by moeconvert {earlier.get('tool_version')}, this is {plan.get('tool_version')}"
    return "it converted another source or planned other jobs"


def _lmode(path: Path) -> int:
    """``path``'s own file type (0 when it does not exist)."""
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _remove(path: Path) -> None:
    """Remove ``path`` itself, whatever it is; a link is removed, never what it points to."""
    mode = _lmode(path)
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    elif mode:
        os.unlink(path)


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
    if out.name in ("", ".", ".."):
        raise MoeConvertError("the output must be a folder named by the path, not '.' or '..' (its staging folder "
                              "goes beside it, and it is replaced at the end); name a new folder, e.g. ./out",
                              file=str(out))
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


class OutputLock:
    """One run at a time on an output: an exclusive ``flock`` on ``.OUT.moeconvert-lock`` beside it, taken
    before anything is planned into the staging folder, so a second run (``--resume`` or not) is refused
    at once, naming the process that holds it, instead of converting everything to be refused at the end.
    The kernel drops the lock when its holder dies (``kill -9`` included): a stale file locks nothing."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}.moeconvert-lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise MoeConvertError(f"another moeconvert run (PID {holder}) is writing this output; wait for it to "
                                      "end or stop it, then run again", file=str(self.out))
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if not same:  # its holder removed it between our open and our lock: lock the new one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self.fd = fd
            return
        raise MoeConvertError("cannot take the output's lock", file=str(self.path))

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a run waiting on this file locks a fresh one
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


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
        self._lock = OutputLock(self.out)
        try:
            self._lock.acquire()
        except OSError as e:
            raise MoeConvertError(f"cannot write the output: {e.strerror}", file=str(self.out)) from e
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
            else:
                self._repair()
        except OSError as e:
            self._cleanup()
            self._lock.release()
            raise MoeConvertError(f"cannot write the output: {e.strerror}", file=str(self.out)) from e
        except BaseException:  # a signal while setting up: __exit__ will not run for a failed __enter__
            self._cleanup()
            self._lock.release()
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

    def _repair(self) -> None:
        """Make a taken-over staging folder hold exactly the layout's files, each a regular file of its
        planned size under its planned header, before any job is kept.

        A power cut can leave an unsynced shard empty or with a zeroed header page, and anything can
        have been put in its place (a link out of OUT, a FIFO): the headers are ours, so they are
        written again, sizes restored, and a name that is not a regular file (or not a name of ours)
        is removed and made afresh. The tensors' bytes are judged after, against the job records:
        whatever this restores as zeros no longer hashes to its record, and its job runs again."""
        mine = {s.filename for s in self.shards} | {JOBS_DIR}
        for entry in os.scandir(self.staging):
            if entry.name not in mine:
                _remove(Path(entry.path))
        jobs = self.staging / JOBS_DIR
        if not stat.S_ISDIR(_lmode(jobs)):
            _remove(jobs)
            jobs.mkdir()
        for entry in os.scandir(jobs):
            if not entry.is_file(follow_symlinks=False) and not entry.is_dir(follow_symlinks=False):
                _remove(Path(entry.path))  # links, FIFOs, devices: never read, and never published
            elif entry.is_dir(follow_symlinks=False):
                _remove(Path(entry.path))
        for shard in self.shards:
            path = self.staging / shard.filename
            if not stat.S_ISREG(_lmode(path)):
                _remove(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise MoeConvertError("a staging shard is not a regular file", file=str(path))
                os.pwrite(fd, shard.header, 0)
                if os.fstat(fd).st_size != shard.size:
                    os.ftruncate(fd, shard.size)
            finally:
                os.close(fd)
        _write_json_durably(jobs / PLAN_FILE, self.plan)

    def hand_back(self) -> None:
        """Give the taken-over staging folder its old name again (a refused ``--resume`` loses nothing)."""
        if self.resumed_from is not None and not os.path.lexists(self.resumed_from):
            try:
                os.rename(self.staging, self.resumed_from)
            except OSError:
                pass

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                self._cleanup()
        finally:
            self._lock.release()

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
            for entry in os.scandir(self.staging):  # an output never holds a link (or anything but files)
                if not entry.is_file(follow_symlinks=False):
                    raise MoeConvertError("the staging folder holds something that is not a regular file; "
                                          "nothing was published", file=entry.path)
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
