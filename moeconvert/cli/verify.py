"""``moeconvert verify``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from moeconvert.cli.app import app
from moeconvert.cli.options import JSON, REVISION, _print_quality, out


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
