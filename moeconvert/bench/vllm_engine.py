"""``moeconvert bench vllm-serve SRC OUT``: vLLM's whole engine started on the source and on the converted
folder, each in a fresh process, alternating: start-up, the part of it spent loading and processing the
weights, peak memory, the greedy tokens, and (``--throughput``) prefill and decode speed, with ``--profile``
also where the GPU's time went in one more round of each (:func:`kernel_table`).

Each run is ``python -m moeconvert.bench.vllm_engine FOLDER ...``: ``vllm.LLM(FOLDER)`` in one process (no
engine subprocess, so this process sees vLLM's own log records and the device's allocator), eager mode, the
same MoE backend for both (the folder's: Marlin, humming or Triton), then a few fixed prompts greedily.
The source's start-up includes vLLM's own repack (or online quantization) of every MoE layer; the
folder's only the plugin's loading. Everything else (building the model, profiling memory, the KV cache)
is the same work for both.

What is read from vLLM's log records (``vllm/v1/worker/gpu_model_runner.py`` or ``gpu/model_runner.py``,
``model_executor/model_loader/base_loader.py`` and ``default_loader.py``, caught on those modules' loggers): "Initializing model took",
"Loading weights took" and "Model loading took ... GiB memory and ... seconds". The last one is logged
right after ``process_weights_after_loading``: at that moment the run also reads the most the device's
allocator held since the engine started (reading and processing the weights, the second copy included) and
the process's peak resident memory. The allocator's own peak cannot give the first: vLLM's model-loading
profiler resets it as it ends (``DeviceMemoryProfiler`` -> ``get_current_memory_usage``), just before that
record, so it would read what the model holds, not its peak. The run records the allocator's history
instead (``torch.cuda.memory._record_memory_history``, no stack traces) from before the engine starts to
that record, and takes the peak of its allocations and frees (:func:`trace_peak`). Memory taken outside
PyTorch's allocator (raw driver allocations) is in neither figure.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_GiB = 1 << 30
# the modules whose loggers write the load-time records, in vLLM 0.33.0 and 0.34.0
_RECORD_LOGGERS = (
    "vllm.model_executor.model_loader.base_loader",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.model_loader.sharded_state_loader",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.cpu.standalone_model_runner",
    "moeconvert.integrations.vllm.loader",  # the folder's loader: its own "Loading weights took"
)
# the allocator's history kept while the engine loads: far more events than a model's load makes (a full
# buffer means the oldest were dropped, and no peak is reported)
_TRACE_ENTRIES = 20_000_000
# the prompts of the token check: short, fixed, within any model's vocabulary
_PROMPT_LENGTHS = (5, 8, 11, 14)


class _LoadRecords(logging.Filter):
    """vLLM's load-time log records, and the peaks at the moment the model finished loading.

    A filter on the loggers of the modules that write the records (it lets every record through), not a
    handler: starting the engine runs dictConfig on the "vllm" logger (vllm/logger.py, from
    LLMEngine.__init__), which clears the handlers of "vllm" and of every logger below it, but leaves their
    filters alone."""

    _PATTERNS = {
        "init_model_s": re.compile(r"Initializing model took ([0-9.]+) seconds"),
        "load_weights_s": re.compile(r"Loading weights took ([0-9.]+) seconds"),
        "model_load_s": re.compile(r"Model loading took [0-9.]+ GiB memory and ([0-9.]+) seconds"),
        "model_gib": re.compile(r"Model loading took ([0-9.]+) GiB memory"),
    }

    def __init__(self):
        super().__init__()
        self.values: dict[str, float | None] = {}
        self.start_bytes = 0

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is not one of ours
            return True
        for key, pattern in self._PATTERNS.items():
            m = pattern.search(text)
            if m and key not in self.values:
                self.values[key] = float(m.group(1))
                if key == "model_load_s":
                    self._peaks()
        return True

    def listen(self) -> list[logging.Logger]:
        loggers = [logging.getLogger(name) for name in _RECORD_LOGGERS]
        for logger in loggers:
            logger.addFilter(self)
            if logger.getEffectiveLevel() > logging.INFO:  # ours has no level of its own: INFO must pass
                logger.setLevel(logging.INFO)
        return loggers

    def stop(self, loggers: list[logging.Logger]) -> None:
        for logger in loggers:
            logger.removeFilter(self)
        import torch

        if torch.cuda.is_available():  # already off once the record came; off in any case
            torch.cuda.memory._record_memory_history(enabled=None)

    def _peaks(self) -> None:
        import torch

        if torch.cuda.is_available():
            events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            torch.cuda.memory._record_memory_history(enabled=None)
            peak = trace_peak(events, self.start_bytes) if len(events) < _TRACE_ENTRIES else None
            self.values["load_peak_gpu_gib"] = None if peak is None else peak / _GiB
        self.values["load_peak_host_gib"] = _max_rss_gib()

    def record_allocations(self) -> None:
        """Start recording the device allocator's history (before the engine starts)."""
        import torch

        if torch.cuda.is_available():
            self.start_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=_TRACE_ENTRIES)


def trace_peak(events: list[dict], start_bytes: int = 0) -> int:
    """The most the allocator held over its recorded history: ``start_bytes`` (held when recording began),
    plus each allocation, less each free once completed (a block freed on one stream while another may
    still use it stays held until then)."""
    held = peak = start_bytes
    for e in events:
        if e["action"] == "alloc":
            held += e["size"]
            peak = max(peak, held)
        elif e["action"] == "free_completed":
            held -= e["size"]
    return peak


def _max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GiB  # ru_maxrss is in KiB on Linux


def model_len(cfg: dict, wanted: int) -> int:
    """The engine's ``max_model_len``: ``wanted``, or less where the model's own
    ``max_position_embeddings`` is shorter (vLLM refuses a longer one at start-up)."""
    limit = (cfg.get("text_config") or cfg).get("max_position_embeddings")
    return min(wanted, limit) if isinstance(limit, int) and limit > 0 else wanted


def engine_run(folder: Path, *, moe_backend: str = "marlin", quantization: str | None = None,
               attention_backend: str = "TRITON_ATTN", max_tokens: int = 8, max_model_len: int = 256,
               load_format: str = "auto", throughput: dict | None = None,
               gpu_memory_utilization: float = 0.5) -> dict:
    """Start ``vllm.LLM`` on ``folder`` in this process and generate; what the bench and tests compare.

    ``throughput``: ``{"prefill_len", "prefill_batch", "decode_batch", "decode_tokens"}`` to also time
    prefill (prompts of ``prefill_len`` tokens, one output token each) and decode (``decode_batch`` short
    prompts, ``decode_tokens`` tokens each, minus the same prompts' one-token run), each the second of two
    rounds (the first takes the one-time costs); with ``"profile": True`` a third round of each runs under
    torch's profiler (``prefill_kernels``, ``decode_kernels``: :func:`kernel_table`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    cfg = json.loads((folder / "config.json").read_text())
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    max_model_len = model_len(cfg, max_model_len)
    if max_model_len < max(_PROMPT_LENGTHS) + max_tokens:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for the {max(_PROMPT_LENGTHS)}-token "
                         f"prompts and {max_tokens} tokens")
    if load_format == "moeconvert" or (cfg.get("quantization_config") or {}).get("quant_method") == "moeconvert":
        # said here in one line, not as vLLM's "Load format `moeconvert` is not supported" further on
        from vllm.plugins import load_general_plugins

        from moeconvert.integrations.vllm import registration_problem

        load_general_plugins()
        if (problem := registration_problem()) is not None:
            raise RuntimeError(problem)
    records = _LoadRecords()
    loggers = records.listen()
    records.record_allocations()
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype=(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), enforce_eager=True,
              max_model_len=max_model_len, seed=0, gpu_memory_utilization=gpu_memory_utilization,
              skip_tokenizer_init=True, attention_backend=attention_backend, moe_backend=moe_backend,
              compilation_config={"mode": 0}, quantization=quantization, load_format=load_format)
    init_s = time.perf_counter() - t0
    records.stop(loggers)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j + 1) % vocab for j in range(n)]}
               for i, n in enumerate(_PROMPT_LENGTHS)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, detokenize=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    out = {"folder": str(folder), "init_s": init_s, "load_format": load_format, "max_model_len": max_model_len,
           "quantization": llm.llm_engine.vllm_config.model_config.quantization,
           "tokens": [list(o.outputs[0].token_ids) for o in got],
           "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in got],
           **records.values}
    if {"model_load_s", "load_weights_s", "init_model_s"} <= records.values.keys():
        # what is left of "Model loading took" once the model is built and its weights are read: vLLM's
        # process_weights_after_loading (and for the source the repack it does there)
        out["process_s"] = max(0.0, records.values["model_load_s"] - records.values["load_weights_s"]
                               - records.values["init_model_s"])
    if throughput:
        out.update(_throughput(llm, SamplingParams, vocab, max_model_len, **throughput))
    out["peak_host_gib"] = _max_rss_gib()
    return out


def _throughput(llm, SamplingParams, vocab: int, max_model_len: int, *, prefill_len: int, prefill_batch: int,
                decode_batch: int, decode_tokens: int, profile: bool = False) -> dict:
    prefill_len = min(prefill_len, max_model_len - 1)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [(31 * i + 17 * j + 3) % vocab for j in range(length)]} for i in range(n)]

    def timed(ps: list[dict], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False)
        return time.perf_counter() - t

    long, short = prompts(prefill_batch, prefill_len), prompts(decode_batch, 16)
    decode_tokens = min(decode_tokens, max_model_len - 16)
    rounds = []
    for _ in range(2):  # the first round takes the one-time costs (kernel compiles, allocator blocks)
        prefill = timed(long, 1)
        one = timed(short, 1)
        full = timed(short, decode_tokens)
        rounds.append((prefill, full - one))
    prefill, decode = rounds[-1]
    out = {"prefill_tok_s": prefill_batch * prefill_len / prefill, "prefill_len": prefill_len,
           "prefill_batch": prefill_batch, "decode_tok_s": decode_batch * (decode_tokens - 1) / decode,
           "decode_batch": decode_batch, "decode_tokens": decode_tokens}
    if profile:  # a third round, under the profiler (not the timed ones: the profiler slows the host)
        for key, step in (("prefill_kernels", lambda: timed(long, 1)),
                          ("decode_kernels", lambda: timed(short, decode_tokens))):
            try:
                out[key] = _profiled(step)
            except Exception as e:  # noqa: BLE001 - the profile is an extra: the run's figures stand without it
                out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _profiled(step) -> dict:
    """``step()`` under torch's profiler: its wall time and what the GPU ran (:func:`kernel_table`)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        wall = step()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return kernel_table(kernels, wall)


def kernel_table(kernels: list[tuple[str, float]], wall_s: float, top: int = 15) -> dict:
    """What the GPU ran in ``wall_s`` seconds, from ``(name, µs)`` per kernel launch: the time it was busy
    (the kernels' sum: the GPU runs one stream here), the launches, and the ``top`` kernels by time, each
    with its launches and share of the busy time. Busy far below wall: the host is the limit (launch
    overhead, synchronisation); near it: the kernels are."""
    by: dict[str, list] = {}
    for name, us in kernels:
        k = by.setdefault(name, [0, 0.0])
        k[0] += 1
        k[1] += us
    busy = sum(us for _, us in kernels)
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return {"wall_ms": round(1e3 * wall_s, 3), "gpu_busy_ms": round(busy / 1e3, 3), "launches": len(kernels),
            "top": [{"kernel": name[:120], "launches": n, "ms": round(us / 1e3, 3),
                     "share": round(us / busy, 4) if busy else 0.0} for name, (n, us) in rows]}


def _child(folder: Path, moe_backend: str, quantization: str | None, timeout: float, **options) -> dict:
    p = subprocess.run([sys.executable, "-m", "moeconvert.bench.vllm_engine", str(folder), moe_backend,
                        quantization or "-", json.dumps(options)],
                       capture_output=True, text=True, timeout=timeout)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"vLLM on {folder} failed (exit {p.returncode}): {tail}")
    r = json.loads(lines[-1])
    if "error" in r:
        raise ValueError(f"vLLM on {folder}: {r['error']}")
    return r


def bench_vllm_serve(src: Path | str, out_dir: Path, *, runs: int = 2, moe_backend: str | None = None,
                     timeout: float = 900, progress=None, max_model_len: int = 256, load_format: str = "moeconvert",
                     throughput: dict | None = None, gpu_memory_utilization: float = 0.5) -> dict:
    """``runs`` start-ups of each, alternating; ``load_format`` is the folder's (the source always loads
    with vLLM's default loader). The medians of each figure, and each run's figures (``source_runs``,
    ``folder_runs``); ``same_tokens`` and ``max_logprob_diff`` compare every run with the source's first."""
    from moeconvert.sources import open_source

    src = open_source(str(src)).root  # a folder, or a Hub repo id (its snapshot in the Hub cache)
    manifest = json.loads((out_dir / "moeconvert.json").read_text())
    if moe_backend is None:  # the backend the folder's layout is for: marlin | humming | triton
        moe_backend = manifest["layout"]["name"]
    # a bf16 source converted to MXFP4 is served by vLLM with its online MXFP4: `--quantization mxfp4`
    unquantized = not json.loads((src / "config.json").read_text()).get("quantization_config")
    src_quant = "mxfp4" if unquantized and (manifest["scheme"] or {}).get("kind") == "mxfp4" else None
    common = {"max_model_len": max_model_len, "throughput": throughput,
              "gpu_memory_utilization": gpu_memory_utilization}
    src_runs, out_runs = [], []
    for _ in range(runs):  # alternating, so drift on the machine hits both alike
        src_runs.append(_child(src, moe_backend, src_quant, timeout, load_format="auto", **common))
        out_runs.append(_child(out_dir, moe_backend, None, timeout, load_format=load_format, **common))
        if progress:
            progress(1)
    a, b = src_runs[-1], out_runs[-1]
    # every run of either against the source's first: the tokens, and the logprobs' largest difference
    first = src_runs[0]
    worst = max((abs(x - y) for r in src_runs[1:] + out_runs
                 for p, q in zip(first["logprobs"], r["logprobs"]) for x, y in zip(p, q)), default=0.0)

    def med(rs: list[dict], key: str) -> float | None:
        values = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(values) if values else None

    keys = ("init_s", "model_load_s", "load_weights_s", "process_s", "load_peak_gpu_gib", "load_peak_host_gib",
            "model_gib", "peak_host_gib", "prefill_tok_s", "decode_tok_s")
    return {"source": str(src), "folder": str(out_dir), "runs": runs, "moe_backend": moe_backend,
            "folder_load_format": load_format, "max_model_len": a["max_model_len"],
            "source_quantization": a["quantization"], "folder_quantization": b["quantization"],
            "source_init_s": [r["init_s"] for r in src_runs], "folder_init_s": [r["init_s"] for r in out_runs],
            "median_source_init_s": med(src_runs, "init_s"), "median_folder_init_s": med(out_runs, "init_s"),
            "source_medians": {k: med(src_runs, k) for k in keys},
            "folder_medians": {k: med(out_runs, k) for k in keys},
            "source_runs": [{k: r.get(k) for k in keys} for r in src_runs],
            "folder_runs": [{k: r.get(k) for k in keys} for r in out_runs],
            "throughput": {k: a.get(k) for k in ("prefill_len", "prefill_batch", "decode_batch", "decode_tokens")}
            if throughput else None,
            # the profiled round of the last run of each (--profile)
            "kernels": {who: {k: r[-1][k] for k in ("prefill_kernels", "decode_kernels") if k in r[-1]}
                        for who, r in (("source", src_runs), ("folder", out_runs))}
            if throughput and throughput.get("profile") else None,
            "same_tokens": all(r["tokens"] == first["tokens"] for r in src_runs + out_runs),
            "max_logprob_diff": worst}


def main() -> None:
    """``python -m moeconvert.bench.vllm_engine FOLDER [BACKEND [QUANTIZATION|- [OPTIONS_JSON]]]``: one run,
    its result as one JSON line on stdout."""
    folder, backend = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "marlin"
    quantization = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    try:
        r = engine_run(folder, moe_backend=backend, quantization=quantization, **options)
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        import traceback

        r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    print(json.dumps(r))
    sys.stdout.flush()
    os._exit(0)  # the engine's threads would keep the process alive


if __name__ == "__main__":
    main()
