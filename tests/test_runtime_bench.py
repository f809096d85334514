"""`moeconvert bench load|layer` on CPU: well-formed output (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from moeconvert.example import make_example

from helpers import cli


@pytest.fixture(scope="module")
def marlin_out(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench")
    src = make_example(base / "src", "qwen3-moe", "w4a16", group_size=32, num_experts=4)
    cli("repack", src, base / "out", "--backend", "marlin", expect=0)
    return base / "out"


def test_bench_load_json_and_text(marlin_out):
    r = json.loads(cli("bench", "load", marlin_out, "--device", "cpu", "--runs", 1, "--json", expect=0).out)
    assert set(r["median_seconds"]) == {"converted", "floor", "load_then_process"}
    assert all(len(v) == 1 and v[0] > 0 for v in r["seconds"].values())
    assert r["layers"] == 2 and r["bytes"] > 0 and r["source_note"] is None
    for key in ("ratio_converted_vs_floor", "ratio_load_then_process_vs_floor",
                "speedup_converted_vs_load_then_process"):
        assert r[key] > 0
    text = cli("bench", "load", marlin_out, "--device", "cpu", "--runs", 1, "--layer", 1, expect=0).out
    assert "(a) converted" in text and "(b) floor" in text and "(c) load-then-process" in text
    assert "a/b" in text and "c/a" in text and "stand-in" in text


def test_bench_load_without_the_source(marlin_out, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(marlin_out, out)
    m = json.loads((out / "moeconvert.json").read_text())
    m["source"]["id"] = str(tmp_path / "gone")
    (out / "moeconvert.json").write_text(json.dumps(m))
    r = json.loads(cli("bench", "load", out, "--device", "cpu", "--runs", 1, "--json", expect=0).out)
    assert "load_then_process" not in r["median_seconds"] and "(c) skipped" in r["source_note"]


def test_bench_layer(marlin_out):
    r = json.loads(cli("bench", "layer", marlin_out, "--device", "cpu", "--runs", 2, "--tokens", "1,8", "--json",
                       expect=0).out)
    assert r["kernel"] == "reference" and "CUDA" in r["kernel_note"]
    assert [row["tokens"] for row in r["rows"]] == [1, 8]
    # On the CPU the dispatched kernel IS the reference: no difference may be claimed from comparing a
    # call with itself (the GPU suite compares the real kernels against the reference).
    assert all(row["rel_diff_vs_reference"] is None and row["kernel_seconds"] > 0 for row in r["rows"])
    text = cli("bench", "layer", marlin_out, "--device", "cpu", "--runs", 1, "--tokens", "2", expect=0).out
    assert "reference ms" in text and "same call" in text
    cli("bench", "layer", marlin_out, "--device", "cpu", "--tokens", "x", expect=2)
