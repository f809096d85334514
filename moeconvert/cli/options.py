"""What more than one verb module uses: the shared options, the consoles, sizes, progress, partitions."""

from __future__ import annotations

import re
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from moeconvert.errors import MoeConvertError

err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

# Options that mean the same on every verb.
REVISION = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of a repo id SRC.")
JSON = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of tables.")
TP_SIZE = typer.Option(1, "--tp-size", min=1, help="Tensor-parallel size the output is cut for.")
TP_RANK = typer.Option(0, "--tp-rank", min=0, help="The TP rank this output holds.")
EP_SIZE = typer.Option(1, "--ep-size", min=1, help="Expert-parallel size (linear expert placement).")
EP_RANK = typer.Option(0, "--ep-rank", min=0, help="The EP rank this output holds.")
TP_SIZES = typer.Option(None, "--tp-sizes", help="TP sizes one full folder serves, e.g. 1,2,4,8: each a layout "
                        "cannot cut out of the full tensors is stored beside them (docs/format.md).")


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


def _partition(tp_size, tp_rank, ep_size, ep_rank):
    from moeconvert.canonical import Partition

    if tp_rank >= tp_size:
        raise MoeConvertError("--tp-rank must be below --tp-size", expected=f"< {tp_size}", found=tp_rank)
    if ep_rank >= ep_size:
        raise MoeConvertError("--ep-rank must be below --ep-size", expected=f"< {ep_size}", found=ep_rank)
    return Partition(tp_size, tp_rank, ep_size, ep_rank)


def parse_tp_sizes(text: str | None) -> tuple[int, ...]:
    """``--tp-sizes 1,2,4`` -> (2, 4): the sizes above 1, in order, each once (TP 1 is the full folder)."""
    if text is None:
        return ()
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise MoeConvertError("bad TP sizes", tensor="--tp-sizes", expected="positive ints, e.g. 1,2,4,8", found=text)
    return tuple(sorted({n for n in sizes if n > 1}))


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


def _bench_device(device: Optional[str]) -> str:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise MoeConvertError("unknown device", tensor="--device", expected="cpu | cuda | cuda:N", found=device)
    if device != "cpu" and not torch.cuda.is_available():
        raise MoeConvertError("--device cuda asked for, but torch sees no CUDA device", tensor="--device",
                              expected="a CUDA device", found="none")
    return device


def _token_counts(tokens: str) -> list[int]:
    """``--tokens 1,16,128`` -> [1, 16, 128] (positive integers, else the one-line error)."""
    try:
        counts = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise MoeConvertError("bad token counts", tensor="--tokens", expected="e.g. 1,16,128", found=tokens) from None
    if not counts or min(counts) < 1:
        raise MoeConvertError("bad token counts", tensor="--tokens", expected="positive integers", found=tokens)
    return counts
