"""Jobs: one conversion cut into independent pieces of work that can run anywhere, assembled last.

The plan fixes the whole output before anything runs: every tensor has its shard and its offset in it
(:func:`moeconvert.writer.layout_shards`). So a job writes its tensors straight into the preallocated
shard files of the staging folder, from any process on any machine that sees that folder, and the
finalize step has nothing to copy: it gathers the jobs' records into the index and the manifest
(written last) and renames the folder into place. The bytes a job writes depend only on the plan, so
the output is the same whatever ran the jobs, and in whatever order.

Kinds of job:

* ``layer``: one MoE layer, decoded (and quantized) and encoded a chunk of experts at a time. A layer
  is never split: each of its tensors is written by one job, in order, and hashed as it is written.
* ``copy``: a run of pass-through tensors in plan order, up to ``job_bytes``, copied byte for byte.
* ``digest``: one source file's sha256, for the manifest.

A job ends with its record, ``.jobs/NNNNN.json`` in the staging folder, renamed into place once its
bytes are written and its files closed: the sha256 of each tensor it wrote, the layer's quality report,
the file digest. Nothing is synced per job (the finalize step syncs every shard once, before the
manifest): ``--resume`` keeps a job only if its record is there *and* its bytes still hash to it, so a
record that outlived its data in a power cut costs a rerun of that job, never a wrong byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from moeconvert import __version__
from moeconvert.canonical import Partition
from moeconvert.errors import InternalError, MoeConvertError

from moeconvert.plan import DEFAULT_CHUNK_BYTES, DEFAULT_JOB_BYTES, JOBS_DIR, PLAN_FILE  # noqa: F401


@dataclass(frozen=True)
class Request:
    """What a worker needs to plan the same conversion again, on its own (picklable, small).

    ``src`` is what the user typed (it is the manifest's ``source.id``); ``src_path`` the folder it
    named, made absolute so a worker with another working directory finds it; ``revision`` the Hub
    commit the driver resolved, so every worker reads the same snapshot.
    """

    src: str
    backend: str
    src_path: str | None = None
    revision: str | None = None
    partition: Partition = field(default_factory=Partition)
    max_shard_size: int = 5 * 10**9
    quant: object = None  # moeconvert.quantize.Quantization (kept untyped: no torch import here)
    dtype: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    job_bytes: int = DEFAULT_JOB_BYTES

    def open(self):
        """``(plan, jobs)`` exactly as the driver made them."""
        from moeconvert.plan import plan_conversion
        from moeconvert.modelmap import map_model
        from moeconvert.sources import open_source

        source = open_source(self.src_path or self.src, self.revision)
        source.ident = self.src
        model = map_model(source)
        dtype = self.dtype
        if self.quant is not None:
            from moeconvert.quantize import resolve_model_dtype

            dtype = resolve_model_dtype(model.dtype, dtype)
        plan = plan_conversion(source, self.backend, self.partition, self.max_shard_size, model=model,
                               quant=self.quant, dtype=dtype)
        return plan, plan_jobs(plan, self.chunk_bytes, self.job_bytes)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("src_path")  # where the folder is does not change what is written
        d["quant"] = self.quant.to_json() if self.quant is not None else None
        return d


@dataclass(frozen=True)
class Job:
    index: int
    kind: str  # "layer" | "copy" | "digest"
    what: str  # for people: the layer prefix, the first tensor of a copy run, the source file
    read_bytes: int  # from the source
    write_bytes: int  # into the output
    layer: int | None = None  # layer jobs: index into plan.layers
    tensors: tuple[int, ...] = ()  # copy jobs: indices into plan.tensors
    file: int | None = None  # digest jobs: index into plan.source.files
    peak_bytes: int = 0  # working memory it holds at most (estimate)

    @property
    def work_bytes(self) -> int:
        """What the progress bar counts for it."""
        return self.write_bytes if self.kind != "digest" else self.read_bytes

    def to_json(self) -> dict:
        return {"job": self.index, "kind": self.kind, "what": self.what, "read_bytes": self.read_bytes,
                "write_bytes": self.write_bytes, "peak_bytes": self.peak_bytes}


def experts_per_chunk(lp, chunk_bytes: int) -> int:
    per_expert = sum(s.nbytes for s in lp.specs) // max(lp.shape.num_experts, 1)
    # decoding holds unpacked codes and the source words beside the encoded chunk: about 4x the output;
    # quantizing holds the float chunk and temporaries of ~6x it (mxfp4.py; the error report's fp64)
    return max(1, min(lp.shape.num_experts, chunk_bytes // max(chunk_factor(lp) * per_expert, 1)))


def chunk_factor(lp) -> int:
    return 6 * 4 if lp.quantized else 4


def plan_jobs(plan, chunk_bytes: int = DEFAULT_CHUNK_BYTES, job_bytes: int = DEFAULT_JOB_BYTES) -> list[Job]:
    """The plan's jobs, in a fixed order: every MoE layer, the pass-through tensors in runs of about
    ``job_bytes`` (a larger tensor is a run of its own), then one digest per source file."""
    source = plan.source
    jobs: list[Job] = []
    for i, lp in enumerate(plan.layers):
        write = sum(t.nbytes for t in lp.tensors.values())
        read = sum(source.info(n).nbytes for n in lp.map.source_tensors())
        per_expert = write // max(lp.shape.num_experts, 1)
        peak = experts_per_chunk(lp, chunk_bytes) * per_expert * chunk_factor(lp)
        jobs.append(Job(len(jobs), "layer", lp.map.prefix, read, write, layer=i, peak_bytes=peak))
    run: list[int] = []
    size = 0
    copied = [i for i, t in enumerate(plan.tensors) if t.source is not None]

    def close():
        nonlocal run, size
        if run:
            first = plan.tensors[run[0]].name
            what = first if len(run) == 1 else f"{len(run)} tensors from {first}"
            jobs.append(Job(len(jobs), "copy", what, size, size, tensors=tuple(run), peak_bytes=16 << 20))
        run, size = [], 0

    for i in copied:
        if run and size + plan.tensors[i].nbytes > job_bytes:
            close()
        run.append(i)
        size += plan.tensors[i].nbytes
    close()
    for k, f in enumerate(source.files):
        n = f.stat().st_size
        jobs.append(Job(len(jobs), "digest", f.name, n, 0, file=k, peak_bytes=8 << 20))
    return jobs


def plan_key(plan, jobs: list[Job], request: Request) -> str:
    """A fingerprint of everything that decides the output's bytes: a worker that plans differently
    (another source at the same path, another version) is refused, and so is a ``--resume`` of a
    different command."""
    src = plan.source
    body = {
        "tool_version": __version__,
        "request": request.to_json(),
        "source_files": [[f.name, f.stat().st_size] for f in src.files],
        "source_headers": hashlib.sha256(b"".join(
            f"{n}:{i.dtype}:{list(i.shape)}:{i.file.name}:{i.start}".encode() for n, i in src.tensors.items()
        )).hexdigest(),
        "shards": [[s.filename, hashlib.sha256(s.header).hexdigest()] for s in plan.shards],
        "jobs": [[j.kind, j.what, j.layer, list(j.tensors), j.file] for j in jobs],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def source_stat(plan) -> dict:
    """Size and modification time of each source file: what ``--resume`` compares to spot a source
    changed in place since the interrupted run."""
    out = {}
    for f in plan.source.files:
        st = f.stat()
        out[f.name] = [st.st_size, st.st_mtime_ns]
    return out


# --------------------------------------------------------------------------------------------------
# Running one job


class TensorWriter:
    """A job's writes into the preallocated shard files: ``pwrite`` at the planned offsets, each
    tensor hashed as its pieces arrive (in order)."""

    def __init__(self, staging: Path, shards):
        self.staging = staging
        self.shards = shards
        self._fds: dict[int, int] = {}
        self._hash: dict[str, tuple[object, int]] = {}

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            path = self.staging / self.shards[shard].filename
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise MoeConvertError(f"cannot open the staging shard: {e.strerror}", file=str(path)) from e
            self._fds[shard] = fd
        return fd

    def write(self, t, at: int, data) -> None:
        """Write ``data`` at byte ``at`` of planned tensor ``t``. Pieces of one tensor must come in order."""
        h, done = self._hash.get(t.name) or (hashlib.sha256(), 0)
        if at != done or at + len(data) > t.nbytes:
            raise InternalError(f"{t.name}: piece at {at}+{len(data)} after {done} of {t.nbytes} bytes")
        view = memoryview(data).cast("B")
        h.update(view)
        self._hash[t.name] = (h, at + len(view))
        fd, pos = self._fd(t.shard), t.offset + at
        try:
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        except OSError as e:
            raise MoeConvertError(f"writing failed: {e.strerror}", file=self.shards[t.shard].filename,
                                  tensor=t.name) from e

    def digest(self, t) -> str:
        h, done = self._hash.get(t.name) or (hashlib.sha256(), 0)
        if done != t.nbytes:
            raise InternalError(f"{t.name}: {done} of {t.nbytes} bytes written")
        return h.hexdigest()

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}


def record_path(staging: Path, index: int) -> Path:
    return staging / JOBS_DIR / f"{index:05d}.json"


def run_job(plan, job: Job, staging: Path, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            progress: Callable[[int], None] | None = None) -> dict:
    """Do ``job`` into ``staging``; write and return its record. ``progress(n)``: n more bytes done."""
    from moeconvert.writer import tensor_bytes

    progress = progress or (lambda n: None)
    t0 = time.perf_counter()
    jobs_dir = staging / JOBS_DIR
    # one empty marker per attempt: how many times a job started is visible after the fact
    (jobs_dir / f"{job.index:05d}.run-{socket.gethostname()}-{os.getpid()}").touch()
    record: dict = {"key": key, "job": job.index, "kind": job.kind}
    writer = TensorWriter(staging, plan.shards)
    try:
        if job.kind == "layer":
            lp = plan.layers[job.layer]
            quality = _fresh_quality(lp)
            step = experts_per_chunk(lp, chunk_bytes)
            n = lp.shape.num_experts
            for a in range(0, n, step):
                b = min(n, a + step)
                block = layer_output_block(plan, lp, a, b, quality)
                encoded = plan.layout.encode(block, lp.shape)
                del block
                _check_encoded(lp, encoded, a, b)
                for spec in lp.specs:
                    t = lp.tensors[spec.suffix]
                    writer.write(t, a * (t.nbytes // n), tensor_bytes(encoded[spec.suffix]))
                del encoded
                progress(sum(t.nbytes * (b - a) // n for t in lp.tensors.values()))
            record["tensors"] = {t.name: writer.digest(t) for t in lp.tensors.values()}
            if quality is not None:
                record["quality"] = quality.to_json()
        elif job.kind == "copy":
            for i in job.tensors:
                t = plan.tensors[i]
                at = 0
                for buf in plan.source.read_raw(t.source):
                    writer.write(t, at, buf)
                    at += len(buf)
                    progress(len(buf))
            record["tensors"] = {plan.tensors[i].name: writer.digest(plan.tensors[i]) for i in job.tensors}
        elif job.kind == "digest":
            f = plan.source.files[job.file]
            record["file"] = f.name
            record["digest"] = plan.source.file_digest(f, progress)
        else:
            raise InternalError(f"unknown job kind {job.kind!r}")
    finally:
        writer.close()
    record["seconds"] = round(time.perf_counter() - t0, 3)
    record["worker"] = f"{socket.gethostname()}:{os.getpid()}"
    write_record(staging, job.index, record)
    return record


def layer_output_block(plan, lp, a: int, b: int, quality):
    """Local experts [a, b) of a layer as the canonical block its layout encodes."""
    from moeconvert.decode import decode_chunk
    from moeconvert.quantize import output_block
    from moeconvert.schemes import MXFP4Scheme

    block = decode_chunk(plan.source, lp.map, plan.partition, lp.expert_start + a, lp.expert_start + b)
    if isinstance(lp.scheme, MXFP4Scheme):
        block = output_block(block, lp.shape, lp.unpadded, plan.quant, prefix=lp.map.prefix,
                             expert_offset=lp.expert_start + a, quality=quality)
    return block


def _fresh_quality(lp):
    if not lp.quantized:
        return None
    from moeconvert.quantize import Quality

    return Quality()


def _check_encoded(lp, encoded: dict, a: int, b: int) -> None:
    if set(encoded) != {s.suffix for s in lp.specs}:
        raise InternalError(f"{lp.map.prefix}: layout wrote {sorted(encoded)}, planned {[s.suffix for s in lp.specs]}")
    for spec in lp.specs:
        t = encoded[spec.suffix]
        want = (b - a, *spec.shape[1:])
        if tuple(t.shape) != want or t.dtype != spec.dtype:
            raise InternalError(f"{lp.map.prefix}.{spec.suffix}: encoded {tuple(t.shape)} {t.dtype}, "
                                f"planned {want} {spec.dtype}")


def write_record(staging: Path, index: int, record: dict) -> None:
    path = record_path(staging, index)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record, sort_keys=True, allow_nan=False))
        os.replace(tmp, path)
    except OSError as e:
        raise MoeConvertError(f"cannot write the job record: {e.strerror}", file=str(path)) from e


def read_records(staging: Path, key: str, jobs: list[Job]) -> dict[int, dict]:
    """The finished jobs' records in ``staging`` that belong to this plan (others are ignored)."""
    out = {}
    for job in jobs:
        path = record_path(staging, job.index)
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("key") == key and rec.get("job") == job.index and rec.get("kind") == job.kind:
            out[job.index] = rec
    return out


def attempts(staging: Path) -> dict[int, int]:
    """How many times each job was started in this staging folder (its ``.run-HOST-PID`` markers)."""
    counts: dict[int, int] = {}
    try:
        names = os.listdir(staging / JOBS_DIR)
    except OSError:
        return counts
    for name in names:
        head, sep, _ = name.partition(".run-")
        if sep and head.isdigit():
            counts[int(head)] = counts.get(int(head), 0) + 1
    return counts


def still_good(plan, job: Job, record: dict, staging: Path) -> bool:
    """A finished job's bytes in ``staging`` still hash to its record (``--resume`` keeps only those)."""
    if job.kind == "digest":
        return isinstance(record.get("digest"), dict)
    want = record.get("tensors")
    if not isinstance(want, dict):
        return False
    by_name = {t.name: t for t in plan.tensors}
    buf = bytearray(8 << 20)
    for name, digest in want.items():
        t = by_name.get(name)
        if t is None:
            return False
        h = hashlib.sha256()
        try:
            with open(staging / plan.shards[t.shard].filename, "rb", buffering=0) as f:
                f.seek(t.offset)
                left = t.nbytes
                while left:
                    n = f.readinto(memoryview(buf)[:min(left, len(buf))])
                    if not n:
                        return False
                    h.update(memoryview(buf)[:n])
                    left -= n
        except OSError:
            return False
        if h.hexdigest() != digest:
            return False
    return True
