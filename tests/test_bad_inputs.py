"""Bad input: one clear line on stderr, exit code 2, and nothing left behind that looks like an output.

Each case starts from a real checkpoint (made by transformers / compressed-tensors) and corrupts one
thing by hand.
"""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moeconvert.example import make_example

from helpers import assert_refused, cli, resave


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("pristine")
    return {
        "bf16": make_example(base / "bf16", "qwen3-moe", "bf16", num_layers=2, num_experts=4),
        "sharded": make_example(base / "sharded", "qwen3-moe", "bf16", num_layers=2, num_experts=4,
                                max_shard_size="200KB"),
        "w4a16": make_example(base / "w4a16", "qwen3-moe", "w4a16", num_layers=2, num_experts=4),
    }


@pytest.fixture
def ckpt(pristine, tmp_path):
    def copy(kind="bf16"):
        dst = tmp_path / f"src-{kind}"
        shutil.copytree(pristine[kind], dst)
        return dst
    return copy


def only_shard(src: Path) -> Path:
    return src / "model.safetensors"


def rewrite_header(path: Path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_truncated_shard(ckpt, tmp_path):
    src = ckpt()
    f = only_shard(src)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    assert_refused(src, tmp_path / "out", "model.safetensors", "past the end of the file")


def test_corrupt_header_json(ckpt, tmp_path):
    src = ckpt()
    f = only_shard(src)
    data = bytearray(f.read_bytes())
    data[8] = ord("x")  # the header's opening brace
    f.write_bytes(bytes(data))
    assert_refused(src, tmp_path / "out", "model.safetensors", "corrupt header JSON")


def test_header_length_past_end(ckpt, tmp_path):
    src = ckpt()
    f = only_shard(src)
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    assert_refused(src, tmp_path / "out", "header length exceeds the file")


def test_offsets_past_end_of_file(ckpt, tmp_path):
    src = ckpt()
    name = "model.layers.1.mlp.experts.2.up_proj.weight"

    def edit(h):
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b + 10**9, e + 10**9]

    rewrite_header(only_shard(src), edit)
    assert_refused(src, tmp_path / "out", name, "past the end of the file")


def test_size_does_not_match_shape(ckpt, tmp_path):
    src = ckpt()
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    rewrite_header(only_shard(src), lambda h: h[name].update(shape=[h[name]["shape"][0], 3]))
    assert_refused(src, tmp_path / "out", name, "does not match shape")


def test_index_names_missing_shard(ckpt, tmp_path):
    src = ckpt("sharded")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    assert_refused(src, tmp_path / "out", "model.safetensors.index.json", "does not exist", shards[-1].name)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_path_outside_checkpoint_is_never_read(ckpt, tmp_path, how):
    src = ckpt("sharded")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(src / victim, outside)
    if how == "dotdot":
        target = "../elsewhere.safetensors"
    elif how == "absolute":
        target = str(outside)
    else:
        os.symlink(outside, src / victim)
        target = victim
    index["weight_map"] = {k: (target if v == victim else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    line = assert_refused(src, tmp_path / "out", "outside the checkpoint folder", "refusing to read it")
    assert ("link" in line) == (how == "symlink")


def test_missing_expert_tensor(ckpt, tmp_path):
    src = ckpt()
    resave(src, drop=["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert_refused(src, tmp_path / "out", "missing expert tensor", "model.layers.1.mlp.experts.3")


def test_missing_whole_expert(ckpt, tmp_path):
    src = ckpt()
    names = [n for n in load_file(only_shard(src)) if ".experts.3." in n and "layers.0." in n]
    resave(src, drop=names)
    assert_refused(src, tmp_path / "out", "does not hold every routed expert", "expert 3 missing")


def test_mismatched_shapes_across_experts(ckpt, tmp_path):
    src = ckpt()
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    t = load_file(only_shard(src))[name]
    resave(src, replace={name: torch.zeros(t.shape[0] // 2, t.shape[1], dtype=t.dtype)})
    assert_refused(src, tmp_path / "out", name, "disagree across experts")


def test_config_hidden_size_disagrees(ckpt, tmp_path):
    src = ckpt()
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] *= 2
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path / "out", "hidden size disagrees with config.json")


def test_unknown_family(ckpt, tmp_path):
    src = ckpt()
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path / "out", "unknown model family", "llama", "qwen3_moe")


def test_actorder_group_is_refused_like_vllm(ckpt, tmp_path):
    src = ckpt("w4a16")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path / "out", "actorder='group'", "not supported")


def test_mixed_schemes_across_projections(ckpt, tmp_path):
    src = ckpt("w4a16")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:.*down_proj$")
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path / "out", "same quantization scheme")


def test_activation_quantization_is_not_wna16(ckpt, tmp_path):
    src = ckpt("w4a16")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    (src / "config.json").write_text(json.dumps(cfg))
    assert_refused(src, tmp_path / "out", "not a weight-only")


def test_output_exists(ckpt, tmp_path):
    src = ckpt()
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, _, err = cli("repack", src, out, "--backend", "plain")
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


def test_output_inside_source(ckpt):
    src = ckpt()
    code, _, err = cli("repack", src, src / "converted", "--backend", "plain")
    assert code == 2 and "outside the source" in err
    assert not (src / "converted").exists()


@pytest.mark.parametrize("kind", ["missing", "file", "no-config"])
def test_unreadable_source(tmp_path, kind):
    src = tmp_path / "src"
    if kind == "file":
        src.write_text("not a folder")
    elif kind == "no-config":
        src.mkdir()
    assert_refused(src, tmp_path / "out", str(src) if kind != "no-config" else "no config.json")


def test_unknown_backend(ckpt, tmp_path):
    code, _, err = cli("repack", ckpt(), tmp_path / "out", "--backend", "nope")
    assert code == 2 and "unknown backend layout" in err and "plain" in err
    assert not (tmp_path / "out").exists()


def test_failure_mid_write_leaves_nothing_and_keeps_old_output(ckpt, tmp_path, monkeypatch):
    src = ckpt()
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous output")
    from moeconvert.layouts.plain import PlainLayout

    calls = {"n": 0}
    real = PlainLayout.encode

    def failing(self, block, shape):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("simulated failure in the middle of the conversion")
        return real(self, block, shape)

    monkeypatch.setattr(PlainLayout, "encode", failing)
    code, _, err = cli("repack", src, out, "--backend", "plain", "--overwrite")
    assert code == 1 and "internal error" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert not [p for p in tmp_path.iterdir() if "moeconvert-partial" in p.name]


def test_debug_shows_the_traceback(ckpt, tmp_path):
    src = ckpt()
    f = only_shard(src)
    f.write_bytes(f.read_bytes()[:4])
    code, _, err = cli("repack", src, tmp_path / "out", "--backend", "plain", "--debug")
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("moeconvert: error:")
