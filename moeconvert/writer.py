"""The writer: sharded safetensors written in place from a plan, inside a staging folder.

The whole file layout (shards, headers, every tensor's offsets) is fixed before the first byte is
written, so each tensor can be filled piece by piece (a chunk of experts at a time) with ``pwrite`` and
hashed as it goes: peak memory is one chunk, whatever the size of the model. The output folder only
appears, by one rename, once every shard, the index, the copied files and finally ``moeconvert.json``
are on disk; a failure removes the staging folder and leaves any earlier output untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeconvert.errors import InternalError, MoeConvertError
from moeconvert.sources import INDEX_NAME, MANIFEST_NAME, TORCH_TO_CODE


@dataclass
class PlannedTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    nbytes: int
    source: str | None = None  # copied byte for byte from this source tensor
    layer: int | None = None  # else: produced by plan.layers[layer]'s layout ...
    suffix: str | None = None  # ... under this suffix
    shard: int = -1
    offset: int = 0  # absolute offset in the shard file


@dataclass
class Shard:
    filename: str
    tensors: list[PlannedTensor] = field(default_factory=list)
    header: bytes = b""

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def layout_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[Shard]:
    """Greedy, in plan order: a shard closes when the next tensor would take it past the limit."""
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    shards = []
    for i, group in enumerate(groups):
        shard = Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", group)
        header: dict = {"__metadata__": {"format": "pt"}}
        pos = 0
        for t in group:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        shard.header = len(raw).to_bytes(8, "little") + raw
        pos = len(shard.header)
        for t in group:
            t.shard, t.offset = i, pos
            pos += t.nbytes
        shards.append(shard)
    return shards


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def dtype_code(dt: torch.dtype) -> str:
    return TORCH_TO_CODE[dt]


class StagedOutput:
    """Shard files being filled in a staging folder next to the final output."""

    def __init__(self, out: Path, shards: list[Shard], overwrite: bool):
        self.out = out
        self.overwrite = overwrite
        self.shards = shards
        self.staging = out.parent / f".{out.name}.moeconvert-partial-{os.getpid()}"
        self._fds: list[int] = []
        self._hash: dict[str, tuple[object, int]] = {}  # name -> (sha256, bytes hashed so far)

    def __enter__(self) -> "StagedOutput":
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)
        try:
            for shard in self.shards:
                fd = os.open(self.staging / shard.filename, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds.append(fd)
                os.pwrite(fd, shard.header, 0)
                os.ftruncate(fd, shard.size)
        except OSError as e:
            self._cleanup()
            raise MoeConvertError(f"cannot write the output: {e.strerror}", file=str(self.out)) from e
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._cleanup()

    def _cleanup(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        shutil.rmtree(self.staging, ignore_errors=True)

    def write(self, t: PlannedTensor, at: int, data: memoryview) -> None:
        """Write ``data`` at byte ``at`` of tensor ``t``. Pieces of one tensor must come in order."""
        h, done = self._hash.get(t.name) or (hashlib.sha256(), 0)
        if at != done or at + len(data) > t.nbytes:
            raise InternalError(f"{t.name}: piece at {at}+{len(data)} after {done} of {t.nbytes} bytes")
        h.update(data)
        self._hash[t.name] = (h, at + len(data))
        fd, pos, view = self._fds[t.shard], t.offset + at, memoryview(data).cast("B")
        try:
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        except OSError as e:
            raise MoeConvertError(f"writing failed: {e.strerror}", file=self.shards[t.shard].filename,
                                  tensor=t.name) from e

    def digest(self, t: PlannedTensor) -> str:
        h, done = self._hash.get(t.name) or (hashlib.sha256(), 0)
        if done != t.nbytes:
            raise InternalError(f"{t.name}: {done} of {t.nbytes} bytes written")
        return h.hexdigest()

    def finish(self, index: dict, copies: list[Path], manifest: dict) -> None:
        """Index, copied files, then the manifest (last), then the one rename that makes it visible."""
        try:
            for fd in self._fds:
                os.fsync(fd)
                os.close(fd)
            self._fds = []
            (self.staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            for p in copies:
                shutil.copyfile(p, self.staging / p.name)
            tmp = self.staging / (MANIFEST_NAME + ".tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps(manifest, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.staging / MANIFEST_NAME)
            self._publish()
        except OSError as e:
            self._cleanup()
            raise MoeConvertError(f"cannot finish the output: {e.strerror}", file=str(self.out)) from e

    def _publish(self) -> None:
        out = self.out
        old = None
        if out.exists():
            if any(out.iterdir()):
                if not self.overwrite:  # checked before converting too; something appeared meanwhile
                    raise MoeConvertError("output folder exists and is not empty (use --overwrite)", file=str(out))
                old = out.parent / f".{out.name}.moeconvert-old-{os.getpid()}"
                os.rename(out, old)
            else:
                out.rmdir()
        os.rename(self.staging, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_output_target(out: Path, source_root: Path, overwrite: bool) -> None:
    """Refuse, before any work, outputs that would clobber data."""
    out_r, src_r = out.resolve(), source_root.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        raise MoeConvertError("the output folder must be outside the source checkpoint (and not contain it)",
                              file=str(out))
    if out.exists():
        if not out.is_dir():
            raise MoeConvertError("output path exists and is not a folder", file=str(out))
        if any(out.iterdir()) and not overwrite:
            raise MoeConvertError("output folder exists and is not empty (use --overwrite to replace it)",
                                  file=str(out))
    parent = out_r.parent
    if not parent.is_dir():
        raise MoeConvertError("the output's parent folder does not exist", file=str(parent))
    if not os.access(parent, os.W_OK):
        raise MoeConvertError("cannot write in the output's parent folder", file=str(parent))
