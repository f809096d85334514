"""``moeconvert repack`` and ``moeconvert quantize``: one conversion, ``_convert``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.markup import escape
from rich.table import Table

from moeconvert.cli.app import app
from moeconvert.cli.options import (EP_RANK, EP_SIZE, JSON, REVISION, TP_RANK, TP_SIZE, TP_SIZES, _human,
                                    _partition, _print_quality, _progress, err, out, parse_size, parse_tp_sizes)

WORKERS = typer.Option("auto", "--workers", help="auto or 0 (best on one machine): jobs on threads of this process, "
                       "one per core (fewer if the memory is short). N: N worker processes, at most one per core and "
                       "as many as the memory holds at the plan's peak; they start slower than threads and were "
                       "slower in every case measured on small models (docs/scale-out.md). With --executor ray: at "
                       "most N tasks at a time.")
EXECUTOR = typer.Option("local", "--executor", help="local (this machine) | ray (Ray tasks; pip install 'moeconvert[ray]').")
RAY_ADDRESS = typer.Option(None, "--ray-address", help="Ray cluster to run on (e.g. 10.0.0.1:6379; default: "
                           "RAY_ADDRESS, else a local Ray). Source and output must be on storage every node sees.")
ESTIMATE = typer.Option(True, "--estimate/--no-estimate", help="With --dry-run: measure this machine on one expert "
                        "and estimate the time for 1, 8 and 64 workers (--no-estimate: the plan alone).")
RESUME = typer.Option(False, "--resume", help="Take over what a killed run of the same command finished (checked "
                      "against its checksums) and do only the rest.")
from moeconvert.errors import MoeConvertError


def _backend_names(kinds: tuple[str, ...] | None = None) -> list[str]:
    """The ``--backend`` words with a layout for one of ``kinds`` (all of them without kinds)."""
    from moeconvert.layouts import layout_kinds, layout_names

    return [n for n in layout_names() if kinds is None or set(kinds) & set(layout_kinds(n))]


class _BackendHelp(typer.core.TyperCommand):
    """A verb whose ``--backend`` help lists the registered layouts it can write.

    Read from the registry when the help is shown, not when the app is built: the layout modules import
    torch, which ``moeconvert --help`` and every other verb should not wait for.
    """

    kinds: tuple[str, ...] | None = None

    def format_help(self, ctx, formatter):
        names = _backend_names(self.kinds)
        for param in self.params:
            if param.name == "backend":
                param.help = (f"Layout to write: {' | '.join(names)} "
                              "(`moeconvert inspect SRC` says which can take SRC, and why not).")
        return super().format_help(ctx, formatter)


class _QuantizeBackendHelp(_BackendHelp):
    def format_help(self, ctx, formatter):
        from moeconvert.quantize import FORMATS  # each format is also the scheme kind of its layouts

        self.kinds = FORMATS
        return super().format_help(ctx, formatter)


@app.command(cls=_BackendHelp)
def repack(
    src: str = typer.Argument(..., help="Checkpoint folder or Hugging Face repo id."),
    out_dir: Path = typer.Argument(..., help="Output folder (must not exist or be empty, unless --overwrite)."),
    backend: str = typer.Option(..., "--backend", "-b", help="Layout to write (see `moeconvert inspect`)."),
    revision: Optional[str] = REVISION,
    tp_size: int = TP_SIZE,
    tp_rank: int = TP_RANK,
    ep_size: int = EP_SIZE,
    ep_rank: int = EP_RANK,
    tp_sizes: Optional[str] = TP_SIZES,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard, e.g. 5GB, 500MB."),
    chunk_mb: int = typer.Option(256, "--chunk-mb", min=1, help="Working-memory budget per expert chunk (MB)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (layers, jobs, bytes, memory, estimated time); write nothing."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder (only once the new one is complete)."),
    workers: str = WORKERS,
    executor: str = EXECUTOR,
    ray_address: Optional[str] = RAY_ADDRESS,
    resume: bool = RESUME,
    estimate: bool = ESTIMATE,
    verify: bool = typer.Option(False, "--verify", help="Run `moeconvert verify --against SRC` on the result."),
    json_out: bool = JSON,
):
    """Relay a checkpoint's experts out for a backend, without changing their values."""
    _convert(src, out_dir, backend, revision, _partition(tp_size, tp_rank, ep_size, ep_rank), max_shard_size,
             chunk_mb, dry_run, overwrite, verify, json_out, run=(workers, executor, ray_address, resume, estimate),
             tp_sizes=parse_tp_sizes(tp_sizes))


@app.command(cls=_QuantizeBackendHelp)
def quantize(
    src: str = typer.Argument(..., help="Checkpoint folder or Hugging Face repo id (float, FP8-block, GPTQ, AWQ or "
                                        "int experts; MXFP4 relaid out)."),
    out_dir: Path = typer.Argument(..., help="Output folder (must not exist or be empty, unless --overwrite)."),
    fmt: str = typer.Option("mxfp4", "--format", help="Quantized format: mxfp4 (e2m1 values, e8m0 scale per 32 along K)."),
    backend: str = typer.Option(..., "--backend", "-b", help="Layout to write (see `moeconvert inspect`)."),
    rounding: str = typer.Option("vllm", "--rounding", help="vllm (bit-exact with vLLM 0.33.0's online MXFP4) | ocp (OCP MX v1.0) | triton_kernels."),
    device: str = typer.Option("cpu", "--device", help="Where to quantize: cpu or cuda (identical bytes)."),
    dtype: str = typer.Option("auto", "--dtype", help="Model dtype the engine runs (auto: the checkpoint's; fp32 -> bfloat16)."),
    revision: Optional[str] = REVISION,
    tp_size: int = TP_SIZE,
    tp_rank: int = TP_RANK,
    ep_size: int = EP_SIZE,
    ep_rank: int = EP_RANK,
    tp_sizes: Optional[str] = TP_SIZES,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard, e.g. 5GB, 500MB."),
    chunk_mb: int = typer.Option(256, "--chunk-mb", min=1, help="Working-memory budget per expert chunk (MB)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (layers, jobs, bytes, memory, estimated time); write nothing."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder (only once the new one is complete)."),
    workers: str = WORKERS,
    executor: str = EXECUTOR,
    ray_address: Optional[str] = RAY_ADDRESS,
    resume: bool = RESUME,
    estimate: bool = ESTIMATE,
    verify: bool = typer.Option(False, "--verify", help="Run `moeconvert verify --against SRC` on the result (re-quantizes)."),
    json_out: bool = JSON,
):
    """Quantize a checkpoint's experts (vLLM's online MXFP4, ahead of time) into a backend layout."""
    from moeconvert.quantize import Quantization

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise MoeConvertError("unknown device", tensor="--device", expected="cpu | cuda | cuda:N", found=device)
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise MoeConvertError("--device cuda asked for, but torch sees no CUDA device", tensor="--device",
                                  expected="a CUDA device", found="none")
    quant = Quantization(fmt, rounding, device)
    _convert(src, out_dir, backend, revision, _partition(tp_size, tp_rank, ep_size, ep_rank), max_shard_size,
             chunk_mb, dry_run, overwrite, verify, json_out, quant=quant, dtype=dtype,
             run=(workers, executor, ray_address, resume, estimate), tp_sizes=parse_tp_sizes(tp_sizes))


def _executor(workers: str, executor: str, ray_address, plan_jobs, peak_per_job: int):
    """The executor the options ask for. ``auto``: threads of this process, one per core, fewer when
    the memory would not hold that many jobs at once."""
    from moeconvert.executors import InProcess, LocalProcesses, RayExecutor, available_cores

    if executor not in ("local", "ray"):
        raise MoeConvertError("unknown executor", tensor="--executor", expected="local | ray", found=executor)
    if ray_address is not None and executor != "ray":
        raise MoeConvertError("--ray-address needs --executor ray", tensor="--ray-address", found=ray_address)
    n = None
    if workers != "auto":
        try:
            n = int(workers)
        except ValueError:
            n = -1
        if n < 0:
            raise MoeConvertError("not a number of workers", tensor="--workers", expected="auto, 0 or a positive integer",
                                  found=workers)
    if executor == "ray":
        return RayExecutor(ray_address, workers=n or None)
    if n is None or n == 0:
        return InProcess(auto_threads(len(plan_jobs), peak_per_job, available_cores(), _available_memory()))
    used, why = cap_workers(n, len(plan_jobs), peak_per_job, available_cores(), _available_memory())
    if used < n:
        err.print(f"--workers {n}: using {used} worker process(es) ({why})", soft_wrap=True)
    return LocalProcesses(used)


def cap_workers(asked: int, jobs: int, peak_per_job: int, cores: int,
                available_memory: int | None) -> tuple[int, str]:
    """Worker processes for ``--workers N``: no more than the cores (each job keeps one busy), the jobs,
    and what the available memory holds with each process's own memory beside its job's peak (a
    quarter of the memory left to everything else). Returns the count and, when it is below ``asked``,
    what capped it."""
    from moeconvert.estimate import PROCESS_BYTES

    limits = [(asked, ""), (max(1, cores), f"{cores} core(s)"), (max(1, jobs), f"{jobs} job(s)")]
    if available_memory:
        each = peak_per_job + PROCESS_BYTES
        fits = max(1, int(available_memory * 0.75) // each)
        limits.append((fits, f"the available memory holds {fits} at {_human(each)} each"))
    n, why = min(limits, key=lambda x: x[0])
    return n, why


def auto_threads(jobs: int, peak_per_job: int, cores: int, available_memory: int | None) -> int:
    """Jobs at a time in this process: one per core, no more than there are jobs, and no more than the
    available memory holds at the plan's peak per job (with a quarter of it left to everything else)."""
    n = max(1, min(cores, jobs))
    if available_memory and peak_per_job:
        n = min(n, max(1, int(available_memory * 0.75) // peak_per_job))
    return n


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _convert(src, out_dir, backend, revision, part, max_shard_size, chunk_mb, dry_run, overwrite, verify, json_out,
             quant=None, dtype=None, run=("auto", "local", None, False, True), tp_sizes=()):
    from pathlib import Path as _Path

    from moeconvert.convert import plan_conversion, run_conversion, vllm_refusal
    from moeconvert.jobs import Request, plan_jobs
    from moeconvert.layouts import layout_names
    from moeconvert.modelmap import map_model
    from moeconvert.sources import open_source
    from moeconvert.writer import check_output_target

    workers, executor_name, ray_address, resume, with_estimate = run
    choices = _backend_names(None if quant is None else (quant.format,))
    if backend not in choices:
        raise MoeConvertError("unknown backend layout" if backend not in layout_names() else
                              f"backend has no {quant.format} layout", tensor="--backend",
                              expected=" | ".join(choices), found=backend)
    shard_limit = parse_size(max_shard_size)
    source = open_source(src, revision)
    if not dry_run:
        check_output_target(out_dir, source.root, overwrite, resume=resume)
    model = map_model(source)
    if quant is not None:
        from moeconvert.quantize import resolve_model_dtype

        dtype = resolve_model_dtype(model.dtype, dtype)
    plan = plan_conversion(source, backend, part, shard_limit, model=model, quant=quant, dtype=dtype, tp_sizes=tp_sizes)
    local = _Path(src).expanduser()
    request = Request(src, backend, src_path=str(local.resolve()) if source.revision is None else None,
                      revision=source.revision, partition=part, max_shard_size=shard_limit, quant=quant, dtype=dtype,
                      chunk_bytes=chunk_mb << 20, tp_sizes=tp_sizes)
    jobs = plan_jobs(plan, request.chunk_bytes, request.job_bytes)
    peak = max((j.peak_bytes for j in jobs), default=0)
    executor = _executor(workers, executor_name, ray_address, jobs, peak)
    warnings = plan.warnings()
    refused = vllm_refusal(plan)
    if refused is not None:  # the folder keeps the source's config.json (convert.served_config)
        warnings.append(f"config.json: copied as it is, since moeconvert's vLLM plugin does not serve this folder: "
                        f"{refused}")
    for w in warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(w)}", soft_wrap=True)  # one line each, even in a log
    layout = plan.layout
    summary = {"source": src, "output": str(out_dir), "backend": layout.name, "layout_version": layout.version,
               "partition": part.to_json(), "moe_layers": len(plan.layers), "tensors": len(plan.tensors),
               "bytes": plan.total_bytes,
               "shards": [{"file": s.filename, "tensors": len(s.tensors), "bytes": s.size} for s in plan.shards],
               "layers": [{"prefix": lp.map.prefix, "num_experts": lp.shape.num_experts,
                           "intermediate_size": lp.shape.intermediate_size,
                           "tensors": {s.suffix: {"shape": list(s.shape), "dtype": str(s.dtype).replace("torch.", "")}
                                       for s in lp.specs}} for lp in plan.layers],
               "warnings": warnings, "dry_run": dry_run, "executor": executor.describe()}
    if dry_run:
        from moeconvert.estimate import estimate

        est = estimate(plan, jobs, workers=_worker_counts(executor)) if with_estimate else None
        summary["jobs"] = [j.to_json() for j in jobs]
        summary["estimate"] = est
        if json_out:
            print(json.dumps(summary, indent=1))
            return
        out.print(f"plan: {src} -> {out_dir} as [cyan]{layout.name}[/cyan] v{layout.version}, "
                  f"{len(plan.layers)} MoE layers, {len(plan.tensors)} tensors, {_human(plan.total_bytes)} "
                  f"in {len(plan.shards)} shard(s)")
        t = Table()
        for col in ("layer", "E", "I", "tensors written"):
            t.add_column(col)
        for x in summary["layers"]:
            t.add_row(x["prefix"], str(x["num_experts"]), str(x["intermediate_size"]),
                      ", ".join(f"{k} {v['shape']} {v['dtype']}" for k, v in x["tensors"].items()))
        out.print(t)
        for s in summary["shards"]:
            out.print(f"  {s['file']}: {s['tensors']} tensors, {_human(s['bytes'])}")
        _print_jobs(jobs, est, executor.describe())
        return
    t0 = time.perf_counter()
    with _progress() as prog:
        # one quantity: source bytes read, by the layer and copy jobs and by hashing the source files for
        # the manifest (each file is read twice: the bar's total is twice the checkpoint's size)
        task = prog.add_task(f"{'quantize' if quant else 'repack'} → {layout.name} (source bytes read and hashed)",
                             total=sum(j.work_bytes for j in jobs))
        done = run_conversion(plan, out_dir, overwrite=overwrite, request=request, executor=executor, resume=resume,
                              progress=lambda n: prog.advance(task, n),
                              report=lambda line: err.print(escape(line), soft_wrap=True))
    dt = time.perf_counter() - t0
    summary["seconds"] = round(dt, 3)
    summary["jobs"] = {"total": done.jobs, "kept": done.kept, "ran": done.ran, "retried": done.retried}
    quality = {m["prefix"]: m["quality"] for m in done.manifest["moe_layers"] if "quality" in m}
    if quality:
        summary["quality"] = quality
        if not json_out:
            _print_quality(quality)
    if verify:
        from moeconvert.cli.verify import _print_verify  # here, not on top: `verify` registers after us
        from moeconvert.verify import verify_output

        report = verify_output(out_dir, against=src, revision=revision)
        summary["verify"] = report.to_json()
        if not report.ok:
            _print_verify(report)
            raise MoeConvertError("verify found differences in the new output (kept for inspection)", file=str(out_dir))
    if json_out:
        print(json.dumps(summary, indent=1))
    else:
        out.print(f"wrote {out_dir}: {len(plan.tensors)} tensors, {_human(plan.total_bytes)} in "
                  f"{len(plan.shards)} shard(s), {dt:.1f} s ({_human(plan.total_bytes / max(dt, 1e-9))}/s), "
                  f"{done.ran} job(s) on {executor.describe()}"
                  + (f", {done.kept} kept from the interrupted run" if done.kept else "")
                  + ("; verified: identical to the source" if verify else ""))


def _worker_counts(executor) -> list[int]:
    """The worker counts the dry-run estimates: this run's, and 1, 8 and 64 for scale."""
    from moeconvert.executors import available_cores

    mine = getattr(executor, "workers", None) or getattr(executor, "threads", None) or available_cores()
    return sorted({1, 8, 64, mine})


def _print_jobs(jobs, est, where: str) -> None:
    kinds: dict[str, list] = {}
    for j in jobs:
        kinds.setdefault(j.kind, []).append(j)
    out.print(f"jobs: {len(jobs)} ({', '.join(f'{len(v)} {k}' for k, v in kinds.items())}), run {where}")
    t = Table()
    for col in ("kind", "jobs", "read", "write", "largest job", "peak memory / job"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for k, v in kinds.items():
        big = max(v, key=lambda j: j.read_bytes + j.write_bytes)
        t.add_row(k, str(len(v)), _human(sum(j.read_bytes for j in v)), _human(sum(j.write_bytes for j in v)),
                  f"{big.what} ({_human(big.read_bytes)})", _human(max(j.peak_bytes for j in v)))
    out.print(t)
    if est is None:
        return
    rates = est["rates"]
    out.print("measured here: " + ", ".join(f"{k} {_human(v)}/s" for k, v in rates.items())
              + " per worker (compute only: the source's and output's storage can be slower)")
    if est.get("not_measured"):
        out.print(f"not measured (left out of the times below): {', '.join(est['not_measured'])} jobs "
                  "(one expert needs more working memory than a dry run spends measuring)")
    for row in est["by_workers"]:
        out.print(f"  {row['workers']:>3} worker(s): about {_duration(row['seconds'])}"
                  + (" (bounded by the largest job)" if row["bounded_by_largest_job"] else "")
                  + f"; peak memory {_human(row['peak_memory_bytes_per_worker'])} per worker")


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
