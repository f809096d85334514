"""The ``moeconvert`` command line: ``moeconvert <verb> ...``, one grammar, the same options everywhere.

User errors (bad input, and bad options too: Typer's usage errors are reworded here) end with one line
on stderr and exit code 2 (``--debug`` anywhere on the line shows the traceback too); a bug in moeconvert
itself exits 1. SIGINT and SIGTERM unwind the run like an error, so its staging folder is removed, then
say so in one line and exit 130 / 143.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.markup import escape
from rich.table import Table

from moeconvert.errors import MoeConvertError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Convert Mixture-of-Experts checkpoints once, offline, into backend-ready safetensors.")
err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

# Options that mean the same on every verb.
REVISION = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of a repo id SRC.")
JSON = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of tables.")
TP_SIZE = typer.Option(1, "--tp-size", min=1, help="Tensor-parallel size the output is cut for.")
TP_RANK = typer.Option(0, "--tp-rank", min=0, help="The TP rank this output holds.")
EP_SIZE = typer.Option(1, "--ep-size", min=1, help="Expert-parallel size (linear expert placement).")
EP_RANK = typer.Option(0, "--ep-rank", min=0, help="The EP rank this output holds.")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise MoeConvertError("bad size", tensor="--max-shard-size", expected="e.g. 5GB, 500MB, 2GiB", found=text)
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** " KMGT".index((m[2] or " ").upper()))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False, disable=not err.is_terminal)


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


def _partition(tp_size, tp_rank, ep_size, ep_rank):
    from moeconvert.canonical import Partition

    if tp_rank >= tp_size:
        raise MoeConvertError("--tp-rank must be below --tp-size", expected=f"< {tp_size}", found=tp_rank)
    if ep_rank >= ep_size:
        raise MoeConvertError("--ep-rank must be below --ep-size", expected=f"< {ep_size}", found=ep_rank)
    return Partition(tp_size, tp_rank, ep_size, ep_rank)


# ---------------------------------------------------------------------------------------------------


@app.command()
def inspect(
    src: str = typer.Argument(..., help="Checkpoint folder or Hugging Face repo id."),
    revision: Optional[str] = REVISION,
    json_out: bool = JSON,
    tp_size: int = TP_SIZE,
    ep_size: int = EP_SIZE,
    fmt: Optional[str] = typer.Option(None, "--format", help="Judge the backends as `quantize --format` targets (mxfp4)."),
    dtype: str = typer.Option("auto", "--dtype", help="With --format: the model dtype the engine runs."),
):
    """What is in a checkpoint: its MoE layers, and which backends can take it (and why not)."""
    from moeconvert.convert import check_layers, group_by_layers, layer_shape, output_scheme, scheme_kind
    from moeconvert.layouts import get_layout, layout_names
    from moeconvert.modelmap import map_model
    from moeconvert.sources import open_source

    source = open_source(src, revision)
    model = map_model(source)
    part = _partition(tp_size, 0, ep_size, 0)
    quant, out_dtype = None, model.dtype
    if fmt is not None:
        from moeconvert.quantize import Quantization, resolve_model_dtype

        quant, out_dtype = Quantization(fmt), resolve_model_dtype(model.dtype, dtype)
    moe_names = model.moe_tensor_names()
    layers = []
    for lm in model.layers:
        nbytes = sum(source.info(n).nbytes for n in lm.source_tensors())
        layers.append({"prefix": lm.prefix, "layer": lm.layer, "num_experts": lm.num_experts, "top_k": lm.top_k,
                       "hidden_size": lm.hidden_size, "intermediate_size": lm.intermediate_size,
                       "scheme": lm.scheme.describe(), "activation": lm.activation, "has_bias": lm.has_bias,
                       "bytes": nbytes, "shared_experts": bool(lm.shared)})
    backends = {}
    for name in layout_names():
        layout = get_layout(name, scheme_kind(model, quant))
        problems = check_layers(model, layout, part, quant, out_dtype)
        warnings = []
        if not problems:
            pairs = []
            for lm in model.layers:
                shape, _ = layer_shape(lm, part, out_dtype, layout, quant)
                pairs += [(lm.prefix, w) for w in layout.warnings(shape, output_scheme(lm, quant))]
            warnings = group_by_layers(pairs)
        backends[name] = {"ok": not problems, "problems": problems, "warnings": warnings,
                          "kernel": layout.kernel, "layout_version": layout.version}
    other = sum(i.nbytes for n, i in source.tensors.items() if n not in moe_names)
    report = {"source": src, "revision": source.revision, "family": model.family.name, "dtype": model.dtype,
              "moe_layers": layers, "moe_bytes": sum(x["bytes"] for x in layers), "other_bytes": other,
              "partition": part.to_json(), "backends": backends}
    if json_out:
        print(json.dumps(report, indent=1))
        return
    out.print(f"[bold]{src}[/bold]  family [cyan]{model.family.name}[/cyan]  dtype {model.dtype}  "
              f"{len(layers)} MoE layers  experts {_human(report['moe_bytes'])}  other {_human(other)}")
    t = Table(title="MoE layers")
    for col in ("layer", "prefix", "E", "top-k", "H", "I", "scheme", "bias", "bytes"):
        t.add_column(col, justify="right" if col in ("E", "top-k", "H", "I", "bytes") else "left",
                     overflow="fold", no_wrap=False)
    for x in layers:
        t.add_row(str(x["layer"]), x["prefix"], str(x["num_experts"]), str(x["top_k"]), str(x["hidden_size"]),
                  str(x["intermediate_size"]), x["scheme"], "yes" if x["has_bias"] else "", _human(x["bytes"]))
    out.print(t)
    b = Table(title=f"Backends (TP {tp_size}, EP {ep_size})" + (f", as {fmt} targets" if fmt else ""))
    for col in ("backend", "can take it", "why not / notes"):
        b.add_column(col)
    for name, r in backends.items():
        if r["ok"]:
            note = "; ".join(r["warnings"][:2]) + (f" (+{len(r['warnings']) - 2} more)" if len(r["warnings"]) > 2 else "")
            b.add_row(name, "[green]yes[/green]", note)
        else:
            n_layers = len(r["problems"])
            n_problems = len({p for ps in r["problems"].values() for p in ps})
            b.add_row(name, "[red]no[/red]", f"{n_problems} constraint(s) violated in {n_layers} layer(s), below")
    out.print(b)
    for name, r in backends.items():
        if r["ok"]:
            continue
        by_problem: dict[str, list[str]] = {}
        for prefix, problems in r["problems"].items():
            for p in problems:
                by_problem.setdefault(p, []).append(prefix)
        out.print(f"[bold]{name}[/bold]: why not")
        for p, prefixes in by_problem.items():
            where = prefixes[0] if len(prefixes) == 1 else f"{len(prefixes)} layers: {prefixes[0]} .. {prefixes[-1]}"
            out.print(f"  [red]-[/red] {escape(p)} [dim]({escape(where)})[/dim]")


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
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard, e.g. 5GB, 500MB."),
    chunk_mb: int = typer.Option(256, "--chunk-mb", min=1, help="Working-memory budget per expert chunk (MB)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (layers, tensors, size, shards); write nothing."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder (only once the new one is complete)."),
    verify: bool = typer.Option(False, "--verify", help="Run `moeconvert verify --against SRC` on the result."),
    json_out: bool = JSON,
):
    """Relay a checkpoint's experts out for a backend, without changing their values."""
    _convert(src, out_dir, backend, revision, _partition(tp_size, tp_rank, ep_size, ep_rank), max_shard_size,
             chunk_mb, dry_run, overwrite, verify, json_out)


@app.command(cls=_QuantizeBackendHelp)
def quantize(
    src: str = typer.Argument(..., help="Checkpoint folder or Hugging Face repo id (bf16/fp16/fp32 experts, or gpt-oss MXFP4)."),
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
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard, e.g. 5GB, 500MB."),
    chunk_mb: int = typer.Option(256, "--chunk-mb", min=1, help="Working-memory budget per expert chunk (MB)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (layers, tensors, size, shards); write nothing."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder (only once the new one is complete)."),
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
             chunk_mb, dry_run, overwrite, verify, json_out, quant=quant, dtype=dtype)


def _convert(src, out_dir, backend, revision, part, max_shard_size, chunk_mb, dry_run, overwrite, verify, json_out,
             quant=None, dtype=None):
    from moeconvert.convert import plan_conversion, run_conversion
    from moeconvert.layouts import layout_names
    from moeconvert.modelmap import map_model
    from moeconvert.sources import open_source
    from moeconvert.writer import check_output_target

    choices = _backend_names(None if quant is None else (quant.format,))
    if backend not in choices:
        raise MoeConvertError("unknown backend layout" if backend not in layout_names() else
                              f"backend has no {quant.format} layout", tensor="--backend",
                              expected=" | ".join(choices), found=backend)
    shard_limit = parse_size(max_shard_size)
    source = open_source(src, revision)
    if not dry_run:
        check_output_target(out_dir, source.root, overwrite)
    model = map_model(source)
    if quant is not None:
        from moeconvert.quantize import resolve_model_dtype

        dtype = resolve_model_dtype(model.dtype, dtype)
    plan = plan_conversion(source, backend, part, shard_limit, model=model, quant=quant, dtype=dtype)
    for w in plan.warnings():
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
               "warnings": plan.warnings(), "dry_run": dry_run}
    if dry_run:
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
        return
    t0 = time.perf_counter()
    with _progress() as prog:
        task = prog.add_task(f"repack → {layout.name}", total=sum(t.nbytes for t in plan.tensors))
        run_conversion(plan, out_dir, overwrite=overwrite, chunk_bytes=chunk_mb << 20,
                       progress=lambda n: prog.advance(task, n))
    dt = time.perf_counter() - t0
    summary["seconds"] = round(dt, 3)
    quality = {lp.map.prefix: lp.quality.to_json() for lp in plan.layers if lp.quality is not None}
    if quality:
        summary["quality"] = quality
        if not json_out:
            _print_quality(quality)
    if verify:
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
                  f"{len(plan.shards)} shard(s), {dt:.1f} s ({_human(plan.total_bytes / max(dt, 1e-9))}/s)"
                  + ("; verified: identical to the source" if verify else ""))


def _print_quality(quality: dict) -> None:
    t = Table(title="MXFP4 error, dequant(quant(w)) vs w: relative Frobenius, max |err|, saturated blocks")
    for col in ("layer", "w13 rel", "w13 max", "w13 sat", "w2 rel", "w2 max", "w2 sat"):
        t.add_column(col, justify="left" if col == "layer" else "right")
    for prefix, q in quality.items():
        cells = []
        for proj in ("w13", "w2"):
            cells += [f"{q[proj]['rel_fro_error']:.4f}", f"{q[proj]['max_abs_error']:.3g}",
                      f"{100 * q[proj]['saturated_block_fraction']:.2f} %"]
        m = re.search(r"layers\.(\d+)\.", prefix)
        t.add_row(m.group(1) if m else prefix, *cells)
    out.print(t)


@app.command("verify")
def verify_cmd(
    out_dir: Path = typer.Argument(..., help="A moeconvert output folder."),
    against: Optional[str] = typer.Option(None, "--against", help="The source checkpoint to compare with, exactly."),
    revision: Optional[str] = REVISION,
    json_out: bool = JSON,
):
    """Recompute checksums, decode every MoE tensor, and compare with the source bit for bit."""
    from moeconvert.verify import verify_output

    report = verify_output(out_dir, against=against, revision=revision)
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        _print_verify(report)
    if not report.ok:
        raise typer.Exit(1)


def _print_verify(report) -> None:
    t = Table(title=f"verify {report.out}" + (f" against {report.against}" if report.against else ""))
    for col in ("layer", "tensors", "checksums", "decode", "vs source"):
        t.add_column(col)
    for lr in report.layers:
        cmp = "-" if not lr.compared and not lr.differences else (
            "[green]identical[/green]" if not lr.differences else f"[red]{lr.differences[0]}[/red]")
        t.add_row(lr.prefix, str(lr.tensors),
                  "[green]ok[/green]" if not lr.checksum_errors else f"[red]{lr.checksum_errors[0]}[/red]",
                  "[green]ok[/green]" if not lr.decode_errors else f"[red]{lr.decode_errors[0]}[/red]", cmp)
    out.print(t)
    out.print(f"other tensors: {report.other_tensors}, "
              + ("[green]all match[/green]" if not report.other_errors else f"[red]{len(report.other_errors)} problem(s)[/red]"))
    for e in report.other_errors[:20]:
        out.print(f"  [red]{e}[/red]")
    quality = {lr.prefix: lr.quality for lr in report.layers if lr.quality is not None}
    if quality:
        _print_quality(quality)
    out.print("[green]OK[/green]" if report.ok else "[red]DIFFERENCES FOUND[/red]")


@app.command()
def example(
    out_dir: Path = typer.Argument(..., help="Where to write the example checkpoint."),
    family: str = typer.Option("qwen3-moe", "--family", help="qwen3-moe | qwen2-moe | mixtral | deepseek-v2 | deepseek-v3 | glm4-moe | gpt-oss"),
    scheme: str = typer.Option("w4a16", "--scheme", help="bf16 | fp16 | w4a16 | w8a16 (int schemes made by compressed-tensors)"),
    group_size: int = typer.Option(128, "--group-size", help="Quantization group size; -1 = channelwise."),
    asym: bool = typer.Option(False, "--asym", help="Asymmetric quantization (zero points)."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Number of decoder layers."),
    experts: int = typer.Option(8, "--experts", min=1, help="Routed experts per layer."),
    seed: int = typer.Option(0, "--seed"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
):
    """Write a small but real checkpoint (transformers + compressed-tensors) to try the tools on."""
    from moeconvert.example import make_example
    from moeconvert.writer import StagedOutput, check_output_target

    check_output_target(out_dir, None, overwrite, make_parents=True)
    with StagedOutput(out_dir, [], overwrite) as staged:  # the same staging, swap and cleanup as repack's
        make_example(staged.staging, family, scheme, group_size=group_size, symmetric=not asym,
                     num_layers=layers, num_experts=experts, seed=seed)
        staged.publish()
    out.print(f"wrote {family} {scheme} example to {out_dir}")


bench_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                        help="Measurements to rerun on your machine.")
app.add_typer(bench_app, name="bench")


@bench_app.command("convert")
def bench_convert_cmd(
    src: Path = typer.Argument(..., help="A local checkpoint folder."),
    backend: str = typer.Option(..., "--backend", "-b", help="Layout to write."),
    fmt: Optional[str] = typer.Option(None, "--format", help="Time `quantize --format FMT` instead of `repack`."),
    runs: int = typer.Option(5, "--runs", min=1, help="Pairs of (conversion, cp -r) to run."),
    extra: Optional[list[str]] = typer.Option(None, "--arg", help="Extra argument for the conversion (repeatable), e.g. --arg=--device --arg=cuda."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where outputs go (default: the system temp dir; use the same disk as SRC for a fair cp)."),
    json_out: bool = JSON,
):
    """Whole-process conversion time vs `cp -r` of the same folder, interleaved; median ratio, peak RSS."""
    from moeconvert.bench.convert import bench_convert

    r = bench_convert(src, backend, fmt, runs, list(extra or []), workdir)
    if json_out:
        print(json.dumps(r, indent=1))
        return
    what = f"quantize --format {fmt}" if fmt else "repack"
    out.print(f"{what} --backend {backend}: {_human(r['source_bytes'])} in, {_human(r['output_bytes'])} out, "
              f"{runs} runs")
    out.print(f"  convert: median {r['median_convert_seconds']:.3f} s "
              f"({_human(r['median_throughput_bytes_per_s'])}/s of source), runs {r['convert_seconds']}")
    out.print(f"  cp -r:   median {r['median_cp_seconds']:.3f} s, runs {r['cp_seconds']}")
    out.print(f"  fixed cost (same command with --dry-run: start, imports, planning): "
              f"median {r['median_dry_run_seconds']:.3f} s")
    out.print(f"  time ratio convert / cp (median of pairs): {r['median_time_ratio_vs_cp']:.2f}x"
              f"  -> throughput {1 / r['median_time_ratio_vs_cp']:.2f}x cp")
    out.print(f"  peak RSS of the conversion: {_human(r['max_peak_rss_bytes'])}")


def _bench_device(device: Optional[str]) -> str:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise MoeConvertError("unknown device", tensor="--device", expected="cpu | cuda | cuda:N", found=device)
    if device != "cpu" and not torch.cuda.is_available():
        raise MoeConvertError("--device cuda asked for, but torch sees no CUDA device", tensor="--device",
                              expected="a CUDA device", found="none")
    return device


@bench_app.command("load")
def bench_load_cmd(
    out_dir: Path = typer.Argument(..., help="A moeconvert output folder."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | cuda:N (default: cuda if present)."),
    runs: int = typer.Option(5, "--runs", min=1, help="Timed runs of each way (after one warm-up run)."),
    layers: Optional[list[int]] = typer.Option(None, "--layer", help="Decoder layer to load (repeatable; default: all MoE layers)."),
    source: Optional[str] = typer.Option(None, "--source", help="The source checkpoint (default: the manifest's source id)."),
    reader: str = typer.Option("auto", "--reader", help="auto | direct | pinned | threaded (the runtime's host-to-device copy)."),
    io: bool = typer.Option(False, "--io", help="Also measure GB/s: our loader warm and cold, safetensors, a plain sequential read, the pinned host-to-device link."),
    cold_runs: int = typer.Option(1, "--cold-runs", min=0, help="With --io: cold runs of each (page cache dropped before each)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Threaded reader's workers (default: MOECONVERT_LOAD_THREADS or min(8, cpus))."),
    buffer_mb: Optional[float] = typer.Option(None, "--buffer-mb", min=0.001, help="Threaded reader's buffer size in MB (default: MOECONVERT_LOAD_BUFFER_MB or 64)."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="With --io: more threaded-reader settings timed warm, THREADSxMB comma-separated, e.g. 4x64,16x32."),
    json_out: bool = JSON,
):
    """Time to ready on the device: converted folder vs the same bytes read plainly vs source load-then-process."""
    from moeconvert.bench.load import bench_io, bench_load

    settings = []
    for item in (sweep or "").split(","):
        if item.strip():
            m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+(?:\.\d+)?)\s*", item)
            if not m or int(m[1]) < 1 or float(m[2]) <= 0:
                raise MoeConvertError("bad sweep setting", tensor="--sweep", expected="THREADSxMB, e.g. 8x64",
                                      found=item)
            settings.append((int(m[1]), float(m[2])))
    dev = _bench_device(device)
    r = bench_load(out_dir, dev, runs, layers or None, reader, source, threads=threads, buffer_mb=buffer_mb)
    if io:
        r["io"] = bench_io(out_dir, dev, runs, cold_runs, threads, buffer_mb, settings)
    if json_out:
        print(json.dumps(r, indent=1))
        return
    med = r["median_seconds"]
    out.print(f"bench load {out_dir} on {r['device']}: {r['layers']} MoE layers, {_human(r['bytes'])}, "
              f"median of {runs} runs (after a warm-up run)")
    out.print(f"  (a) converted (moeconvert.runtime.load): {med['converted']:.4f} s")
    out.print(f"  (b) floor (same bytes, safetensors to device): {med['floor']:.4f} s")
    if "load_then_process" in med:
        out.print(f"  (c) load-then-process (source to device + decode/quantize/encode there): "
                  f"{med['load_then_process']:.4f} s")
    out.print(f"  ratios: a/b {r['ratio_converted_vs_floor']:.2f}x"
              + (f"   c/b {r['ratio_load_then_process_vs_floor']:.2f}x"
                 f"   c/a {r['speedup_converted_vs_load_then_process']:.2f}x (converted is that much faster)"
                 if "load_then_process" in med else ""))
    out.print(f"  note: {r['stand_in']}")
    if r["source_note"]:
        out.print(f"  note: {r['source_note']}")
    if io:
        _print_io(r["io"])


def _print_io(r: dict) -> None:
    gbs = lambda x: f"{x / 1e9:.2f} GB/s"  # noqa: E731
    out.print(f"I/O: {r['files']} shard(s), {_human(r['file_bytes'])} on disk, {_human(r['load_bytes'])} loaded; "
              f"median of {r['runs']} warm runs (after a warm-up), {r['cold_runs']} cold")
    t = Table()
    for col in ("way", "warm", "cold"):
        t.add_column(col, justify="right" if col != "way" else "left")
    labels = {"ours": f"moeconvert load (threaded, {r['threads_used']} threads x {r['buffer_mb_used']:g} MB)", "ours_pinned": "moeconvert load (pinned, 2x32 MB)",
              "ours_direct": "moeconvert load (direct)", "safetensors_load_file": "safetensors load_file(device=)",
              "safetensors_mmap_to_device": "safe_open (mmap) + get_tensor().to()",
              "sequential_read": "sequential read, 16 MB, no copy"}
    for k, v in r["warm_bytes_per_s"].items():
        c = r["cold_bytes_per_s"].get(k)
        m = re.fullmatch(r"ours_threads(\d+)_buffer(.+)mb", k)
        label = f"moeconvert load (threaded, {m[1]} threads x {m[2]} MB)" if m else labels.get(k, k)
        t.add_row(label, gbs(v), gbs(c) if c else "-")
    if r["h2d_bytes_per_s"]:
        t.add_row("pinned host -> device (1 GB copies)", gbs(r["h2d_bytes_per_s"]), "-")
    out.print(t)
    cold = r["cold"]
    if not r["cold_bytes_per_s"]:
        out.print(f"  cold: not measured ({escape(cold['note']) if cold else 'no cold runs asked for'})")
    else:
        out.print(f"  cold: page cache dropped with {cold['how']}"
                  + (f" ({escape(cold['note'])})" if cold["note"] else "")
                  + (f", {100 * cold['resident_after']:.1f}% resident after (mincore)"
                     if cold["resident_after"] is not None else ""))
    out.print("  ratios: " + "   ".join(f"{k.replace('_vs_', ' / ')} {v:.2f}x" for k, v in r["ratios"].items()))


@bench_app.command("make-folder")
def bench_make_folder_cmd(
    out_dir: Path = typer.Argument(..., help="Output folder (must not exist or be empty, unless --overwrite)."),
    gb: float = typer.Option(6.0, "--gb", min=0.001, help="About this many GB of bf16 experts."),
    experts: int = typer.Option(128, "--experts", min=8, help="Experts per layer (Qwen3-30B-A3B: 128)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
    json_out: bool = JSON,
):
    """A large synthetic converted folder (Qwen3-30B-A3B-shaped bf16 experts, plain layout) for bench load."""
    from moeconvert.bench.load import make_folder

    t0 = time.perf_counter()
    with _progress() as prog:
        task = prog.add_task("make-folder → plain", total=None)
        r = make_folder(out_dir, gb, experts=experts, overwrite=overwrite, progress=lambda n: prog.advance(task, n))
    r["seconds"] = round(time.perf_counter() - t0, 3)
    if json_out:
        print(json.dumps(r, indent=1))
        return
    out.print(f"wrote {out_dir}: {r['layers']} MoE layers of {r['experts']} experts (H {r['hidden_size']}, "
              f"I {r['intermediate_size']}), {_human(r['bytes'])} in {r['shards']} shard(s), {r['seconds']:.1f} s")


def _token_counts(tokens: str) -> list[int]:
    """``--tokens 1,16,128`` -> [1, 16, 128] (positive integers, else the one-line error)."""
    try:
        counts = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise MoeConvertError("bad token counts", tensor="--tokens", expected="e.g. 1,16,128", found=tokens) from None
    if not counts or min(counts) < 1:
        raise MoeConvertError("bad token counts", tensor="--tokens", expected="positive integers", found=tokens)
    return counts


@bench_app.command("layer")
def bench_layer_cmd(
    out_dir: Path = typer.Argument(..., help="A moeconvert output folder."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | cuda:N (default: cuda if present)."),
    tokens: str = typer.Option("1,16,128,1024", "--tokens", help="Comma-separated token counts."),
    runs: int = typer.Option(20, "--runs", min=1, help="Timed calls per measurement (median)."),
    layer: Optional[int] = typer.Option(None, "--layer", help="Decoder layer (default: the first MoE layer)."),
    kernel: Optional[str] = typer.Option(None, "--kernel", help="Force a kernel (as MOECONVERT_KERNEL)."),
    json_out: bool = JSON,
):
    """Per-layer latency of the dispatched kernel vs the PyTorch reference."""
    from moeconvert.bench.load import bench_layer

    counts = _token_counts(tokens)
    r = bench_layer(out_dir, _bench_device(device), counts, runs, layer, kernel)
    if json_out:
        print(json.dumps(r, indent=1))
        return
    out.print(f"bench layer {r['layer']} ({r['layout']}, {r['scheme']}) on {r['device']}: kernel "
              f"[cyan]{r['kernel']}[/cyan], median of {runs} calls"
              + (f"; {escape(r['kernel_note'])}" if r["kernel_note"] else ""))
    t = Table()
    for col in ("tokens", f"dispatched ({r['kernel']}) ms", "reference ms", "speedup", "rel diff"):
        t.add_column(col, justify="right")
    for row in r["rows"]:
        t.add_row(str(row["tokens"]), f"{1e3 * row['kernel_seconds']:.3f}", f"{1e3 * row['reference_seconds']:.3f}",
                  f"{row['speedup_vs_reference']:.2f}x", f"{row['rel_diff_vs_reference']:.2e}")
    out.print(t)


@bench_app.command("kernel")
def bench_kernel_cmd(
    shapes: str = typer.Option("mixtral,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b", "--shapes",
                               help="Comma-separated layer shapes (E, top-k, H, I of these models' routed experts)."),
    tokens: str = typer.Option("1,16,64,256,4096", "--tokens", help="Comma-separated token counts M."),
    contenders: str = typer.Option("marlin,humming,triton_kernels", "--contenders",
                                   help="Engines' kernels to time beside ours (those not found are reported)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="int4-g128 | int8-g128 | mxfp4 for every shape "
                                      "(default: int4-g128, gpt-oss MXFP4)."),
    tune: bool = typer.Option(False, "--tune", help="Sweep our kernel's tiles first and write the config table."),
    table: Optional[str] = typer.Option(None, "--table", help="Config table to write (--tune) or read (default: "
                                        "the user's cache for this GPU)."),
    breakdown: bool = typer.Option(False, "--breakdown", help="Also time our align / GEMM1 / GEMM2 one by one."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda | cuda:N."),
    json_out: bool = JSON,
):
    """Whole-layer time of our Triton fused MoE vs the engines' kernels, with memory and compute floors."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise MoeConvertError("bench kernel needs Triton (pip install triton, on Linux with a CUDA GPU)")
    from moeconvert.bench.kernel import bench_kernel

    counts = _token_counts(tokens)
    log = (lambda *a: print(*a, file=sys.stderr)) if json_out else (lambda m: out.print(escape(str(m))))
    r = bench_kernel([s for s in shapes.split(",") if s], counts, [c for c in contenders.split(",") if c],
                     device=_bench_device(device), fmt=fmt, do_tune=tune, table=table, breakdown=breakdown, log=log)
    if json_out:
        print(json.dumps(r, indent=1))
        return
    names = ["ours"] + [c for c in CONTENDER_ORDER if any(c in row["us"] for row in r["rows"])]
    t = Table(title=f"bench kernel on {r['device']}: us per layer (CUDA graph); copy {r['copy_TBps']} TB/s, "
                    f"bf16 {r['bf16_TFLOPs']} TFLOP/s")
    for col in ("shape", "M", "experts", "mem floor", "compute floor", *names, "vs best", "of mem floor",
                "of compute floor"):
        t.add_column(col, justify="right")
    for row in r["rows"]:
        cells = [f"{row['us'][n]:.1f}" if n in row["us"] else ("error" if n in row["errors"] else "-") for n in names]
        ratio = lambda k: f"{row[k]:.2f}" if row.get(k) is not None else "-"
        t.add_row(f"{row['shape']} ({row['fmt']})", str(row["M"]), str(row["experts_hit"]),
                  f"{row['memory_floor_us']:.1f}", f"{row['compute_floor_us']:.1f}", *cells, ratio("vs_best_contender"),
                  ratio("of_memory_floor"), ratio("of_compute_floor"))
    out.print(t)
    steps = [row for row in r["rows"] if "ours_steps" in row]
    if steps:
        b = Table(title="ours, step by step (us; each GEMM's memory floor in brackets)")
        for col in ("shape", "M", "align", "GEMM1", "GEMM2"):
            b.add_column(col, justify="right")
        for row in steps:
            st = row["ours_steps"]
            b.add_row(row["shape"], str(row["M"]), f"{st['align_us']:.1f}",
                      f"{st['gemm1_us']:.1f} ({st['gemm1_floor_us']:.1f})", f"{st['gemm2_us']:.1f} ({st['gemm2_floor_us']:.1f})")
        out.print(b)
    for k, v in r["contender_notes"].items():
        out.print(f"[dim]{escape(k)}: {escape(v)}[/dim]")
    for row in r["rows"]:
        for k, v in row["errors"].items():
            out.print(f"[dim]{escape(row['shape'])} M={row['M']} {escape(k)}: {escape(v)}[/dim]")


CONTENDER_ORDER = ("marlin", "humming", "triton_kernels")


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised in the main thread wherever the run is.

    A BaseException, as KeyboardInterrupt is, so no ``except Exception`` on the way swallows it, and every
    ``finally`` / ``__exit__`` runs (the writer's removes its staging folder). Not a KeyboardInterrupt:
    Typer turns that into a silent exit 130 before we could say what happened.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind():
    """While the command runs, the first SIGINT / SIGTERM raises :class:`Interrupted`; a second one,
    while the first is still unwinding, exits at once (what is left is cleared by the next run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def handler(signum, frame):
        if caught:
            os.write(2, f"moeconvert: interrupted twice ({signal.Signals(signum).name}); stopped at once, "
                        "the next run on the same output removes what was left\n".encode())
            os._exit(128 + signum)
        caught.append(signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _click_errors(command) -> tuple[tuple, tuple, tuple]:
    """(usage errors, exits, aborts) of the click that ``command`` is built on.

    Typer may run on the installed click or on its own copy (``typer._click``), whose exceptions are
    other classes: take them from the modules the command's classes come from, plus ``click``'s if
    something imported it.
    """
    names = {"click.exceptions", "typer.exceptions"}
    for c in type(command).__mro__:
        names |= {c.__module__, c.__module__.rpartition(".")[0] + ".exceptions"}
    modules = [sys.modules.get(n) for n in names]

    def found(name):
        return tuple({getattr(m, name) for m in modules if isinstance(getattr(m, name, None), type)})

    return found("ClickException"), found("Exit") + (typer.Exit,), found("Abort")


def _given(argv: list[str], opts: list[str]) -> str | None:
    """The value last given on the command line for an option spelled one of ``opts``."""
    value = None
    for i, a in enumerate(argv):
        for o in opts:
            if a == o and i + 1 < len(argv):
                value = argv[i + 1]
            elif o.startswith("--") and a.startswith(o + "="):
                value = a[len(o) + 1:]
    return value


def _command_path(command, argv: list[str]) -> str:
    """``moeconvert bench load``: the verbs ``argv`` starts with (for an error click gave no context)."""
    words = ["moeconvert"]
    for a in argv:
        command = getattr(command, "commands", {}).get(a)
        if command is None:
            break
        words.append(a)
    return " ".join(words)


def _usage_line(e, argv: list[str], command) -> str:
    """One line for a click usage error: which verb, what is wrong, what was given, where help is."""
    ctx = getattr(e, "ctx", None)
    path = ctx.command_path if ctx is not None else _command_path(command, argv)
    verb = path.partition(" ")[2]
    possibilities = getattr(e, "possibilities", None)
    text = (e.message if possibilities else e.format_message()).strip().rstrip(".")
    text = text[:1].lower() + text[1:]
    notes = []
    if possibilities:
        notes.append("did you mean " + " or ".join(sorted(possibilities)))
    param = getattr(e, "param", None)
    if type(e).__name__ != "MissingParameter" and param is not None and getattr(param, "opts", None):
        value = _given(argv, [o for o in param.opts if o.startswith("-")])
        if value is not None:
            notes.append(f"found {value!r}")
    if ctx is not None and text.startswith("no such command") and hasattr(ctx.command, "list_commands"):
        notes.append("expected one of: " + ", ".join(ctx.command.list_commands(ctx)))
    notes.append(f"see {path} --help")
    line = f"{verb}: {text}" if verb else text
    return " ".join(f"{line} ({'; '.join(notes)})".split())


#: errors of the machine or of the paths given, never of moeconvert: a user error wherever they surface
_USER_ERRNOS = {errno.ENAMETOOLONG, errno.ELOOP, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                errno.EPERM, errno.EIO}


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except BrokenPipeError:
        # whoever read our output stopped reading (`| head`): nothing went wrong, and nothing more can be
        # said there; point stdout at /dev/null so the interpreter's last flush does not complain either
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        sys.exit(141)  # as if killed by SIGPIPE, what a shell reports for the same


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or bool(os.environ.get("MOECONVERT_DEBUG"))
    argv = [a for a in argv if a != "--debug"]
    command = typer.main.get_command(app)
    usage_errors, exits, aborts = _click_errors(command)
    try:
        with _signals_unwind():
            code = command.main(args=argv, prog_name="moeconvert", standalone_mode=False)
    except MoeConvertError as e:
        if debug:
            traceback.print_exc()
        print(f"moeconvert: error: {e.line()}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        if debug:
            traceback.print_exc()
        print(f"moeconvert: interrupted ({signal.Signals(e.signum).name}); no unfinished output was left behind",
              file=sys.stderr)
        sys.exit(128 + e.signum)
    except exits as e:
        sys.exit(e.exit_code)
    except usage_errors as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare `moeconvert` or `moeconvert bench`: the help
            print(e.format_message())
            sys.exit(0)
        if debug:
            traceback.print_exc()
        print(f"moeconvert: error: {_usage_line(e, argv, command)}", file=sys.stderr)
        sys.exit(2)
    except aborts + (KeyboardInterrupt,):
        print("moeconvert: interrupted; no unfinished output was left behind", file=sys.stderr)
        sys.exit(130)
    except (OSError, RuntimeError) as e:
        if isinstance(e, BrokenPipeError):
            raise
        if debug:
            traceback.print_exc()
        line = _os_error_line(e)
        if line is None:
            _internal_error(e)
        print(f"moeconvert: error: {line}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # a bug: say so, keep the one-line promise unless asked for more
        if debug:
            traceback.print_exc()
        _internal_error(e)
    sys.exit(code if isinstance(code, int) else 0)


def _os_error_line(e: BaseException) -> str | None:
    """The one line for an OS error that is the machine's or the given paths' fault, else None."""
    if isinstance(e, RuntimeError) and str(e).startswith("Symlink loop from "):
        return f"{str(e)[len('Symlink loop from '):].strip(chr(39))}: a symbolic link loop"  # pathlib < 3.13
    if isinstance(e, OSError) and e.errno in _USER_ERRNOS:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return None


def _internal_error(e: BaseException) -> None:
    line = " ".join(f"{type(e).__name__}: {e}".split())
    print(f"moeconvert: internal error: {line} (rerun with --debug for the traceback)", file=sys.stderr)
    sys.exit(1)
