"""``--load-format moeconvert``: vLLM's default loader, except that each rank reads only its experts' bytes.

vLLM's default loader hands every tensor of the folder to every rank, so each rank reads every stacked
expert tensor whole and the plugin's parameter loaders copy their share out of it. This loader reads, for
each MoE layer the rank built with one of the plugin's methods, only the byte ranges of the rank's experts
(as vLLM's expert map gives them) and of its TP cut (``Layout.tp_cuts``), straight into the parameters
through the runtime's threaded reader (``moeconvert.runtime.fastload``: reader threads, positioned reads,
pinned double-buffered copies on their own CUDA streams), every layer's ranges in one pipeline; every
other tensor is read whole and goes through the model's own ``load_weights`` as with vLLM's default loader. Stacked tensors of layers the rank does not build (another
pipeline stage) are not read at all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from moeconvert.format.manifest import layer_tensor_entries
from moeconvert.format.safetensors import TensorInfo, read_header
from moeconvert.runtime.fastload import ThreadedReader

logger = logging.getLogger(__name__)


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(folder.glob("*.safetensors"))


def _ranges(info: TensorInfo, experts: list[int], cut, tp_size: int, tp_rank: int):
    """``(file offset, offset in the parameter's bytes, length)`` of the rank's bytes, adjacent ones merged."""
    E, *S = info.shape
    per_expert = info.nbytes // E
    out: list[list[int]] = []

    def add(src: int, dst: int, n: int) -> None:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1][2] += n
        else:
            out.append([src, dst, n])

    if cut is None or cut.dim is None:
        for slot, e in enumerate(experts):
            add(info.start + e * per_expert, slot * per_expert, per_expert)
        return out
    d = cut.dim - 1  # in the expert's own dims
    inner = math.prod(S[d + 1:]) * (per_expert // math.prod(S))
    outer = math.prod(S[:d])
    rank_d = S[d] // tp_size
    rank_expert = per_expert // tp_size
    for slot, e in enumerate(experts):
        for o in range(outer):
            for start, at, n in cut.pieces(S[d], tp_size, tp_rank):
                add(info.start + e * per_expert + (o * S[d] + start) * inner,
                    slot * rank_expert + (o * rank_d + at) * inner, n * inner)
    return out


def _pieces(info: TensorInfo, dst: torch.Tensor, ranges) -> list[tuple[TensorInfo, torch.Tensor]]:
    """The ranges as the fast reader's pieces: (the file bytes, as a TensorInfo, the parameter's bytes)."""
    flat = dst.view(-1).view(torch.uint8)
    return [(dataclasses.replace(info, dtype="U8", shape=(n,), start=src, end=src + n), flat[at:at + n])
            for src, at, n in ranges]


def _read_into(fd: int, dst: torch.Tensor, ranges) -> None:
    view = memoryview(dst.view(-1).view(torch.uint8).numpy())
    for src, at, n in ranges:
        done = 0
        while done < n:  # preadv may return short counts
            got = os.preadv(fd, [view[at + done:at + n]], src + done)
            if got <= 0:
                raise OSError(f"short read at byte {src + done}")
            done += got


def _open(fds: dict[Path, int], file: Path) -> int:
    """The one descriptor of ``file`` for this load (opened on first use, closed by the caller)."""
    if file not in fds:
        fds[file] = os.open(file, os.O_RDONLY)
    return fds[file]


class MoeconvertModelLoader(DefaultModelLoader):
    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        from moeconvert.integrations.vllm.methods.base import FinalLayoutMethod, local_experts

        ours = {name.removesuffix(".routed_experts"): m for name, m in model.named_modules()
                if isinstance(m, RoutedExperts) and isinstance(m.quant_method, FinalLayoutMethod)}
        config = next((m.quant_config for m in ours.values()), None)
        if config is None or config.manifest is None:  # not a converted folder: vLLM's own loader
            return super().load_weights(model, model_config)
        t0 = time.perf_counter()
        folder = Path(model_config.model)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model_config.model, revision=model_config.revision,
                                            local_files_only=True))
        infos: dict[str, TensorInfo] = {}
        for shard in _shards(folder):
            infos.update(read_header(shard))
        stacked = {e["name"] for i, m in enumerate(config.manifest["moe_layers"]) for _, e in layer_tensor_entries(m, i)}
        fds: dict[Path, int] = {}
        pieces: dict[torch.device, list] = {}  # per device: the experts' byte ranges, read by the fast reader
        try:
            for prefix, module in ours.items():
                method = module.quant_method
                experts = (local_experts(module) if method.share.experts_from_layer
                           else list(range(method.entry["num_experts"])))
                share = method.share
                for suffix, t in share.tensors(method.entry).items():
                    info = infos[t["name"]]
                    if list(info.shape) != list(t["shape"]) or info.dtype != t["dtype"]:
                        raise method._refuse(f"{suffix}: the file holds {list(info.shape)} {info.dtype}, the manifest "
                                             f"{t['shape']} {t['dtype']}")
                    fd = _open(fds, info.file)
                    param = getattr(module, suffix)
                    cut = share.cuts.get(suffix) if share.tp_size > 1 and not share.stored else None
                    if cut is not None and cut.zeros_on(share.tp_rank):  # rank 0's alone (w2's bias): read nothing
                        param.data.zero_()
                        method.loaded[suffix] = method.loaded.get(suffix, 0) + 1
                        continue
                    if share.stored:  # this rank's block [r] of the stored [T, E, ...] tensor
                        block = info.nbytes // share.tp_size
                        info = dataclasses.replace(info, shape=tuple(info.shape[1:]), start=info.start + share.tp_rank * block,
                                                   end=info.start + (share.tp_rank + 1) * block)
                    ranges = _ranges(info, experts, cut, share.tp_size, share.tp_rank)
                    if param.is_contiguous():  # straight into the parameter, with every other piece at once
                        pieces.setdefault(param.device, []).extend(_pieces(info, param.data, ranges))
                    else:
                        host = torch.empty(param.shape, dtype=param.dtype)
                        _read_into(fd, host, ranges)
                        param.data.copy_(host)
                    method.loaded[suffix] = method.loaded.get(suffix, 0) + 1
            for device, device_pieces in pieces.items():
                with ThreadedReader(device, progress=False, exact=True) as reader:
                    reader.read_into_pieces(device_pieces)

            def rest():
                for name, info in infos.items():
                    if name in stacked:
                        continue
                    fd = _open(fds, info.file)
                    tensor = torch.empty(info.shape, dtype=info.torch_dtype)
                    _read_into(fd, tensor, [(info.start, 0, info.nbytes)])
                    yield name, tensor

            model.load_weights(rest())
        finally:
            for fd in fds.values():
                os.close(fd)
        # the words of vLLM's DefaultModelLoader.load_weights, so that `bench vllm-serve` reads both alike
        logger.info("Loading weights took %.2f seconds", time.perf_counter() - t0)
