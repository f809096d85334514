"""Shard bytes to device tensors: each tensor is copied once, from the mapped file into its final tensor.

A :class:`Reader` owns the mapped shards and fills one device tensor per call. The tensor's bytes
are viewed in place in the ``mmap`` (no host copy), reinterpreted as bytes of the right length, and
copied with one ``Tensor.copy_`` into a fresh device tensor of the stored dtype. Readers:

* ``direct``: ``copy_`` straight from the mapped (pageable) pages; on CPU this is a plain memcpy.
* ``pinned``: CUDA only; the bytes go through one reused pinned staging buffer of ``chunk`` bytes
  (bounded host memory, never a second full copy), each chunk copied asynchronously while the next
  is staged into the other half of the buffer.
* ``threaded`` (fastload.py; what ``auto`` means on CUDA): several threads read the files with plain
  ``pread`` into a ring of pinned buffers, the host-to-device copies overlapped on side streams.

``load`` hands a reader every tensor it wants at once (``read_many``), so a reader can plan its reads
over whole shards; the default ``read_many`` reads them one by one with ``read_into``. Another reader
(``O_DIRECT``, GPUDirect Storage) slots in by implementing ``read_many`` or ``read_into``.

``expect`` (``load(verify=True)``, ``model.tensor`` after it): each tensor's sha256 is computed from
the bytes in the same pass that copies them, a piece at a time while the piece is in cache, and a
tensor whose digest is not the manifest's raises before anything is returned. Hashing the bytes that
are copied, rather than the file before the copy, leaves no window in which the file could change
between the check and the read. The direct reader hashes its tensors on several threads (``hashlib``
and ``copy_`` release the GIL): sha256 runs at a few GB/s per core, slower than a memcpy.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.format import TensorInfo

READERS = ("direct", "pinned", "threaded")
#: bytes hashed and copied at a time: small enough to stay in cache between the two
_HASH_STEP = 4 << 20


def check_digest(info: TensorInfo, got: str, want: str) -> None:
    """A tensor whose bytes hash to another sha256 than the manifest's is never handed out."""
    if got != want:
        raise MoeConvertError("checksum mismatch: the tensor's bytes changed after conversion",
                              file=info.file.name, tensor=info.name, expected=f"sha256 {want[:16]}…",
                              found=f"sha256 {got[:16]}…")


def hash_workers() -> int:
    return min(8, os.cpu_count() or 1)


class Reader:
    """Mapped shards of one output folder. Use as a context manager; tensors it made outlive it."""

    name = "direct"
    #: threads that hash-and-copy tensors in parallel when verifying (1: the reader's buffer is shared)
    _verify_threads = hash_workers()

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._maps: dict[Path, mmap.mmap] = {}

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a CPU view still refers to it; the mapping goes with the last view
                pass
        self._maps.clear()

    def _map(self, path: Path) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None:
            try:
                with open(path, "rb") as f:
                    # ACCESS_COPY: a private mapping torch may view as writable; nothing is ever written.
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise MoeConvertError(f"cannot map the shard: {e}", file=str(path)) from e
            self._maps[path] = m
        return m

    def host_bytes(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's stored bytes, a uint8 view into the mapping (no copy)."""
        m = self._map(info.file)
        if info.end > len(m):
            raise MoeConvertError("shard ended before the tensor's data (truncated since it was checked?)",
                                  file=str(info.file), tensor=info.name, expected=f"{info.end} bytes",
                                  found=f"{len(m)} bytes")
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(m, dtype=torch.uint8, count=info.nbytes, offset=info.start)

    def read(self, info: TensorInfo, sha256: str | None = None) -> torch.Tensor:
        """A new tensor on the device holding the stored tensor (its dtype and shape); with ``sha256``,
        only if its bytes hash to it."""
        dst = torch.empty(info.nbytes, dtype=torch.uint8, device=self.device)
        self.read_into(info, dst, sha256)
        return dst.view(info.torch_dtype).reshape(info.shape) if info.nbytes else \
            torch.empty(info.shape, dtype=info.torch_dtype, device=self.device)

    def read_many(self, infos: list[TensorInfo], expect: dict[str, str] | None = None) -> list[torch.Tensor]:
        """New device tensors holding the stored tensors, in the order asked for. ``expect``: name ->
        sha256 each tensor must hash to (every name asked for must be in it)."""
        if expect is None:
            return [self.read(info) for info in infos]
        workers = min(self._verify_threads, len(infos))
        if workers <= 1:
            return [self.read(info, expect[info.name]) for info in infos]
        for info in infos:
            self._map(info.file)  # mapped here, once, not raced for by the threads
        with ThreadPoolExecutor(workers, thread_name_prefix="moeconvert-verify") as pool:
            return list(pool.map(lambda info: self.read(info, expect[info.name]), infos))

    def read_into(self, info: TensorInfo, dst: torch.Tensor, sha256: str | None = None) -> None:
        """Fill ``dst`` (uint8, ``info.nbytes`` long, on the device) with the tensor's bytes."""
        if sha256 is None:
            if info.nbytes:
                dst.copy_(self.host_bytes(info))
            return
        src, h = self.host_bytes(info), hashlib.sha256()
        on_host = dst.device.type == "cpu"
        for a in range(0, info.nbytes, _HASH_STEP):
            b = min(a + _HASH_STEP, info.nbytes)
            if on_host:  # hash the very bytes handed out
                dst[a:b].copy_(src[a:b])
                h.update(dst[a:b].numpy())
            else:  # hash the mapped bytes, then copy them while they are in cache
                h.update(src[a:b].numpy())
                dst[a:b].copy_(src[a:b])
        check_digest(info, h.hexdigest(), sha256)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class PinnedReader(Reader):
    """Copies through a reused pinned buffer: two halves, each ``chunk`` bytes, alternating."""

    name = "pinned"
    _verify_threads = 1

    def __init__(self, device: torch.device, chunk: int = 32 << 20):
        super().__init__(device)
        if self.device.type != "cuda":
            raise MoeConvertError("the pinned reader stages host -> CUDA copies; use reader='direct' on "
                                  f"{self.device.type}", expected="a CUDA device", found=str(self.device))
        self.chunk = chunk
        self._staging = torch.empty(2 * chunk, dtype=torch.uint8, pin_memory=True)
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._used = [False, False]

    def read_into(self, info: TensorInfo, dst: torch.Tensor, sha256: str | None = None) -> None:
        src = self.host_bytes(info)
        h = hashlib.sha256() if sha256 is not None else None
        for i, a in enumerate(range(0, info.nbytes, self.chunk)):
            half = i % 2
            n = min(self.chunk, info.nbytes - a)
            if self._used[half]:
                self._events[half].synchronize()  # the copy out of this half has finished
            stage = self._staging[half * self.chunk: half * self.chunk + n]
            stage.copy_(src[a:a + n])
            dst[a:a + n].copy_(stage, non_blocking=True)
            self._events[half].record()
            self._used[half] = True
            if h is not None:
                h.update(stage.numpy())  # the bytes being copied, hashed while the copy runs
        if h is not None:
            check_digest(info, h.hexdigest(), sha256)


def make_reader(kind: str, device: torch.device, *, threads: int | None = None, buffer_mb: float | None = None,
                progress: bool | None = None) -> Reader:
    """``threads``, ``buffer_mb`` and ``progress`` apply to the threaded reader (fastload.py)."""
    if kind == "auto":
        # On CUDA the threaded reader: several pread threads into pinned buffers, copies overlapped
        # (fastload.py). On CPU there is no host-to-device copy to stage: one memcpy from the mapping.
        kind = os.environ.get("MOECONVERT_READER", "threaded" if device.type == "cuda" else "direct")
    if kind == "direct":
        return Reader(device)
    if kind == "pinned":
        return PinnedReader(device)
    if kind == "threaded":
        from moeconvert.runtime.fastload import ThreadedReader

        return ThreadedReader(device, threads=threads, buffer_mb=buffer_mb, progress=progress)
    raise MoeConvertError("unknown reader", tensor="reader", expected="auto | " + " | ".join(READERS), found=kind)
