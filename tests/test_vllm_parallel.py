"""One folder, every parallel shape: a folder converted without a partition serves vLLM's EP, TP (where the
layout declares its TP cuts exact), DP + EP and PP, each rank holding exactly what a per-rank conversion
(``repack --tp-size/--tp-rank`` or ``--ep-size/--ep-rank``) writes for it.

The first tests need no vLLM: each layout's declared TP cuts (``Layout.tp_cuts``) against per-rank
conversions, byte for byte, and the shapes where a layout says a cut is not exact are shown to be really
not. The others run vLLM 0.33.0's Python on its CPU platform in N processes on a gloo group
(``vllm_parallel_child.py``): vLLM's own parallel state, its own ``FusedMoEFactory`` (expert map, placement)
or its whole-model loader, the plugin loading the full folder on every rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import cli, st_tensors
from test_vllm_plugin import VLLM_PYTHON, needs_vllm

CHILD = Path(__file__).with_name("vllm_parallel_child.py")

# name: (example arguments, conversion verb and options); sizes chosen so that TP 2 is exact (I / 2 a
# multiple of Marlin's 128-column unit for g128, of 128 for MXFP4)
SCHEMES = {
    "marlin-w4a16-g128": (dict(scheme="w4a16", intermediate_size=512), ["repack", "--backend", "marlin"]),
    "marlin-w4a16-g128-asym": (dict(scheme="w4a16", symmetric=False, intermediate_size=512),
                               ["repack", "--backend", "marlin"]),
    "marlin-w4a16-channel": (dict(scheme="w4a16", group_size=-1, intermediate_size=256),
                             ["repack", "--backend", "marlin"]),
    "marlin-w8a16-g128": (dict(scheme="w8a16", intermediate_size=512), ["repack", "--backend", "marlin"]),
    "marlin-mxfp4": (dict(scheme="bf16", intermediate_size=256), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    "triton-w4a16-g128": (dict(scheme="w4a16", intermediate_size=256), ["repack", "--backend", "triton"]),
    "triton-w4a16-g128-asym": (dict(scheme="w4a16", symmetric=False, intermediate_size=256),
                               ["repack", "--backend", "triton"]),
    "triton-w8a16-g128": (dict(scheme="w8a16", intermediate_size=256), ["repack", "--backend", "triton"]),
}


def _convert(example_ckpt, base: Path, family: str, scheme: str, *extra) -> Path:
    kw, verb = SCHEMES[scheme]
    src = example_ckpt(family, **kw)
    out = base / "-".join([family, scheme, *(str(x).strip("-") for x in extra)])
    if not (out / "moeconvert.json").exists():
        cli(verb[0], src, out, *verb[1:], *extra, expect=0)
    return out


@pytest.fixture(scope="module")
def convert(example_ckpt, tmp_path_factory):
    base = tmp_path_factory.mktemp("parallel")
    return lambda family, scheme, *extra: _convert(example_ckpt, base, family, scheme, *extra)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "moeconvert.json").read_text())


def _layout_and_shape(manifest: dict, entry: dict):
    from moeconvert.format.manifest import layer_shape_from_manifest, parse_scheme
    from moeconvert.layouts import get_layout

    scheme = parse_scheme(entry["scheme"], "scheme")
    return get_layout(manifest["layout"]["name"], scheme.kind), layer_shape_from_manifest(entry, manifest["dtype"]), scheme


# ---------------------------------------------------------------------------------------------------
# the layouts' TP cuts, without vLLM


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_each_layouts_tp_cut_of_a_full_folder_is_the_per_rank_conversion(convert, scheme):
    full = convert("qwen3-moe", scheme)
    files, manifest = st_tensors(full), _manifest(full)
    for rank in range(2):
        ranked = convert("qwen3-moe", scheme, "--tp-size", "2", "--tp-rank", str(rank))
        want = st_tensors(ranked)
        for entry in manifest["moe_layers"]:
            layout, shape, s = _layout_and_shape(manifest, entry)
            cuts = layout.tp_cuts(shape, s, 2)
            assert isinstance(cuts, dict), cuts
            assert set(cuts) == set(entry["tensors"])
            for suffix, t in entry["tensors"].items():
                got = cuts[suffix].take(files[t["name"]], 2, rank)
                assert got.shape == want[t["name"]].shape, (suffix, rank)
                assert torch.equal(got.view(torch.uint8), want[t["name"]].contiguous().view(torch.uint8)), (suffix, rank)


# (scheme, example sizes, what the layout says): shapes where a rank's tensors are not a slice
NOT_A_SLICE = {
    "marlin-one-w2-group": ("marlin-w4a16-g128", dict(intermediate_size=256), "holds one w2 scale group"),
    "marlin-rank-padded": ("marlin-w4a16-channel", dict(intermediate_size=192), "is padded to 128 for Marlin's thread tile"),
    "mxfp4-rank-padded": ("marlin-mxfp4", dict(intermediate_size=128), "is padded to 128 (a multiple of 128)"),
}


@pytest.mark.parametrize("case", sorted(NOT_A_SLICE))
def test_where_a_layout_says_a_tp_rank_is_not_a_slice_it_is_not(example_ckpt, tmp_path, case):
    """The refusal is not caution: cutting the full tensors the way an exact shape is cut gives other
    bytes than the per-rank conversion."""
    from moeconvert.layouts.base import TPCut

    scheme, sizes, why = NOT_A_SLICE[case]
    kw, verb = SCHEMES[scheme]
    src = example_ckpt("qwen3-moe", **{**kw, **sizes})
    cli(verb[0], src, tmp_path / "full", *verb[1:], expect=0)
    manifest = _manifest(tmp_path / "full")
    entry = manifest["moe_layers"][0]
    layout, shape, s = _layout_and_shape(manifest, entry)
    reason = layout.tp_cuts(shape, s, 2)
    assert not isinstance(reason, dict) and why in reason.reason and reason.convertible, reason
    cli(verb[0], src, tmp_path / "r0", *verb[1:], "--tp-size", "2", "--tp-rank", "0", expect=0)
    full, rank0 = st_tensors(tmp_path / "full"), st_tensors(tmp_path / "r0")
    naive = {"w13_weight": TPCut(2, runs=2), "w2_weight": TPCut(1), "w13_weight_scale": TPCut(2, runs=2),
             "w2_weight_scale": TPCut(1)}
    differs = []
    for suffix, cut in naive.items():
        name = entry["tensors"][suffix]["name"]
        a, b = full[name], rank0[name]
        try:
            got = cut.take(a, 2, 0)
        except RuntimeError:
            differs.append(suffix)
            continue
        if got.shape != b.shape or not torch.equal(got.view(torch.uint8), b.contiguous().view(torch.uint8)):
            differs.append(suffix)
    assert differs, "the layout refuses a TP cut that is exact"
