"""``moeconvert bench load`` and ``moeconvert bench layer``: measured side by side in one run, medians.

``bench load OUT`` times three ways to get the same MoE layers ready on the device:

a. ``converted``: ``moeconvert.runtime.load(OUT)`` (validate the manifest, map, one copy per tensor);
b. ``floor``: the same tensors of the same files read to the device by safetensors itself
   (``safe_open(..., device=...)``), nothing else: what any loader of these bytes pays;
c. ``load-then-process``: the *source* checkpoint's tensors of those layers read to the device the
   same way, then processed there as an engine does at start: decoded to the canonical block, quantized
   (``quantize`` outputs) and encoded into the layout, all on the device with moeconvert's own code.
   This stands in for the engine's own start-up work (vLLM's repack/quantize kernels differ).

Each is run once to warm up (CUDA context, page cache, kernels), then ``runs`` times; the ratios are of
medians. ``bench layer OUT`` times one layer's dispatched kernel against the PyTorch reference for a
few token counts (CUDA events on a GPU, ``perf_counter`` on CPU), and reports their relative difference.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.runtime.dispatch import KernelFallbackWarning
from moeconvert.runtime.manifest import read_checked
from moeconvert.runtime.model import load


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    dt = time.perf_counter() - t0
    del result
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dt


class _DeviceSource:
    """What ``decode_chunk`` reads from, backed by tensors already on the device."""

    def __init__(self, source, tensors: dict[str, torch.Tensor]):
        self._source, self._tensors = source, tensors
        self.tensors = source.tensors

    def info(self, name):
        return self._source.info(name)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        t = self._tensors[name]
        return t if rows is None else t[rows[0]:rows[1]]


def _read_to_device(files_names: dict[Path, list[str]], device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for path, names in files_names.items():
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for n in names:
                out[n] = f.get_tensor(n)
    return out


def _by_file(infos) -> dict[Path, list[str]]:
    groups: dict[Path, list[str]] = {}
    for info in infos:
        groups.setdefault(info.file, []).append(info.name)
    return groups


def _process_source(source, model_map, manifest: dict, prefixes: list[str], device: torch.device):
    """(c): source tensors of the layers to the device, then decode / quantize / encode there."""
    from moeconvert.canonical import Partition
    from moeconvert.convert import layer_shape, output_scheme
    from moeconvert.decode import decode_chunk
    from moeconvert.layouts import get_layout
    from moeconvert.quantize import Quantization, output_block

    part = Partition(**manifest["partition"])
    quant = Quantization(**manifest["quantization"], device=str(device)) if manifest.get("quantization") else None
    layers = [lm for lm in model_map.layers if lm.prefix in prefixes]
    names = [n for lm in layers for n in lm.source_tensors() + lm.router + lm.shared]
    held = _read_to_device(_by_file(source.info(n) for n in names), device)
    src = _DeviceSource(source, held)
    encoded = []
    for lm in layers:
        layout = get_layout(manifest["layout"]["name"], output_scheme(lm, quant).kind)
        shape, e0 = layer_shape(lm, part, manifest["dtype"], layout, quant)
        block = decode_chunk(src, lm, part, e0, e0 + shape.num_experts)
        if output_scheme(lm, quant).kind == "mxfp4":
            unpadded = (shape.extra.get("hidden_size_unpadded", shape.hidden_size),
                        shape.extra.get("intermediate_size_unpadded", shape.intermediate_size))
            block = output_block(block, shape, unpadded, quant, prefix=lm.prefix, expert_offset=e0)
        block = type(block)(scheme=block.scheme, **{k: v.to(device) for k, v in block.tensors().items()})
        encoded.append(layout.encode(block, shape))
        del block
    return encoded, held


def bench_load(out: Path, device: str = "cuda", runs: int = 5, layers=None, reader: str = "auto",
               source: str | None = None) -> dict:
    dev = torch.device(device)
    checked = read_checked(out)
    entries = [e for e in checked.layers if layers is None or e.index in layers or e.prefix in layers]
    if not entries:
        raise MoeConvertError("no such MoE layer in the output", tensor=str(layers))
    prefixes = [e.prefix for e in entries]
    names = [n for e in entries for n in [i.name for i in e.tensors.values()] + e.router + e.shared]
    nbytes = sum(checked.tensors[n].nbytes for n in names)
    floor_files = _by_file(checked.tensors[n] for n in names)

    src_id = source or checked.raw["source"]["id"]
    src_obj = model_map = None
    src_note = None
    try:
        from moeconvert.modelmap import map_model
        from moeconvert.sources import open_source

        src_obj = open_source(src_id, checked.raw["source"].get("revision") if source is None and not
                              Path(src_id).exists() else None)
        model_map = map_model(src_obj)
    except MoeConvertError as e:
        src_note = f"source {src_id} not available ({e.line()}): (c) skipped"

    def converted():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KernelFallbackWarning)
            return load(out, device=dev, layers=[e.prefix for e in entries], reader=reader)

    ways = {"converted": converted, "floor": lambda: _read_to_device(floor_files, dev)}
    if model_map is not None:
        ways["load_then_process"] = lambda: _process_source(src_obj, model_map, checked.raw, prefixes, dev)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(runs + 1):  # run 0 warms up
        for k, fn in ways.items():  # interleaved: each sees the same machine state
            dt = _timed(fn, dev)
            if i:
                times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "output": str(out), "device": str(dev), "runs": runs, "layers": len(entries), "bytes": nbytes,
        "source": src_id, "source_note": src_note,
        "seconds": {k: [round(x, 6) for x in v] for k, v in times.items()},
        "median_seconds": med,
        "ratio_converted_vs_floor": med["converted"] / med["floor"],
        "stand_in": "load_then_process = the source's tensors read to the device, then decoded, quantized "
                    "(quantize outputs) and encoded there with moeconvert's own code: a stand-in for the "
                    "engine's start-up processing, not vLLM's own kernels",
    }
    if "load_then_process" in med:
        result["ratio_load_then_process_vs_floor"] = med["load_then_process"] / med["floor"]
        result["speedup_converted_vs_load_then_process"] = med["load_then_process"] / med["converted"]
    return result


def _time_call(fn, device: torch.device, runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_layer(out: Path, device: str = "cuda", tokens=(1, 16, 128, 1024), runs: int = 20, layer=None,
                kernel: str | None = None) -> dict:
    dev = torch.device(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        model = load(out, device=dev, layers=None if layer is None else [layer], kernel=kernel)
    moe = next(iter(model))
    dt = torch.bfloat16 if model.manifest["dtype"] != "float16" else torch.float16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for M in tokens:
        x = (torch.randn(M, moe.hidden_size, generator=gen, device=dev) * 4).to(dt)
        if moe.router is not None:
            w, ids = moe.route(moe.router_logits(x))
        else:
            k = moe.top_k or 2
            ids = torch.stack([torch.randperm(moe.num_experts, generator=gen, device=dev)[:k] for _ in range(M)])
            w = torch.full((M, k), 1.0 / k, device=dev)
            ids = (ids + moe.entry.expert_offset).to(torch.int32)
        t_kernel = _time_call(lambda: moe(x, w, ids), dev, runs)
        t_ref = _time_call(lambda: moe.reference(x, w, ids), dev, runs)
        a, b = moe(x, w, ids).float(), moe.reference(x, w, ids).float()
        rows.append({"tokens": M, "kernel_seconds": t_kernel, "reference_seconds": t_ref,
                     "speedup_vs_reference": t_ref / t_kernel,
                     "rel_diff_vs_reference": float((a - b).norm() / b.norm().clamp_min(1e-30))})
    return {"output": str(out), "device": str(dev), "layer": moe.prefix, "layout": moe.entry.layout.name,
            "scheme": moe.entry.scheme.describe(), "kernel": moe.kernel, "kernel_note": moe.kernel_note,
            "runs": runs, "rows": rows}
