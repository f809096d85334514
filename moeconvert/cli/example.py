"""``moeconvert example``."""

from __future__ import annotations

import contextlib
import errno
import re
from pathlib import Path
from typing import Optional

import typer

from moeconvert.cli.app import app
from moeconvert.cli.options import out
from moeconvert.errors import MoeConvertError


# The experts' intermediate size of the example: twice the default group size, as in the models people
# convert (I > g). At I == g < H vLLM 0.33.0's own Marlin scales are wrong for its kernel and repack says
# so at length (docs/layouts/marlin.md): a corner for the tests, not the first thing a user should see.
EXAMPLE_INTERMEDIATE_SIZE = 256


@app.command()
def example(
    out_dir: Path = typer.Argument(..., help="Where to write the example checkpoint."),
    family: str = typer.Option("qwen3-moe", "--family", help="qwen3-moe | qwen2-moe | mixtral | deepseek-v2 | deepseek-v3 | glm4-moe | gpt-oss; with --header-only: deepseek-v3 | kimi-k2 | kimi-k3; with --random-weights: qwen3-30b-a3b | deepseek-v3 | kimi-k2"),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="bf16 | fp16 | w4a16 | w8a16 | mxfp4 | nvfp4 (made by compressed-tensors) | fp8-block (DeepSeek-V3 FP8, made by transformers)  [default: w4a16; with --header-only: bf16, or mxfp4 for kimi-k3 (its shipped compressed-tensors MXFP4 experts)]"),
    group_size: int = typer.Option(128, "--group-size", help="Quantization group size; -1 = channelwise."),
    asym: bool = typer.Option(False, "--asym", help="Asymmetric quantization (zero points)."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Number of decoder layers."),
    experts: int = typer.Option(8, "--experts", min=1, help="Routed experts per layer."),
    seed: int = typer.Option(0, "--seed"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
    header_only: bool = typer.Option(False, "--header-only", help="The published model at full size (deepseek-v3 | kimi-k2 | "
                                     "kimi-k3; bf16, or kimi-k3's MXFP4 with --scheme mxfp4) as sparse shards: real "
                                     "names, shapes and config, no data; for planning with --dry-run."),
    random_weights: bool = typer.Option(False, "--random-weights", help="The published model at full size "
                                        "(qwen3-30b-a3b | deepseek-v3 | kimi-k2; --layers N for its first N layers) with random but "
                                        "valid weights, --scheme w4a16 (compressed-tensors pack-quantized) or "
                                        "bf16: for start-up and memory measurements at real size."),
    device: str = typer.Option("cpu", "--device", help="With --random-weights: where the random numbers are "
                               "drawn (cpu | cuda)."),
):
    """Write a small but real checkpoint (transformers + compressed-tensors) to try the tools on."""
    from moeconvert.writer import StagedOutput, check_output_target

    check_output_target(out_dir, None, overwrite, make_parents=True)
    if header_only:
        from moeconvert.fullsize import MODELS, make_header_only

        if family not in MODELS:
            raise MoeConvertError("--header-only writes a published model at full size", tensor="--family",
                                  expected=" | ".join(MODELS), found=family)
        with StagedOutput(out_dir, [], overwrite) as staged, _writing(out_dir):
            make_header_only(staged.staging, family, num_layers=layers, scheme=scheme or "bf16")
            staged.publish()
        out.print(f"wrote {family} {scheme or 'bf16'} at full size, headers only (sparse files, every weight reads "
                  f"as zero), to {out_dir}")
        return
    if random_weights:
        from moeconvert.fullsize import RANDOM_MODELS, make_random_weights

        if family not in RANDOM_MODELS:
            raise MoeConvertError("--random-weights writes a published model at full size", tensor="--family",
                                  expected=" | ".join(RANDOM_MODELS), found=family)
        with StagedOutput(out_dir, [], overwrite) as staged, _writing(out_dir):
            scheme = scheme or "w4a16"
            make_random_weights(staged.staging, family, layers=layers, scheme=scheme, group_size=group_size,
                                seed=seed, device=device)
            staged.publish()
        out.print(f"wrote {family} {scheme} at full size with random weights to {out_dir}")
        return
    from moeconvert.example import make_example

    scheme = scheme or "w4a16"
    with StagedOutput(out_dir, [], overwrite) as staged, _writing(out_dir):  # staging, swap, cleanup as repack's
        make_example(staged.staging, family, scheme, group_size=group_size, symmetric=not asym,
                     num_layers=layers, num_experts=experts, seed=seed, intermediate_size=EXAMPLE_INTERMEDIATE_SIZE)
        staged.publish()
    out.print(f"wrote {family} {scheme} example to {out_dir}")


@contextlib.contextmanager
def _writing(out_dir: Path):
    """A failed write (a full disk, a file size limit) names the folder being written: the OS error of a
    ``write`` carries no file name, and the staging folder it happened in is gone by the time it is shown."""
    from safetensors import SafetensorError

    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS):
            raise MoeConvertError(f"cannot write the example: {e.strerror}", file=str(out_dir)) from e
        raise
    except SafetensorError as e:  # transformers' save_pretrained writes through safetensors' Rust writer
        why = re.search(r"I/O error: (.*?)(?: \(os error \d+\))?$", str(e))
        if why is None:
            raise
        raise MoeConvertError(f"cannot write the example: {why.group(1)}", file=str(out_dir)) from e
