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
manifest): ``--resume`` keeps a job only if its record is there, well formed, *and* its bytes still
hash to it, so a record that outlived its data in a power cut costs a rerun of that job, never a wrong
byte. A kept job is also tied to the source bytes it read: ``--resume`` hashes every source file again
and keeps a layer or copy job only when each file it read has the sha256 the interrupted run recorded
(:func:`resume_records`); a file with other bytes refuses the resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import socket
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from moeconvert import __version__
from moeconvert.canonical import Partition
from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.layouts.base import CHOICES

from moeconvert.plan import DEFAULT_CHUNK_BYTES, DEFAULT_JOB_BYTES, JOBS_DIR, PLAN_FILE, read_small_file  # noqa: F401


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
    tp_sizes: tuple[int, ...] = ()  # --tp-sizes, those above 1

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
                               quant=self.quant, dtype=dtype, tp_sizes=self.tp_sizes)
        return plan, plan_jobs(plan, self.chunk_bytes, self.job_bytes)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("src_path")  # where the folder is does not change what is written
        d["quant"] = self.quant.to_json() if self.quant is not None else None
        if not self.tp_sizes:
            d.pop("tp_sizes")  # a folder without --tp-sizes keeps the fingerprint it always had
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
        """What the progress bar counts for it: the source bytes it reads (a layer's and a copy's
        tensors, a digest's whole file), so that the bar's total is one quantity, reported per piece."""
        return self.read_bytes

    def to_json(self) -> dict:
        return {"job": self.index, "kind": self.kind, "what": self.what, "read_bytes": self.read_bytes,
                "write_bytes": self.write_bytes, "peak_bytes": self.peak_bytes}


def layer_passes(lp) -> int:
    """How many times a layer job reads its experts: the full tensors, then one pass per stored TP size."""
    return 1 + sum(1 for st in lp.tp_sizes.values() if st)


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
        write = sum(t.nbytes for t in lp.all_tensors())
        # the source experts are read once for the full tensors and once more for each stored TP size
        read = sum(source.info(n).nbytes for n in lp.map.source_tensors()) * layer_passes(lp)
        per_expert = sum(t.nbytes for t in lp.tensors.values()) // max(lp.shape.num_experts, 1)
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
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # never write through a link out of OUT
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
    marker = jobs_dir / f"{job.index:05d}.run-{socket.gethostname()}-{os.getpid()}"
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    except OSError as e:
        raise MoeConvertError(f"cannot write in the staging folder: {e.strerror}", file=str(marker)) from e
    record: dict = {"key": key, "job": job.index, "kind": job.kind}
    writer = TensorWriter(staging, plan.shards)
    try:
        if job.kind == "layer":
            lp = plan.layers[job.layer]
            quality = _fresh_quality(lp)
            step = experts_per_chunk(lp, chunk_bytes)
            n = lp.shape.num_experts
            # the full tensors, then rank by rank each stored TP size: (partition, shape, unpadded, specs,
            # tensors, ranks stacked in front of each tensor (1: none), this rank's place there, quality)
            passes = layer_pass_list(plan, lp, quality)
            done, total = 0, n * len(passes)
            facts = []
            for part, shape, unpadded, specs, tensors, ranks, r, q in passes:
                # a layout whose bytes depend on a fact of the whole layer scans it first, a chunk at a
                # time until its choices are settled (layouts/base.py LayerScan); the chunks it did not
                # reach are scanned below as they are encoded, so each expert is scanned once
                scan = plan.layout.layer_scan(shape, lp.scheme, lp.expert_start)
                scanned = 0
                while scan is not None and not scan.settled():
                    b = min(n, scanned + step)
                    scan.add(layer_output_block(plan, lp, scanned, b, None, part=part, shape=shape,
                                                unpadded=unpadded), lp.expert_start + scanned)
                    scanned = b
                if scan is not None:
                    chosen = scan.choices()
                    shape = dataclasses.replace(shape, extra={**shape.extra, CHOICES: chosen})
                for a in range(0, n, step):
                    b = min(n, a + step)
                    block = layer_output_block(plan, lp, a, b, q, part=part, shape=shape, unpadded=unpadded)
                    if scan is not None and a >= scanned:
                        scan.add(block, lp.expert_start + a)
                    encoded = plan.layout.encode(block, shape)
                    del block
                    _check_encoded(lp, encoded, a, b, specs)
                    for spec in specs:
                        t = tensors[spec.suffix]
                        per_rank = t.nbytes // ranks
                        writer.write(t, r * per_rank + a * (per_rank // n), tensor_bytes(encoded[spec.suffix]))
                    del encoded
                    # the source bytes of these experts, once per pass: sums to read_bytes exactly
                    progress(job.read_bytes * (done + b - a) // total - job.read_bytes * done // total)
                    done += b - a
                if scan is not None:
                    facts.append(scan.facts())
                    if plan.layout.choices(facts[-1], shape, lp.scheme) != chosen:
                        raise InternalError(f"{lp.map.prefix}: the scan chose {chosen}, its facts say otherwise")
            record["tensors"] = {t.name: writer.digest(t) for t in lp.all_tensors()}
            if facts:
                # one per pass (the full tensors, then each stored TP rank): the manifest's layout_metadata
                # is made from them, and --resume keeps them with the bytes they decided (_well_formed)
                record["layout_facts"] = facts
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
            record.update(digest_fields(plan, job, progress))
        else:
            raise InternalError(f"unknown job kind {job.kind!r}")
    finally:
        writer.close()
    record["seconds"] = round(time.perf_counter() - t0, 3)
    record["worker"] = f"{socket.gethostname()}:{os.getpid()}"
    write_record(staging, job.index, record)
    return record


def layer_output_block(plan, lp, a: int, b: int, quality, part=None, shape=None, unpadded=None):
    """Local experts [a, b) of a layer as the canonical block its layout encodes: for the plan's partition,
    or (``--tp-sizes``) for another TP rank ``part`` of the rank's ``shape`` and ``unpadded`` sizes."""
    from moeconvert.decode import decode_chunk
    from moeconvert.quantize import output_block
    from moeconvert.schemes import MXFP4Scheme

    block = decode_chunk(plan.source, lp.map, part or plan.partition, lp.expert_start + a, lp.expert_start + b)
    if isinstance(lp.scheme, MXFP4Scheme):
        block = output_block(block, shape or lp.shape, unpadded or lp.unpadded, plan.quant, prefix=lp.map.prefix,
                             expert_offset=lp.expert_start + a, quality=quality)
    return block


def digest_fields(plan, job: Job, progress=None) -> dict:
    """A digest job's result: the source file's name and ``{"sha256", "size"}``."""
    f = plan.source.files[job.file]
    return {"file": f.name, "digest": plan.source.file_digest(f, progress)}


def _fresh_quality(lp):
    if not lp.quantized:
        return None
    from moeconvert.quantize import Quality

    return Quality()


def _check_encoded(lp, encoded: dict, a: int, b: int, specs=None) -> None:
    specs = lp.specs if specs is None else specs
    if set(encoded) != {s.suffix for s in specs}:
        raise InternalError(f"{lp.map.prefix}: layout wrote {sorted(encoded)}, planned {[s.suffix for s in specs]}")
    for spec in specs:
        t = encoded[spec.suffix]
        want = (b - a, *spec.shape[1:])
        if tuple(t.shape) != want or t.dtype != spec.dtype:
            raise InternalError(f"{lp.map.prefix}.{spec.suffix}: encoded {tuple(t.shape)} {t.dtype}, "
                                f"planned {want} {spec.dtype}")


def write_record(staging: Path, index: int, record: dict) -> None:
    path = record_path(staging, index)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        # O_EXCL|O_NOFOLLOW: a name planted in the staging folder is never written through
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "w") as f:
            f.write(json.dumps(record, sort_keys=True, allow_nan=False))
        os.replace(tmp, path)
    except OSError as e:
        raise MoeConvertError(f"cannot write the job record: {e.strerror}", file=str(path)) from e


RECORD_MAX_BYTES = 64 << 20  # a copy job of a million small tensors stays far below
_SHA256 = re.compile(r"[0-9a-f]{64}")


def job_tensors(plan, job: Job) -> list:
    """The planned tensors a layer or copy job writes."""
    if job.kind == "layer":
        return plan.layers[job.layer].all_tensors()
    return [plan.tensors[i] for i in job.tensors]


def job_source_files(plan, job: Job) -> set[str]:
    """The names of the source files a job reads."""
    src = plan.source
    if job.kind == "digest":
        return {src.files[job.file].name}
    if job.kind == "layer":
        names = plan.layers[job.layer].map.source_tensors()
    else:
        names = [plan.tensors[i].source for i in job.tensors]
    return {src.info(n).file.name for n in names}


def valid_digest(plan, job: Job, record: dict) -> bool:
    """A digest record names its file and holds a sha256 of 64 lowercase hex digits and the file's size."""
    f = plan.source.files[job.file]
    d = record.get("digest")
    return (record.get("file") == f.name and isinstance(d, dict) and set(d) == {"sha256", "size"}
            and isinstance(d["sha256"], str) and _SHA256.fullmatch(d["sha256"]) is not None
            and type(d["size"]) is int and d["size"] == f.stat().st_size)


def _well_formed(plan, job: Job, rec) -> bool:
    if job.kind == "digest":
        return valid_digest(plan, job, rec)
    want = rec.get("tensors")
    if not isinstance(want, dict) or set(want) != {t.name for t in job_tensors(plan, job)}:
        return False  # every tensor the job writes, and only those
    if not all(isinstance(d, str) and _SHA256.fullmatch(d) for d in want.values()):
        return False
    if job.kind == "layer" and not _valid_facts(plan, plan.layers[job.layer], rec):
        return False
    if job.kind == "layer" and plan.layers[job.layer].quantized:
        return _valid_quality(rec.get("quality"))
    return "quality" not in rec


def layer_pass_list(plan, lp, quality=None) -> list[tuple]:
    """A layer job's passes: the full tensors, then rank by rank each stored TP size, each as (partition,
    shape, unpadded, specs, tensors, ranks stacked in front of each tensor (1: none), this rank's place
    there, quality report or None)."""
    passes = [(plan.partition, lp.shape, lp.unpadded, lp.specs, lp.tensors, 1, 0, quality)]
    for T, st in lp.tp_sizes.items():
        if st:
            passes += [(Partition(T, r), st.shape, st.unpadded, st.specs, st.tensors, T, r, None) for r in range(T)]
    return passes


def scanned_facts(plan, lp, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list | None:
    """The facts the layer's layout scans (one per pass, as a layer job records them in ``layout_facts``),
    found again from the source; None for a layout that scans nothing. ``--resume`` keeps a record only
    if its facts are these: the bytes it wrote were encoded with the choices they make."""
    facts = []
    step = experts_per_chunk(lp, chunk_bytes)
    n = lp.shape.num_experts
    for part, shape, unpadded, *_ in layer_pass_list(plan, lp):
        scan = plan.layout.layer_scan(shape, lp.scheme, lp.expert_start)
        if scan is None:
            continue
        for a in range(0, n, step):
            b = min(n, a + step)
            scan.add(layer_output_block(plan, lp, a, b, None, part=part, shape=shape, unpadded=unpadded),
                     lp.expert_start + a)
        facts.append(scan.facts())
    return json.loads(json.dumps(facts)) if facts else None


def layer_pass_shapes(lp) -> list:
    """The LayerShape of each pass of a layer job, in order: the full tensors, then each stored TP rank."""
    return [lp.shape] + [st.shape for st in lp.tp_sizes.values() if st for _ in range(st.tp_size)]


def _valid_facts(plan, lp, rec: dict) -> bool:
    """A layer whose layout scans it records one set of facts per pass, each what such a scan can find for
    the layer (``Layout.facts_problem``); a layer of any other layout records none."""
    shapes = layer_pass_shapes(lp)
    scans = [plan.layout.layer_scan(shape, lp.scheme, lp.expert_start) is not None for shape in shapes]
    if not any(scans):
        return "layout_facts" not in rec
    facts = rec.get("layout_facts")
    return (isinstance(facts, list) and len(facts) == len(shapes)
            and all(plan.layout.facts_problem(f, shape, lp.scheme, lp.expert_start) is None
                    for f, shape in zip(facts, shapes)))


_QUALITY_KEYS = {"rel_fro_error", "max_abs_error", "saturated_block_fraction"}  # Quality.to_json's


def _valid_quality(q) -> bool:
    """A quantized layer's report as :meth:`moeconvert.quantize.Quality.to_json` writes it: finite numbers."""
    return (isinstance(q, dict) and set(q) == {"w13", "w2"}
            and all(isinstance(v, dict) and set(v) == _QUALITY_KEYS
                    and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in v.values())
                    for v in q.values()))


def read_records(staging: Path, key: str, jobs: list[Job], plan=None) -> dict[int, dict]:
    """The finished jobs' records in ``staging`` that belong to this plan and are well formed (with
    ``plan``: every tensor the job writes with a sha256, a digest's file, size and sha256). Anything
    else under a record's name (not a regular file, too large, not JSON, wrong types) counts as absent:
    its job runs again."""
    out = {}
    for job in jobs:
        data = read_small_file(record_path(staging, job.index), RECORD_MAX_BYTES)
        if data is None:
            continue
        try:
            rec = json.loads(data)
        except (ValueError, RecursionError):
            continue
        if not (isinstance(rec, dict) and rec.get("key") == key and rec.get("job") == job.index
                and rec.get("kind") == job.kind):
            continue
        if plan is not None and not _well_formed(plan, job, rec):
            continue
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
    """A finished job's bytes in ``staging`` still hash to its record (``--resume`` keeps only those).

    Every tensor the job writes is read back whole, from the shard's regular file (never through a
    link), and compared with its record's sha256: damage anywhere in any of them reruns the job."""
    if job.kind == "digest":
        return valid_digest(plan, job, record)
    want = record.get("tensors")
    if not isinstance(want, dict):
        return False
    if job.kind == "layer" and "layout_facts" in record:
        # the facts decided how the bytes were encoded, and the manifest records them: a record that
        # is well formed but says other facts than the (re-hashed, unchanged) source gives is redone
        if record["layout_facts"] != scanned_facts(plan, plan.layers[job.layer]):
            return False
    buf = bytearray(8 << 20)
    for t in job_tensors(plan, job):
        digest = want.get(t.name)
        if not isinstance(digest, str):
            return False
        h = hashlib.sha256()
        try:
            fd = os.open(staging / plan.shards[t.shard].filename, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            pos, left = t.offset, t.nbytes
            while left:
                n = os.preadv(fd, [memoryview(buf)[:min(left, len(buf))]], pos)
                if not n:
                    return False  # the shard is shorter than planned
                h.update(memoryview(buf)[:n])
                pos, left = pos + n, left - n
        except OSError:
            return False
        finally:
            os.close(fd)
        if h.hexdigest() != digest:
            return False
    return True


def rehash_sources(plan, jobs: list[Job], key: str, earlier: dict[int, dict], progress=None,
                   threads: int = 1) -> tuple[dict[int, dict], set[str]]:
    """``--resume``'s check that the source is the one the interrupted run read, before any of its jobs
    is kept: every source file is hashed again (the digest jobs, which the manifest needs anyway, run
    here) and compared with the sha256 the interrupted run recorded for it (``earlier``: its
    well-formed records). Size and modification time alone do not tell: ``cp -p``, ``rsync -a`` and
    ``touch -r`` keep both.

    Returns the fresh digest records (not yet written) and the names of the files whose bytes the
    interrupted run recorded, unchanged: only jobs that read nothing else may be kept. A file whose
    bytes differ is refused (one line naming it), since kept jobs would mix the two sources."""
    from concurrent.futures import ThreadPoolExecutor

    digests = [j for j in jobs if j.kind == "digest"]

    def one(job: Job) -> dict:
        t0 = time.perf_counter()
        rec = {"key": key, "job": job.index, "kind": "digest", **digest_fields(plan, job, progress)}
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        rec["worker"] = f"{socket.gethostname()}:{os.getpid()}"
        return rec

    with ThreadPoolExecutor(max(1, threads)) as pool:  # hashlib and file reads release the GIL
        fresh = dict(zip((j.index for j in digests), pool.map(one, digests)))
    unchanged = set()
    for job in digests:
        before = earlier.get(job.index)
        if before is None:
            continue  # the interrupted run had not hashed it: jobs that read it are redone
        name = plan.source.files[job.file].name
        if before["digest"]["sha256"] != fresh[job.index]["digest"]["sha256"]:
            raise MoeConvertError("cannot resume: this source file has other bytes than when the interrupted run "
                                  "read it (same size and modification time); run without --resume to start over",
                                  file=name, expected=f"sha256 {before['digest']['sha256'][:16]}…",
                                  found=f"sha256 {fresh[job.index]['digest']['sha256'][:16]}…")
        unchanged.add(name)
    return fresh, unchanged
