"""``moeconvert bench ...``: the measurements (``moeconvert.bench`` is imported only when one runs)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from moeconvert.cli.app import app
from moeconvert.cli.options import JSON, _bench_device, _human, _progress, _token_counts, out
from moeconvert.errors import MoeConvertError

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
                  f"{row['speedup_vs_reference']:.2f}x",
                  "same call" if row["rel_diff_vs_reference"] is None else f"{row['rel_diff_vs_reference']:.2e}")
    out.print(t)


@bench_app.command("kernel")
def bench_kernel_cmd(
    shapes: str = typer.Option("mixtral,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b", "--shapes",
                               help="Comma-separated layer shapes (E, top-k, H, I of these models' routed experts)."),
    tokens: str = typer.Option("1,16,64,256,4096", "--tokens", help="Comma-separated token counts M."),
    contenders: str = typer.Option("marlin,humming,triton_kernels", "--contenders",
                                   help="Engines' kernels to time beside ours (those not found are reported)."),
    custom: Optional[list[str]] = typer.Option(None, "--shape", help="A layer of your own model, E,top_k,H,I "
                                               "(repeatable; e.g. 256,8,7168,2048); with --shapes '' only these."),
    fmt: Optional[str] = typer.Option(None, "--format", help="mxfp4 or int4|int8 - g32|g64|g128|gch [-asym] (e.g. "
                                      "int4-g128, int8-gch-asym) for every shape (default: int4-g128, gpt-oss "
                                      "MXFP4)."),
    tune: bool = typer.Option(False, "--tune", help="Sweep our kernel's tiles first and write the config table."),
    table: Optional[str] = typer.Option(None, "--table", help="Config table to write (--tune) or read (default: "
                                        "the user's cache for this GPU)."),
    breakdown: bool = typer.Option(False, "--breakdown", help="Also time our align / GEMM1 / GEMM2 one by one."),
    configs: Optional[str] = typer.Option(None, "--configs", help="JSON file {\"name\": [GEMM1 config, GEMM2 "
                                          "config]}: also time our layer with each pair, as column ours:name."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda | cuda:N."),
    json_out: bool = JSON,
):
    """Whole-layer time of our Triton fused MoE vs the engines' kernels, with memory and compute floors."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise MoeConvertError("bench kernel needs Triton (pip install triton, on Linux with a CUDA GPU)")
    from moeconvert.bench.kernel import bench_kernel, read_configs

    counts = _token_counts(tokens)
    pairs = read_configs(configs) if configs else None
    log = (lambda *a: print(*a, file=sys.stderr)) if json_out else (lambda m: out.print(escape(str(m))))
    r = bench_kernel([s for s in shapes.split(",") if s], counts, [c for c in contenders.split(",") if c],
                     custom=custom or [], device=_bench_device(device), fmt=fmt, do_tune=tune, table=table,
                     breakdown=breakdown, log=log, pairs=pairs, pairs_file=configs or "--configs")
    if json_out:
        print(json.dumps(r, indent=1))
        return
    names = ["ours"] + [f"ours:{n}" for n in pairs or {}]
    names += [c for c in CONTENDER_ORDER if any(c in row["us"] for row in r["rows"])]
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


def _need_vllm(bench: str) -> None:
    """One line, before anything imports vLLM (its import logs): these benches need it installed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise MoeConvertError(f"bench {bench} needs vLLM", tensor="vllm", expected="pip install 'moeconvert[vllm]'",
                              found="not installed")


@bench_app.command("vllm-startup")
def bench_vllm_startup_cmd(
    src: str = typer.Argument(..., help="The source checkpoint the folder was made from: a folder or a Hub repo id."),
    out_dir: Path = typer.Argument(..., help="A folder the plugin serves (marlin WNA16 / MXFP4, triton WNA16) converted from SRC."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda | cuda:N (default: cuda)."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Time only the first N MoE layers."),
    tokens: int = typer.Option(64, "--tokens", min=1, help="Routed tokens each layer runs once, to compare outputs."),
    moe_backend: Optional[str] = typer.Option(None, "--moe-backend", help="vLLM's MoE backend, for both sides "
                                              "(default: the folder's layout, marlin or triton)."),
    json_out: bool = JSON,
):
    """vLLM's own load-time processing of SRC's MoE layers against the plugin's loading of OUT, per layer:
    time, extra GPU memory, same bytes (needs `moeconvert[vllm]` and a GPU: vLLM's processing runs there)."""
    _need_vllm("vllm-startup")
    dev = _bench_device(device or "cuda")
    if dev == "cpu":
        raise MoeConvertError("vLLM's own MoE processing (the Marlin repack) runs on a GPU only", tensor="--device",
                              expected="cuda", found="cpu")
    from moeconvert.bench.vllm_startup import bench_vllm_startup

    with _progress() as prog:
        task = prog.add_task("vllm-startup", total=layers)
        try:
            r = bench_vllm_startup(src, out_dir, device=dev, layers=layers, tokens=tokens, moe_backend=moe_backend,
                                   progress=lambda n: prog.advance(task, n))
        except ValueError as e:
            raise MoeConvertError(str(e), tensor=str(out_dir)) from None
    if json_out:
        print(json.dumps(r, indent=1))
        return
    out.print(f"vLLM {r['vllm_version']} on {r['device']}, MoE backend {r['moe_backend']}: vLLM's own "
              f"({r['vllm_source_method']}) from {src} against moeconvert's {r['layout']} {r['scheme']} from {out_dir}")
    t = Table()
    for col in ("layer", "vLLM load ms", "vLLM process ms", "ours load ms", "ours process ms",
                "vLLM extra peak", "ours extra peak", "same bytes", "same output"):
        t.add_column(col, justify="right")
    for row in r["layers"]:
        v, m = row["vllm"], row["moeconvert"]
        t.add_row(row["layer"], f"{1e3 * v['load_s']:.1f}", f"{1e3 * v['process_s']:.1f}", f"{1e3 * m['load_s']:.1f}",
                  f"{1e3 * m['process_s']:.1f}", _human(v["peak_extra_bytes"]), _human(m["peak_extra_bytes"]),
                  "–" if row["same_bytes"] is None else
                  "yes" if all(x is True for x in row["same_bytes"].values()) else "NO",
                  "yes" if row["outputs_identical"] else f"rel {row['output_rel_diff']:.1e}")
    out.print(t)
    if r["bytes_compared"] is not True:
        out.print(f"bytes compared: {r['bytes_compared']}")
    w = r["warmup"]
    out.print(f"warm-up round on {w['layer']} (one-time costs of the process, not in the table; vLLM's layer is "
              f"built first and takes them): vLLM load + process {w['vllm']['load_s'] + w['vllm']['process_s']:.3f} s, "
              f"moeconvert {w['moeconvert']['load_s'] + w['moeconvert']['process_s']:.3f} s")
    s = r["summary"]
    out.print(f"load + process, all layers: vLLM {s['vllm']['load_and_process_s']:.3f} s, moeconvert "
              f"{s['moeconvert']['load_and_process_s']:.3f} s ({r['speedup_load_and_process']:.1f}x)")


@bench_app.command("vllm-serve")
def bench_vllm_serve_cmd(
    src: str = typer.Argument(..., help="The source checkpoint the folder was made from: a folder or a Hub repo id."),
    out_dir: Path = typer.Argument(..., help="A folder the plugin serves, converted from SRC."),
    runs: int = typer.Option(2, "--runs", min=1, help="Start-ups of each, alternating."),
    moe_backend: Optional[str] = typer.Option(None, "--moe-backend", help="vLLM's MoE backend for both (default: "
                                              "the folder's layout: marlin, humming or triton)."),
    load_format: str = typer.Option("moeconvert", "--load-format", help="vLLM's load format for the folder "
                                    "(the source loads with vLLM's default, auto)."),
    max_model_len: int = typer.Option(256, "--max-model-len", min=32, help="The engine's max_model_len (less "
                                      "where the model's max_position_embeddings is shorter)."),
    throughput: bool = typer.Option(False, "--throughput", help="Also time prefill (8 prompts of up to 1024 "
                                    "tokens) and decode (32 prompts, 64 tokens each) on both."),
    profile: bool = typer.Option(False, "--profile", help="With --throughput: one more prefill and decode round "
                                 "of the last run of each under torch's profiler, and the GPU's busy time and top "
                                 "kernels (where the time goes when the speeds differ)."),
    gpu_memory_utilization: float = typer.Option(0.5, "--gpu-memory-utilization", min=0.05, max=0.95),
    json_out: bool = JSON,
):
    """vLLM's whole engine (`vllm.LLM`) started on SRC and on OUT, each in a fresh process: start-up time, the
    part spent loading and processing the weights, peak GPU and host memory at load, the greedy tokens of a few
    fixed prompts, and with --throughput prefill and decode speed (needs `moeconvert[vllm]` and a GPU)."""
    if profile and not throughput:
        raise MoeConvertError("profiles the throughput rounds", tensor="--profile", expected="--throughput with it",
                              found="--profile alone")
    _need_vllm("vllm-serve")
    _bench_device("cuda")
    from moeconvert.bench.vllm_engine import bench_vllm_serve

    speed = {"prefill_len": 1024, "prefill_batch": 8, "decode_batch": 32, "decode_tokens": 64} if throughput else None
    if profile:
        speed["profile"] = True
    with _progress() as prog:
        task = prog.add_task("vllm-serve", total=runs)
        try:
            r = bench_vllm_serve(src, out_dir, runs=runs, moe_backend=moe_backend, progress=lambda n: prog.advance(task, n),
                                 max_model_len=max_model_len, load_format=load_format, throughput=speed,
                                 gpu_memory_utilization=gpu_memory_utilization)
        except ValueError as e:
            raise MoeConvertError(str(e), tensor=str(out_dir)) from None
    if json_out:
        print(json.dumps(r, indent=1))
        return
    out.print(f"vllm.LLM start-up, MoE backend {r['moe_backend']}, {runs} run(s) each, alternating "
              f"(folder loaded with --load-format {r['folder_load_format']}):")
    for who, quant, m in (("source", r["source_quantization"], r["source_medians"]),
                          ("folder", r["folder_quantization"], r["folder_medians"])):
        runs_s = [round(x, 2) for x in r[f"{who}_init_s"]]
        line = f"  {who} ({quant}): start-up median {m['init_s']:.2f} s, runs {runs_s}"
        if m.get("model_load_s") is not None:
            line += f"; model loading {m['model_load_s']:.2f} s"
        if m.get("process_s") is not None:
            line += f" (processing {m['process_s']:.2f} s)"
        if m.get("load_peak_gpu_gib") is not None:
            line += f"; peak GPU memory at load {m['load_peak_gpu_gib']:.2f} GiB"
        if m.get("load_peak_host_gib") is not None:
            line += f", peak host {m['load_peak_host_gib']:.2f} GiB"
        if m.get("prefill_tok_s") is not None:
            line += f"; prefill {m['prefill_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.0f} tok/s"
        out.print(line)
    out.print(f"  greedy tokens {'identical' if r['same_tokens'] else 'DIFFERENT'}, largest logprob difference "
              f"{r['max_logprob_diff']:.2e}")
    for who, phases in (r["kernels"] or {}).items():
        for phase, k in phases.items():
            if "error" in k:
                out.print(f"  {who} {phase.split('_')[0]}: not profiled ({k['error']})")
                continue
            out.print(f"  {who} {phase.split('_')[0]} (profiled round): wall {k['wall_ms']:.1f} ms, GPU busy "
                      f"{k['gpu_busy_ms']:.1f} ms, {k['launches']} kernel launches")
            for row in k["top"][:8]:
                out.print(f"    {row['ms']:9.2f} ms {100 * row['share']:5.1f} % x{row['launches']:<6} {row['kernel'][:90]}")
