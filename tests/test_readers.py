"""moeconvert.readers: one reader per checkpoint format (docs/architecture.md "Readers").

The compressed-tensors, float and gpt-oss readers are proved by the decode, layout and bad-input tests
that predate the registry; here, the registry's own refusals.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moeconvert.example import make_example

from helpers import cli

def refused(src: Path, tmp_path: Path, *phrases: str, backend: str = "marlin") -> str:
    out = tmp_path / "out"
    code, _, err = cli("repack", src, out, "--backend", backend)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moeconvert: error: "), err
    for p in phrases:
        assert p in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())
    assert not [p for p in tmp_path.iterdir() if "moeconvert-partial" in p.name]
    return lines[0]


def edited(src: Path, tmp_path: Path, config: dict) -> Path:
    """A copy of ``src`` with quantization_config keys set (None deletes one)."""
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        qc = cfg["quantization_config"]
        for k, v in config.items():
            qc.pop(k) if v is None else qc.__setitem__(k, v)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_an_unknown_quant_method_is_refused_naming_those_read(tmp_path):
    src = make_example(tmp_path / "ct", "qwen3-moe", "w4a16", num_layers=1, num_experts=4, hidden_size=128,
                       intermediate_size=64, group_size=32)
    line = refused(edited(src, tmp_path, {"quant_method": "bitsandbytes"}), tmp_path,
                   "quantization_config.quant_method", "bitsandbytes")
    assert "compressed-tensors, fp8, mxfp4 or none" in line


def test_a_compressed_tensors_format_without_a_reader_is_refused_naming_those_read(tmp_path):
    src = make_example(tmp_path / "ct", "qwen3-moe", "w4a16", num_layers=1, num_experts=4, hidden_size=128,
                       intermediate_size=64, group_size=32)
    groups = json.loads((src / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["format"] = "int-quantized"
    line = refused(edited(src, tmp_path, {"config_groups": groups}), tmp_path,
                   "quantization_config.config_groups.group_0.format", "int-quantized")
    assert "expected one of mxfp4-pack-quantized, nvfp4-pack-quantized, pack-quantized" in line
