"""``moeconvert bench convert`` runs the conversions it times and reports what it measured (no timing
is asserted: only that the figures exist, are consistent and came from real, successful runs)."""

import json

import pytest

from moeconvert.cli import main


def test_bench_convert_reports_each_run(example_ckpt, tmp_path, capsys):
    src = example_ckpt("qwen3-moe", "bf16")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "convert", str(src), "--backend", "plain", "--format", "mxfp4", "--runs", "2",
              "--workdir", str(tmp_path), "--json"])
    assert exc.value.code == 0
    r = json.loads(capsys.readouterr().out)
    assert r["runs"] == 2 and len(r["convert_seconds"]) == len(r["cp_seconds"]) == len(r["dry_run_seconds"]) == 2
    assert 0 < r["output_bytes"] < r["source_bytes"]  # MXFP4 is smaller than bf16: the output really was written
    assert all(x > 0 for x in r["convert_peak_rss_bytes"])
    assert min(r["convert_seconds"]) <= r["median_convert_seconds"] <= max(r["convert_seconds"])
    assert list(tmp_path.iterdir()) == []  # outputs cleaned up


def test_bench_convert_fails_loudly_when_the_conversion_fails(example_ckpt, tmp_path, capsys):
    src = example_ckpt("qwen3-moe", "bf16")  # float experts: repack --backend marlin refuses them
    with pytest.raises(SystemExit) as exc:
        main(["bench", "convert", str(src), "--backend", "marlin", "--runs", "1", "--workdir", str(tmp_path)])
    assert exc.value.code == 2
    assert "benchmark command failed" in capsys.readouterr().err
