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
from moeconvert.cli.options import (EP_RANK, EP_SIZE, JSON, REVISION, TP_RANK, TP_SIZE, _human, _partition,
                                    _print_quality, _progress, err, out, parse_size)
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
                  f"{len(plan.shards)} shard(s), {dt:.1f} s ({_human(plan.total_bytes / max(dt, 1e-9))}/s)"
                  + ("; verified: identical to the source" if verify else ""))
