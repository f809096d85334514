"""The ``threaded`` reader: shard bytes to device tensors with several reader threads and pinned buffers.

Why not the mapped reads of loader.py: a ``copy_`` from mapped pages is one thread faulting pages in
(4.7-6.4 GB/s from page cache, 1.3-1.7 GB/s cold on an H200 host, for links of 55 GB/s). Here:

1. a **plan**: every tensor asked for is a segment ``(file, offset, nbytes, destination)`` taken from
   the safetensors headers the manifest check already read (:class:`TensorInfo`). Segments of one file
   are sorted by offset and joined into **runs** where they are adjacent (a shard's tensors are
   contiguous) or separated by less than ``_GAP`` bytes of tensors not asked for, so a shard loaded
   whole is read as a few long sequential runs spanning many tensors;
2. each run is cut into **chunks** of at most ``buffer_mb``, 4 KiB-aligned in the file;
3. ``threads`` workers take chunks in file order and read each with plain ``os.preadv`` (not mmap:
   cold reads then stream at the disk's sequential speed with the kernel's readahead, and no mapped
   copy of the file stays in the process) into one of their two host buffers, pinned on CUDA; short
   reads are continued, an end of file before the chunk's end is an error naming file and tensor;
4. the chunk's pieces are copied into their final device tensors on the worker's own CUDA stream
   (``non_blocking``), an event recorded after them; the worker reads its next chunk into its other
   buffer meanwhile, and waits for a buffer's event before refilling it. On CPU the "device copy" is a
   memcpy into the final tensor.

With ``expect`` (verifying), the chunks are dealt out in **jobs** instead of one by one: a job is a
run of chunks no tensor crosses the end of, so every tensor is read by one worker, in order, and that
worker hashes each piece in its host buffer right after issuing its copy (sha256 is sequential within
a tensor; tensors are hashed in parallel). The bytes hashed are the bytes copied.

Host memory is bounded by the ring (``2 * threads`` buffers of ``buffer_mb``, fewer and smaller for
small loads), never the model. File reads and ``copy_`` release the GIL, so the threads overlap.
The result is the bytes of the file, as the ``direct`` reader gives (tests/test_fastload.py).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.runtime.loader import Reader, check_digest
from moeconvert.format import TensorInfo

_ALIGN = 4096
#: tensors not asked for, up to this many bytes between two that are, are read rather than skipped
_GAP = 1 << 20
#: loads above this many bytes show a progress bar (on a terminal, unless progress=False)
PROGRESS_MIN_BYTES = 1 << 30


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise MoeConvertError("bad environment variable", tensor=name, expected="a positive integer", found=text)
    return value


def default_threads() -> int:
    return _env_int("MOECONVERT_LOAD_THREADS", min(8, os.cpu_count() or 1))


def default_buffer_mb() -> int:
    return _env_int("MOECONVERT_LOAD_BUFFER_MB", 64)


def _pread(fd: int, view: memoryview, offset: int) -> int:
    """One read into ``view`` at ``offset``; may return fewer bytes (tests replace this to throttle)."""
    return os.preadv(fd, [view], offset)


@dataclass
class _Segment:
    info: TensorInfo
    dst: torch.Tensor  # uint8, info.nbytes, on the device
    sha256: str | None = None  # what its bytes must hash to (verifying)
    hasher: object = None


@dataclass
class _Chunk:
    file: Path
    start: int  # file offset of the chunk's first byte
    nbytes: int
    #: (segment, offset in the tensor, offset in the chunk, bytes)
    pieces: list[tuple[_Segment, int, int, int]] = field(default_factory=list)

    def tensor_at(self, offset: int) -> str:
        """The tensor whose bytes are at file ``offset`` (or the chunk's first one)."""
        for seg, a, c, n in self.pieces:
            if self.start + c <= offset < self.start + c + n:
                return seg.info.name
        return self.pieces[0][0].info.name


def plan_chunks(segments: list[_Segment], chunk_bytes: int, exact: bool = False) -> list[_Chunk]:
    """Runs of nearby segments per file, cut into chunks of at most ``chunk_bytes`` (aligned in the file).
    ``exact``: read only the segments' bytes (no alignment, runs only of adjacent segments)."""
    gap = 0 if exact else _GAP
    if chunk_bytes < _ALIGN or exact:
        # tiny buffers (tests), or exact reads: no alignment, still every byte exactly once
        align = 1
    else:
        align = _ALIGN
        chunk_bytes -= chunk_bytes % align
    by_file: dict[Path, list[_Segment]] = {}
    for s in segments:
        if s.info.nbytes:
            by_file.setdefault(s.info.file, []).append(s)
    chunks: list[_Chunk] = []
    for path, segs in sorted(by_file.items()):
        segs.sort(key=lambda s: s.info.start)
        runs: list[list[_Segment]] = []
        for s in segs:
            if runs and s.info.start - runs[-1][-1].info.end <= gap:
                runs[-1].append(s)
            else:
                runs.append([s])
        for run in runs:
            lo = run[0].info.start - run[0].info.start % align
            hi = run[-1].info.end
            i = 0  # first segment that may overlap the next chunk
            a = lo
            while a < hi:
                b = min(hi, a - a % align + chunk_bytes) if align > 1 else min(hi, a + chunk_bytes)
                ch = _Chunk(path, a, b - a)
                while i < len(run) and run[i].info.end <= a:
                    i += 1
                j = i
                while j < len(run) and run[j].info.start < b:
                    s = run[j]
                    x, y = max(a, s.info.start), min(b, s.info.end)
                    if y > x:
                        ch.pieces.append((s, x - s.info.start, x - a, y - x))
                    j += 1
                if ch.pieces:
                    # trim to the bytes some tensor needs (a gap at either end is not read)
                    first = min(c for _, _, c, _ in ch.pieces)
                    last = max(c + n for _, _, c, n in ch.pieces)
                    if align > 1:
                        first -= first % align
                    ch.pieces = [(s, t, c - first, n) for s, t, c, n in ch.pieces]
                    ch.start, ch.nbytes = a + first, last - first
                    chunks.append(ch)
                a = b
    return chunks


def plan_jobs(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """The chunks cut where no tensor continues from one chunk into the next: each job then holds
    whole tensors, which one worker reads (and hashes) in order."""
    jobs: list[list[_Chunk]] = []
    for ch in chunks:
        continues = ch.pieces[0][1] > 0  # the chunk starts inside a tensor the previous one began
        if jobs and continues:
            jobs[-1].append(ch)
        else:
            jobs.append([ch])
    return jobs


class _Progress:
    """A rich bar with bytes and GB/s on stderr, or nothing."""

    def __init__(self, total: int, enabled: bool | None, what: str):
        self._bar = None
        if enabled is None:
            enabled = total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
        if enabled and total:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=Console(file=sys.stderr), transient=True)
            self._task = self._bar.add_task(what, total=total)
            self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class ThreadedReader(Reader):
    """Reads with ``threads`` workers into a ring of ``2 * threads`` host buffers of ``buffer_mb``."""

    name = "threaded"

    def __init__(self, device: torch.device, threads: int | None = None, buffer_mb: int | float | None = None,
                 progress: bool | None = None, exact: bool = False):
        super().__init__(device)
        #: read only the bytes asked for: no gap between two tensors read through, no aligned chunk starts
        #: (a rank reading its experts' byte ranges of tensors it shares with other ranks)
        self.exact = exact
        self.threads = default_threads() if threads is None else int(threads)
        mb = default_buffer_mb() if buffer_mb is None else buffer_mb
        if self.threads < 1:
            raise MoeConvertError("threads must be at least 1", tensor="threads", expected=">= 1", found=threads)
        if not mb > 0:
            raise MoeConvertError("buffer_mb must be positive", tensor="buffer_mb", expected="> 0", found=buffer_mb)
        self.buffer_bytes = max(1, int(mb * (1 << 20)))
        self.progress = progress
        self._fds: dict[tuple[int, Path], int] = {}  # (worker, file): each worker its own readahead state
        self._fd_lock = threading.Lock()

    # -- files ---------------------------------------------------------------------------------------
    def _fd(self, worker: int, path: Path, tensor: str) -> int:
        with self._fd_lock:
            fd = self._fds.get((worker, path))
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise MoeConvertError(f"cannot open the shard during the load ({e.strerror}; deleted or "
                                          "moved since it was checked?)", file=str(path), tensor=tensor) from e
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead window
                self._fds[(worker, path)] = fd
            return fd

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        super().close()

    def _fill(self, worker: int, chunk: _Chunk, view: memoryview) -> None:
        """Read the chunk's bytes into ``view``; continue short reads, refuse an early end of file."""
        fd = self._fd(worker, chunk.file, chunk.pieces[0][0].info.name)
        got = 0
        while got < chunk.nbytes:
            at = chunk.start + got
            try:
                n = _pread(fd, view[got:chunk.nbytes], at)
            except OSError as e:
                raise MoeConvertError(f"cannot read the shard at byte {at}: {e.strerror}", file=str(chunk.file),
                                      tensor=chunk.tensor_at(at)) from e
            if n <= 0:
                size = os.fstat(fd).st_size
                raise MoeConvertError("shard ended before the tensor's data (truncated during the load?)",
                                      file=str(chunk.file), tensor=chunk.tensor_at(at),
                                      expected=f"{chunk.start + chunk.nbytes} bytes", found=f"{size} bytes")
            got += n

    # -- the pipeline --------------------------------------------------------------------------------
    def read_many(self, infos: list[TensorInfo], expect: dict[str, str] | None = None) -> list[torch.Tensor]:
        dsts = [torch.empty(i.nbytes, dtype=torch.uint8, device=self.device) for i in infos]
        self._run([_Segment(i, d, None if expect is None else expect[i.name]) for i, d in zip(infos, dsts)])
        return [d.view(i.torch_dtype).reshape(i.shape) if i.nbytes else
                torch.empty(i.shape, dtype=i.torch_dtype, device=self.device) for i, d in zip(infos, dsts)]

    def read(self, info: TensorInfo, sha256: str | None = None) -> torch.Tensor:
        return self.read_many([info], None if sha256 is None else {info.name: sha256})[0]

    def read_into(self, info: TensorInfo, dst: torch.Tensor, sha256: str | None = None) -> None:
        self._run([_Segment(info, dst, sha256)])

    def read_into_pieces(self, pieces: list[tuple[TensorInfo, torch.Tensor]]) -> None:
        """Each ``(info, dst)``: the file bytes ``[info.start, info.end)`` of ``info.file`` into ``dst``, a
        contiguous uint8 tensor of ``info.nbytes`` on the reader's device (a byte range of a parameter,
        say). All pieces go through one pipeline, so pieces of one file close together are read as runs."""
        for info, dst in pieces:
            if dst.dtype != torch.uint8 or dst.numel() != info.nbytes or not dst.is_contiguous():
                raise ValueError(f"{info.name}: the destination must be {info.nbytes} contiguous bytes, "
                                 f"found {dst.numel()} {dst.dtype}")
        self._run([_Segment(info, dst) for info, dst in pieces])

    def _run(self, segments: list[_Segment]) -> None:
        verifying = any(seg.sha256 is not None for seg in segments)
        for seg in segments:
            if seg.sha256 is not None:
                seg.hasher = hashlib.sha256()
        chunks = plan_chunks(segments, self.buffer_bytes, self.exact)
        if chunks:
            self._pipeline(chunks, plan_jobs(chunks) if verifying else [[c] for c in chunks])
        for seg in segments:  # every copy has completed (or _pipeline raised)
            if seg.hasher is not None:
                check_digest(seg.info, seg.hasher.hexdigest(), seg.sha256)

    def _pipeline(self, chunks: list[_Chunk], jobs: list[list[_Chunk]]) -> None:
        size = max(c.nbytes for c in chunks)
        workers = min(self.threads, len(jobs))
        cuda = self.device.type == "cuda"
        # one allocation for the ring; the caching host allocator keeps it for the next load
        ring = torch.empty(2 * workers * size, dtype=torch.uint8, pin_memory=cuda)
        ring_view = memoryview(ring.numpy()).cast("B")
        bar = _Progress(sum(c.nbytes for c in chunks), self.progress, f"load → {self.device}")
        state = {"next": 0, "error": None}
        lock = threading.Lock()
        streams = [torch.cuda.Stream(self.device) for _ in range(workers)] if cuda else [None] * workers

        def work(w: int) -> None:
            bufs = [ring[(2 * w + k) * size:(2 * w + k + 1) * size] for k in (0, 1)]
            views = [ring_view[(2 * w + k) * size:(2 * w + k + 1) * size] for k in (0, 1)]
            events: list = [None, None]
            k = 0
            try:
                while True:
                    with lock:
                        i = state["next"]
                        if state["error"] is not None or i >= len(jobs):
                            return
                        state["next"] = i + 1
                    for chunk in jobs[i]:
                        if state["error"] is not None:
                            return
                        b = k % 2
                        k += 1
                        if events[b] is not None:
                            events[b].synchronize()  # the copies out of this buffer have finished
                        self._fill(w, chunk, views[b])
                        buf = bufs[b]
                        if cuda:
                            with torch.cuda.stream(streams[w]):
                                for seg, t, c, n in chunk.pieces:
                                    seg.dst[t:t + n].copy_(buf[c:c + n], non_blocking=True)
                                events[b] = torch.cuda.Event()
                                events[b].record(streams[w])
                        else:
                            for seg, t, c, n in chunk.pieces:
                                seg.dst[t:t + n].copy_(buf[c:c + n])
                        for seg, t, c, n in chunk.pieces:
                            if seg.hasher is not None:  # in tensor order: the job holds the whole tensor
                                seg.hasher.update(views[b][c:c + n])
                        bar.advance(chunk.nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                with lock:
                    if state["error"] is None:
                        state["error"] = e

        try:
            if workers == 1:
                work(0)
            else:
                pool = [threading.Thread(target=work, args=(w,), name=f"moeconvert-load-{w}", daemon=True)
                        for w in range(workers)]
                for t in pool:
                    t.start()
                try:
                    for t in pool:
                        t.join()
                except BaseException as e:  # Ctrl-C: stop the workers before the buffers and files go
                    with lock:
                        state["error"] = state["error"] or e
                    for t in pool:
                        t.join()
                    raise
            if cuda:
                for s in streams:
                    s.synchronize()
        finally:
            bar.close()
            del ring_view
        if state["error"] is not None:
            raise state["error"]


__all__ = ["ThreadedReader", "plan_chunks", "plan_jobs", "default_threads", "default_buffer_mb"]
