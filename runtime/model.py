"""``load``: a converted folder -> MoE layers on the device, each tensor copied once, nothing repacked."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.kernels.tune import tune_wanted
from moeconvert.layouts.output import check_layer_bytes
from moeconvert.runtime.layer import MoELayer
from moeconvert.runtime.loader import make_reader
from moeconvert.runtime.manifest import CheckedManifest, LayerEntry, read_checked
from moeconvert.runtime.routing import Router, router_config, router_from_tensors

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class MoEModel:
    """What ``load`` gives: the MoE layers of one converted output, on one device."""

    path: Path
    device: torch.device
    manifest: dict
    config: dict
    moe_layers: dict[str, MoELayer]
    checked: CheckedManifest = field(repr=False)
    reader: str = "direct"
    #: loaded with ``verify=True``: ``tensor()`` checks what it reads too
    verify: bool = False

    def __getitem__(self, key: str | int) -> MoELayer:
        """A layer by experts prefix (``model.layers.3.mlp.experts``) or by decoder layer number."""
        if isinstance(key, int):
            for layer in self.moe_layers.values():
                if layer.entry.index == key:
                    return layer
            raise KeyError(f"no loaded MoE layer {key} (loaded: {[l.entry.index for l in self.moe_layers.values()]})")
        return self.moe_layers[key]

    def __iter__(self):
        return iter(self.moe_layers.values())

    def __len__(self) -> int:
        return len(self.moe_layers)

    @property
    def partition(self) -> dict:
        return dict(self.manifest["partition"])

    def kernels(self) -> dict[str, str]:
        """prefix -> the kernel that runs the layer."""
        return {p: layer.kernel for p, layer in self.moe_layers.items()}

    def describe(self) -> dict:
        return {"path": str(self.path), "device": str(self.device), "family": self.manifest.get("family"),
                "layout": self.manifest["layout"], "partition": self.partition, "reader": self.reader,
                "layers": [layer.describe() for layer in self.moe_layers.values()]}

    def tensor(self, name: str) -> torch.Tensor:
        """Any other tensor of the output (attention, norms, embeddings, ...), read to the device now.

        After ``load(verify=True)`` the bytes are hashed as they are read, on every call: the file may
        have changed since the load, and a tensor whose sha256 is not the manifest's is never returned.
        """
        info = self.checked.tensors.get(name)
        if info is None:
            raise MoeConvertError("no such tensor in the output", file=str(self.path), tensor=name)
        with make_reader(self.reader, self.device) as r:
            t = r.read(info, self.checked.sha256[name] if self.verify else None)
            r.synchronize()
        return t


def _resolve(path_or_repo: str | Path, revision: str | None) -> Path:
    p = Path(path_or_repo).expanduser()
    if p.exists() or not _REPO_ID.match(str(path_or_repo)):
        if revision is not None:
            raise MoeConvertError("revision applies to Hub repo ids, not to local folders", file=str(path_or_repo))
        return p
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path_or_repo), revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except LocalEntryNotFoundError as e:
        raise MoeConvertError("not in the local Hugging Face cache and the Hub cannot be reached",
                              file=str(path_or_repo)) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise MoeConvertError(f"cannot fetch from the Hub: {str(e).splitlines()[0]}", file=str(path_or_repo)) from e


def _select(layers: Iterable[int | str] | None, entries: list[LayerEntry]) -> list[LayerEntry]:
    if layers is None:
        return entries
    wanted = list(layers)
    out = []
    for key in wanted:
        match = [e for e in entries if (e.index == key if isinstance(key, int) else e.prefix == key)]
        if not match:
            raise MoeConvertError("no such MoE layer in the output", tensor=str(key),
                                  expected=", ".join(str(e.index) for e in entries) + " (or their prefixes)")
        out += [e for e in match if e not in out]
    return out


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: load's arguments: (what each must be, in words; the test) — every public argument, checked in one place
#: before anything is read, so a wrong type or value is one line naming it, never a refusal about
#: something else (a string TP size is not "a folder cut for another TP size") or a silent other meaning
_ARGUMENTS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "path_or_repo": ("a folder path or a Hub repo id", lambda v: isinstance(v, (str, os.PathLike)) and str(v) != ""),
    "device": ("None, a device string or a torch.device", lambda v: v is None or isinstance(v, (str, torch.device))),
    "layers": ("None or a list of layer numbers (int >= 0) and experts prefixes (str)",
               lambda v: v is None or (isinstance(v, (list, tuple, set, frozenset, range)) and all(
                   (_is_int(x) and x >= 0) or (isinstance(x, str) and x) for x in v))),
    "tp_size": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "tp_rank": ("None or an int >= 0", lambda v: v is None or (_is_int(v) and v >= 0)),
    "ep_size": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "ep_rank": ("None or an int >= 0", lambda v: v is None or (_is_int(v) and v >= 0)),
    "verify": ("True or False", lambda v: isinstance(v, bool)),
    "kernel": ("None or a kernel name (str)", lambda v: v is None or (isinstance(v, str) and v != "")),
    "reader": ("a reader name (str)", lambda v: isinstance(v, str) and v != ""),
    "revision": ("None or a revision (str)", lambda v: v is None or (isinstance(v, str) and v != "")),
    "threads": ("None or an int >= 1", lambda v: v is None or (_is_int(v) and v >= 1)),
    "buffer_mb": ("None or a number > 0", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                         and math.isfinite(v) and v > 0)),
    "progress": ("None, True or False", lambda v: v is None or isinstance(v, bool)),
}  # tune: read with $MOECONVERT_KERNEL_TUNE by moeconvert.kernels.tune.tune_wanted, which refuses a bad one


def check_load_arguments(**given) -> None:
    """Refuse, in one line naming it, any argument of :func:`load` that is not what it must be."""
    for name, value in given.items():
        what, ok = _ARGUMENTS[name]
        if not ok(value):
            raise MoeConvertError(f"load() argument {name}", expected=what, found=repr(value)[:80])
    for size, rank in (("tp_size", "tp_rank"), ("ep_size", "ep_rank")):
        if given[size] is not None and given[rank] is not None and given[rank] >= given[size]:
            raise MoeConvertError(f"load() argument {rank}", expected=f"below {size} {given[size]}", found=given[rank])
    if isinstance(given["device"], str):
        try:
            torch.device(given["device"])
        except RuntimeError:
            raise MoeConvertError("load() argument device", expected="a device torch knows: 'cpu', 'cuda', 'cuda:1', ...",
                                  found=repr(given["device"])[:80]) from None


def load(path_or_repo: str | Path, device: str | torch.device | None = None, layers: Iterable[int | str] | None = None,
         tp_rank: int | None = None, *, tp_size: int | None = None, ep_size: int | None = None,
         ep_rank: int | None = None, verify: bool = False, kernel: str | None = None, reader: str = "auto",
         revision: str | None = None, threads: int | None = None, buffer_mb: float | None = None,
         progress: bool | None = None, tune: bool | None = None) -> MoEModel:
    """Load a ``moeconvert`` output's MoE layers onto ``device`` (default: cuda if present, else cpu).

    ``layers``: decoder layer numbers or experts prefixes (default: all). ``tp_rank`` / ``tp_size`` /
    ``ep_size`` / ``ep_rank``: the partition this process expects; an output cut otherwise is refused.
    ``verify``: check the sha256 of every shard header and of config.json, and of every tensor's bytes
    as they are read (now for the layers' tensors, at each ``model.tensor`` call for the others); a
    tensor whose digest is not the manifest's is never returned. ``kernel``: force a
    kernel (``reference``, ``vllm-marlin``, ``triton``), as ``$MOECONVERT_KERNEL`` does. ``reader``:
    ``auto`` | ``direct`` | ``pinned`` | ``threaded`` (loader.py, fastload.py). ``threads`` /
    ``buffer_mb``: the threaded reader's workers and buffer size (default ``$MOECONVERT_LOAD_THREADS``
    or min(8, cpus), ``$MOECONVERT_LOAD_BUFFER_MB`` or 64). ``progress``: a bar with GB/s on stderr
    (default: for loads above 1 GB on a terminal). ``tune``: tune our Triton kernel's tiles for each
    ``triton-fast`` layer shape that no table holds, once per GPU, into the user's table (default
    ``$MOECONVERT_KERNEL_TUNE``; docs/kernels.md, "Tuning"). Nothing is returned unless every tensor was read.
    """
    check_load_arguments(path_or_repo=path_or_repo, device=device, layers=layers, tp_rank=tp_rank, tp_size=tp_size,
                         ep_size=ep_size, ep_rank=ep_rank, verify=verify, kernel=kernel, reader=reader,
                         revision=revision, threads=threads, buffer_mb=buffer_mb, progress=progress)
    want_tune = tune_wanted(tune)  # a bad value is refused before anything is read
    root = _resolve(path_or_repo, revision)
    dev = torch.device(device or _default_device())
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MoeConvertError("a CUDA device was asked for, but torch sees none", tensor="device",
                              expected="cpu, or a machine with CUDA", found=str(dev))
    if tune and dev.type != "cuda":  # asked for by name; the variable applies to CUDA loads only
        raise MoeConvertError("tuning the kernel's tiles times CUDA graphs: it needs a CUDA device",
                              tensor="tune", expected="cuda", found=str(dev))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    checked = read_checked(root, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank, verify=verify)
    config = checked.config
    family = checked.family
    part = checked.partition
    selected = _select(layers, checked.layers)
    names: list[str] = []
    for entry in selected:
        names += [info.name for info in entry.tensors.values()] + list(entry.router) + list(entry.shared)
    names = list(dict.fromkeys(names))
    out: dict[str, MoELayer] = {}
    with make_reader(reader, dev, threads=threads, buffer_mb=buffer_mb, progress=progress) as r:
        # every tensor at once: a reader may plan its reads over whole shards (fastload.py), and
        # hashes each tensor's bytes in the pass that copies them
        expect = {n: checked.sha256[n] for n in names} if verify else None
        read = dict(zip(names, r.read_many([checked.tensors[n] for n in names], expect)))
        r.synchronize()
        reader_name = r.name
    for entry in selected:
        tensors = {suffix: read[info.name] for suffix, info in entry.tensors.items()}
        if verify:  # the digests say the bytes are the ones written; this, that they are bytes the layout writes
            check_layer_bytes(entry.layout, entry.shape, entry.scheme, tensors, entry.prefix)
        router = None
        rcfg = router_config(family, config, entry.top_k) if entry.router else None
        if rcfg is not None:
            router = router_from_tensors(rcfg, {n: read[n] for n in entry.router})
        shared = {n: read[n] for n in entry.shared}
        out[entry.prefix] = MoELayer(entry, tensors, dev, router, shared, config, part["tp_size"], kernel)
    if dev.type == "cuda" and want_tune:
        from moeconvert.runtime.moeconvert_triton import tune_first_use

        tune_first_use(out.values())
    return MoEModel(path=root, device=dev, manifest=checked.raw, config=config, moe_layers=out, checked=checked,
                    reader=reader_name, verify=verify)


__all__ = ["load", "MoEModel", "MoELayer", "Router"]
