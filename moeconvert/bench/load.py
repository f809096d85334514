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

import math
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.runtime.dispatch import REFERENCE, KernelFallbackWarning
from moeconvert.runtime.fastload import default_buffer_mb, default_threads
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
               source: str | None = None, *, threads: int | None = None, buffer_mb: float | None = None) -> dict:
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
            return load(out, device=dev, layers=[e.prefix for e in entries], reader=reader, threads=threads,
                        buffer_mb=buffer_mb, progress=False)

    ways = {"converted": converted, "floor": lambda: _read_to_device(floor_files, dev)}
    if model_map is not None:
        ways["load_then_process"] = lambda: _process_source(src_obj, model_map, checked.raw, prefixes, dev)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(runs + 1):  # run 0 warms up
        for k, fn in ways.items():  # interleaved: each sees the same machine state
            dt = _timed(fn, dev)
            if i:
                times[k].append(dt)
    shown = {k: [round(x, 6) for x in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in shown.items()}  # of the figures as listed
    result = {
        "output": str(out), "device": str(dev), "runs": runs, "layers": len(entries), "bytes": nbytes,
        "source": src_id, "source_note": src_note,
        "seconds": shown,
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
        diff = None  # the dispatched kernel is the reference: comparing a call with itself proves nothing
        if moe.kernel != REFERENCE:
            a, b = moe(x, w, ids).float(), moe.reference(x, w, ids).float()
            diff = float((a - b).norm() / b.norm().clamp_min(1e-30))
        rows.append({"tokens": M, "kernel_seconds": t_kernel, "reference_seconds": t_ref,
                     "speedup_vs_reference": t_ref / t_kernel, "rel_diff_vs_reference": diff})
    return {"output": str(out), "device": str(dev), "layer": moe.prefix, "layout": moe.entry.layout.name,
            "scheme": moe.entry.scheme.describe(), "kernel": moe.kernel, "kernel_note": moe.kernel_note,
            "runs": runs, "rows": rows}


# ------------------------------------------------------------------------------------------------
# bench load --io: how fast bytes reach the device, side by side with safetensors and a plain read
# ------------------------------------------------------------------------------------------------

_GB = 1e9
_SEQ_READ = 16 << 20
DROP_CACHES = "/proc/sys/vm/drop_caches"


def _shard_files(checked) -> list[Path]:
    return [checked.root / s["file"] for s in checked.raw.get("shards") or []]


def sequential_read(files: list[Path]) -> int:
    """A plain sequential read of ``files`` (dd-style: 16 MB reads into one reused buffer, no device copy)."""
    buf = bytearray(_SEQ_READ)
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def resident_fraction(files: list[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (``mincore``), or None where it cannot be asked."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
    pages = resident = 0
    for path in files:
        size = path.stat().st_size
        if not size:
            continue
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable view for ctypes; never written
        try:
            base = ctypes.c_char.from_buffer(m)
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec)
            del base
            if rc != 0:
                return None
            pages += n
            resident += n - bytes(vec).count(0)
        finally:
            m.close()
    return resident / pages if pages else 0.0


def evict(files: list[Path]) -> dict:
    """Drop the files from the page cache: ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root), else
    ``posix_fadvise(DONTNEED)`` on each file. Says which worked and how much stayed resident (mincore)."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        how, note = "drop_caches", None
    except OSError as e:
        note = f"drop_caches failed: {e.strerror or e}"
        how = None
        if hasattr(os, "posix_fadvise"):
            try:
                for path in files:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fdatasync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
                how = "posix_fadvise(DONTNEED)"
            except OSError as e2:
                note += f"; posix_fadvise failed: {e2.strerror or e2}"
    left = resident_fraction(files)
    # a cold run is one whose files are (almost) out of the page cache, as mincore tells
    ok = how is not None and (left is None and how == "drop_caches" or left is not None and left <= 0.01)
    if how is not None and not ok:
        note = (note + "; " if note else "") + f"{how} left {100 * (left or 0):.1f}% of the pages resident"
    return {"cold": ok, "how": how, "resident_after": left, "note": note}


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30, runs: int = 5) -> float | None:
    """Pinned host -> device copy rate of the machine (the link limit), bytes/s; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(samples)


def bench_io(out: Path, device: str = "cuda", runs: int = 3, cold_runs: int = 1, threads: int | None = None,
             buffer_mb: float | None = None, sweep: list[tuple[int, float]] = ()) -> dict:
    """Warm and cold GB/s of ``load`` (threaded reader) vs safetensors, mmap + copy and a plain read.
    ``sweep``: more (threads, buffer_mb) settings of the threaded reader, timed warm beside the rest."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    dev = torch.device(device)
    checked = read_checked(out)
    files = _shard_files(checked)
    file_bytes = sum(p.stat().st_size for p in files)
    names = [n for e in checked.layers for n in [i.name for i in e.tensors.values()] + e.router + e.shared]
    load_bytes = sum(checked.tensors[n].nbytes for n in dict.fromkeys(names))

    def ours(reader="threaded", threads=threads, buffer_mb=buffer_mb):
        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", KernelFallbackWarning)
                return load(out, device=dev, reader=reader, threads=threads, buffer_mb=buffer_mb, progress=False)
        return run

    def st_load_file():
        return [load_file(str(p), device=str(dev)) for p in files]

    def st_mmap_copy():
        held = []
        for p in files:
            with safe_open(str(p), framework="pt") as f:  # mapped on the host, then one copy each
                held += [f.get_tensor(k).to(dev) for k in f.keys()]
        return held

    warm = {"ours": (ours(), load_bytes),
            "ours_" + ("pinned" if dev.type == "cuda" else "direct"): (ours("pinned" if dev.type == "cuda" else "direct"),
                                                                    load_bytes),
            "safetensors_load_file": (st_load_file, file_bytes),
            "safetensors_mmap_to_device": (st_mmap_copy, file_bytes),
            "sequential_read": (lambda: sequential_read(files), file_bytes)}
    for t, mb in sweep:
        warm[f"ours_threads{t}_buffer{mb:g}mb"] = (ours("threaded", t, mb), load_bytes)
    seconds: dict[str, list[float]] = {k: [] for k in warm}
    for i in range(runs + 1):  # run 0 warms up (page cache, pinned buffers, CUDA context)
        for k, (fn, _) in warm.items():
            dt = _timed(fn, dev)
            if i:
                seconds[k].append(dt)
    cold: dict[str, list[float]] = {"ours": [], "sequential_read": []}
    cold_info = None
    for _ in range(cold_runs):
        for k, fn in (("sequential_read", lambda: sequential_read(files)), ("ours", ours())):
            cold_info = evict(files)
            if not cold_info["cold"]:
                break
            cold[k].append(_timed(fn, dev))
        if cold_info is not None and not cold_info["cold"]:
            cold = {}
            break
    link = h2d_bandwidth(dev)

    rate = {k: warm[k][1] / statistics.median(v) for k, v in seconds.items()}
    cold_rate = {k: (load_bytes if k == "ours" else file_bytes) / statistics.median(v) for k, v in cold.items() if v}
    result = {
        "output": str(out), "device": str(dev), "runs": runs, "cold_runs": cold_runs, "files": len(files),
        "file_bytes": file_bytes, "load_bytes": load_bytes,
        "threads": threads, "buffer_mb": buffer_mb,
        "threads_used": threads or default_threads(), "buffer_mb_used": buffer_mb or default_buffer_mb(),
        "cpus": os.cpu_count(),
        "warm_seconds": {k: [round(x, 6) for x in v] for k, v in seconds.items()},
        "warm_bytes_per_s": rate,
        "cold_seconds": {k: [round(x, 6) for x in v] for k, v in cold.items()},
        "cold_bytes_per_s": cold_rate,
        "cold": cold_info,
        "h2d_bytes_per_s": link,
        "ratios": {
            "ours_warm_vs_safetensors_load_file": rate["ours"] / rate["safetensors_load_file"],
            "ours_warm_vs_safetensors_mmap_to_device": rate["ours"] / rate["safetensors_mmap_to_device"],
            "ours_warm_vs_sequential_read_warm": rate["ours"] / rate["sequential_read"],
        },
    }
    if link:
        result["ratios"]["ours_warm_vs_h2d"] = rate["ours"] / link
    if cold_rate:
        result["ratios"]["ours_cold_vs_sequential_read_cold"] = cold_rate["ours"] / cold_rate["sequential_read"]
    return result


# ------------------------------------------------------------------------------------------------
# bench make-folder: a large converted folder, quickly, through the real repack code path
# ------------------------------------------------------------------------------------------------

def _qwen3_config(hidden: int, intermediate: int, experts: int, layers: int, vocab: int) -> dict:
    """The config.json ``make_example`` writes for qwen3-moe, at Qwen3-30B-A3B's expert sizes."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "decoder_sparse_step": 1, "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu",
        "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": 3 * hidden,
        "max_position_embeddings": 32768, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": intermediate, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": experts, "num_experts_per_tok": min(8, experts), "num_hidden_layers": layers,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "vocab_size": vocab,
    }


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pool: memoryview, rng) -> int:
    """A bf16 safetensors file whose tensors are slices of ``pool`` at random offsets; returns its size."""
    import json
    import struct

    header, at = {}, 0
    for name, shape in tensors:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape in tensors:
            n = 2 * math.prod(shape)
            while n:
                a = 2 * rng.randrange(0, len(pool) // 2 - 1)
                k = min(n, len(pool) - a)
                f.write(pool[a:a + k])
                n -= k
    return 8 + len(head) + at


def make_folder(out: Path, gb: float = 6.0, *, hidden: int = 2048, intermediate: int = 768, experts: int = 128,
                seed: int = 0, overwrite: bool = False, max_shard_size: int = 5 * 10**9, progress=None) -> dict:
    """A synthetic Qwen3-MoE bf16 checkpoint of about ``gb`` GB of experts (one shard per decoder
    layer, random bf16 values), converted with ``repack --backend plain``'s own code; the source
    is written next to ``out`` and removed after. Returns the repack manifest summary."""
    import json
    import random
    import shutil

    from moeconvert.canonical import Partition
    from moeconvert.convert import plan_conversion, run_conversion
    from moeconvert.sources import INDEX_NAME, open_source
    from moeconvert.writer import check_output_target

    out = Path(out)
    per_expert = 3 * hidden * intermediate * 2
    target = gb * _GB
    if target >= experts * per_expert:
        layers = max(1, round(target / (experts * per_expert)))
    else:  # a small folder: one layer of fewer experts
        layers, experts = 1, max(8, round(target / per_expert))
    vocab, heads, kv, head_dim = 4096, 32, 4, 128
    src = out.parent / f".{out.name}.make-folder-source-{os.getpid()}"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pool = memoryview((torch.randn(16 << 20, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy())
    try:
        weight_map, total = {}, 0
        files = [f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors" for i in range(layers + 1)]
        for li in range(layers):
            p = f"model.layers.{li}"
            ts = [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,)),
                  (f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
                  (f"{p}.self_attn.k_proj.weight", (kv * head_dim, hidden)),
                  (f"{p}.self_attn.v_proj.weight", (kv * head_dim, hidden)),
                  (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
                  (f"{p}.self_attn.q_norm.weight", (head_dim,)), (f"{p}.self_attn.k_norm.weight", (head_dim,)),
                  (f"{p}.mlp.gate.weight", (experts, hidden))]
            for e in range(experts):
                ts += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (intermediate, hidden)),
                       (f"{p}.mlp.experts.{e}.up_proj.weight", (intermediate, hidden)),
                       (f"{p}.mlp.experts.{e}.down_proj.weight", (hidden, intermediate))]
            total += _write_safetensors(src / files[li], ts, pool, rng)
            weight_map.update({n: files[li] for n, _ in ts})
        ts = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden)),
              ("model.norm.weight", (hidden,))]
        total += _write_safetensors(src / files[-1], ts, pool, rng)
        weight_map.update({n: files[-1] for n, _ in ts})
        (src / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
        (src / "config.json").write_text(json.dumps(_qwen3_config(hidden, intermediate, experts, layers, vocab),
                                                    indent=2))
        source = open_source(str(src))
        check_output_target(out, source.root, overwrite)
        plan = plan_conversion(source, "plain", Partition(), max_shard_size)
        manifest = run_conversion(plan, out, overwrite=overwrite, progress=progress).manifest
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return {"output": str(out), "layers": layers, "experts": experts, "hidden_size": hidden,
            "intermediate_size": intermediate, "bytes": sum(s["size"] for s in manifest["shards"]),
            "shards": len(manifest["shards"])}
