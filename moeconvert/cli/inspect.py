"""``moeconvert inspect``."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from moeconvert.cli.app import app
from moeconvert.cli.options import EP_SIZE, JSON, REVISION, TP_SIZE, _human, _partition, out


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
                       "format": lm.format, "scheme": lm.scheme.describe(), "activation": lm.activation,
                       "has_bias": lm.has_bias,
                       "bytes": nbytes, "shared_experts": bool(lm.shared),
                       # LongCat-Flash's zero-computation experts (no tensors), written only where there are some
                       **({"zero_experts": lm.zero_experts} if lm.zero_experts else {})})
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
    advice = _advice(model, quant, backends)
    report = {"source": src, "revision": source.revision, "family": model.family.name,
              "format": model.source_format.describe(), "dtype": model.dtype,
              "moe_layers": layers, "moe_bytes": sum(x["bytes"] for x in layers), "other_bytes": other,
              "partition": part.to_json(), "backends": backends, "advice": advice}
    if json_out:
        print(json.dumps(report, indent=1))
        return
    out.print(f"[bold]{src}[/bold]  family [cyan]{model.family.name}[/cyan]  format {escape(report['format'])}  "
              f"dtype {model.dtype}  "
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
    _print_advice(advice, fmt)
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


def _advice(model, quant, backends: dict) -> list[dict]:
    """Per distinct expert scheme: the layout to convert to on each GPU family (moeconvert.advice), whether
    this checkpoint fits it and whether ``vllm serve`` with the plugin serves it today."""
    from moeconvert.advice import advise
    from moeconvert.convert import output_scheme
    from moeconvert.integrations.vllm.scope import method_name

    found: dict[tuple, dict] = {}
    for lm in model.layers:
        scheme = output_scheme(lm, quant)
        key = (scheme.describe(), lm.has_bias)
        if key in found:
            found[key]["layers"].append(lm.prefix)
            continue
        wna16 = scheme.kind == "wna16"
        rows = []
        for a in advise(scheme.kind, model.family.name, bits=scheme.bits if wna16 else None,
                        group_size=scheme.group_size if wna16 else None,
                        symmetric=scheme.symmetric if wna16 else None, has_bias=lm.has_bias,
                        source_format=None if quant else lm.format):
            row = a.to_json()
            fits = a.backend is not None and backends.get(a.backend, {}).get("ok", False)
            row["fits"] = fits
            row["served_by_plugin"] = a.backend is not None and method_name(a.backend, scheme.kind) is not None
            rows.append(row)
        found[key] = {"scheme": key[0], "has_bias": lm.has_bias, "layers": [lm.prefix], "gpus": rows}
    return list(found.values())


def _print_advice(advice: list[dict], fmt: str | None) -> None:
    for group in advice:
        if not group["gpus"]:
            continue
        where = "" if len(advice) == 1 else f", {len(group['layers'])} layer(s) from {group['layers'][0]}"
        t = Table(title=f"Which layout for which GPU ({group['scheme']}{' with biases' if group['has_bias'] else ''}"
                        f"{where}): vLLM 0.33.0's own choice")
        for col in ("GPU", "convert with", "vLLM picks", "fits", "vllm serve", "why"):
            t.add_column(col, overflow="fold")
        verb = "quantize --format " + fmt + " --backend" if fmt else "repack --backend"
        for r in group["gpus"]:
            t.add_row(r["gpu_name"], f"{verb} {r['backend']}" if r["backend"] else "(none here)", r["vllm_backend"],
                      "[green]yes[/green]" if r["fits"] else "[red]no[/red]",
                      "yes" if r["served_by_plugin"] else "not yet", escape(r["why"]))
        out.print(t)
