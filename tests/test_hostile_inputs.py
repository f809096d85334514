"""Hostile input: headers safetensors itself refuses, configs that lie, paths that escape, values that overflow.

Every case starts from a real checkpoint (``make_example``) and damages one thing by hand. Each must end
with one line on stderr naming the file and the tensor or key, exit code 2, no "None" in the line, and
nothing left behind. Header cases also check that ``safetensors.safe_open`` refuses the same file: we
refuse at least what it refuses, so nothing we copy through becomes an output it cannot open.
"""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeconvert.errors import InternalError, MoeConvertError
from helpers import cli  # tests/ is on sys.path under pytest

UP = "model.layers.1.mlp.experts.2.up_proj.weight"
DOWN = "model.layers.0.mlp.experts.1.down_proj.weight"


@pytest.fixture
def ckpt(example_ckpt, tmp_path):
    """A private copy of a shared example checkpoint (4 experts, 2 layers), safe to damage."""
    def copy(family="qwen3-moe", **kw):
        dst = tmp_path / f"src-{family}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(example_ckpt(family, "bf16", num_layers=2, num_experts=4, **kw), dst, symlinks=True)
        return dst
    return copy


def refused(args, capsys, *phrases) -> str:
    """Run the CLI; assert the one-line refusal with ``phrases`` and that no output exists anywhere."""
    out = Path(args[2])
    code, _, err = cli(*args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("moeconvert: error: "), err
    for p in phrases:
        assert p in lines[0], lines[0]
    assert "None" not in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if "moeconvert-partial" in p.name]
    return lines[0]


def repack(src: Path, capsys, *phrases) -> str:
    return refused(["repack", src, src.parent / "out", "--backend", "plain"], capsys, *phrases)


# ---------------------------------------------------------------------------------------------------
# safetensors headers, rewritten by hand


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def put(path: Path, header: bytes, data: bytes, n: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)


def dumps(h: dict) -> bytes:
    return json.dumps(h).encode()


def _by_offset(h: dict) -> list[str]:
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])


def _set(name, key, value):
    def edit(h, data):
        h[name][key] = value
        return dumps(h), data
    return edit


def _duplicate(h, data):
    # rename DOWN's entry to UP: the JSON holds UP twice; json.loads would keep the last silently
    text = json.dumps(h).replace(json.dumps(DOWN), json.dumps(UP))
    return text.encode(), data


def _hole(h, data):
    del h[_by_offset(h)[len(h) // 2]]  # a tensor in the middle: its bytes belong to nobody
    return dumps(h), data


def _drop_last(h, data):
    del h[_by_offset(h)[-1]]
    return dumps(h), data


def _overlap(h, data):
    # two tensors of one size: the later one is pointed at the earlier one's bytes
    first, later = sorted((UP, DOWN), key=lambda k: h[k]["data_offsets"])
    h[later]["data_offsets"] = list(h[first]["data_offsets"])
    return dumps(h), data


def _raw(name, key, text):
    """Set a value to raw JSON text no Python value dumps as (``-0``; ``NaN`` inside a list of offsets)."""
    def edit(h, data):
        h[name][key] = "@@"
        return dumps(h).replace(b'"@@"', text.encode()), data
    return edit


def _no_offsets(h, data):
    del h[UP]["data_offsets"]
    return dumps(h), data


def _overflow(h, data):
    b = h[UP]["data_offsets"][0]
    h[UP].update(shape=[2**40, 2**40, 0], data_offsets=[b, b])
    return dumps(h), data


def _f4_odd(h, data):
    b = h[UP]["data_offsets"][0]
    h[UP].update(dtype="F4", shape=[3], data_offsets=[b, b + 2])
    return dumps(h), data


def _lone_surrogate(h, data):
    return json.dumps(h).replace(json.dumps(UP), '"\\ud800"').encode(), data


HEADER_CASES = {
    # name: (edit(header, data) -> (header bytes, data), phrases the one line must hold)
    "unknown-dtype": (_set(UP, "dtype", "F33"), ["unknown dtype", UP, '"F33"']),
    "lowercase-dtype": (_set(UP, "dtype", "bf16"), ["unknown dtype", UP, "expected a safetensors dtype"]),
    "dim-2**70": (_set(UP, "shape", [2**70, 1]), ["shape must be a list of integers", UP, "2^64-1"]),
    "dim-bool": (_set(UP, "shape", [True, 128]), ["shape must be a list of integers", UP, "true"]),
    "dim-float": (_set(UP, "shape", [3.0, 128]), ["shape must be a list of integers", UP, "3.0"]),
    "dim-negative": (_set(UP, "shape", [-128, -256]), ["shape must be a list of integers", UP, "-128"]),
    "dim-minus-zero": (_raw(UP, "shape", "[-0, 128]"), ["shape must be a list of integers", UP, "-0.0"]),
    "shape-overflow": (_overflow, ["shape overflows 64 bits", UP]),
    "f4-half-byte": (_f4_odd, ["F4 tensor does not fill whole bytes", UP, "12 bits"]),
    "offsets-three": (_set(UP, "data_offsets", [0, 8, 16]), ["data_offsets must be two integers", UP]),
    "offsets-float": (_set(UP, "data_offsets", [0.0, 8.0]), ["data_offsets must be two integers", UP]),
    "offsets-reversed": (lambda h, d: (_set(UP, "data_offsets", h[UP]["data_offsets"][::-1])(h, d)),
                         ["data_offsets are reversed", UP, "expected begin <= end"]),
    "duplicate-name": (_duplicate, [f"{UP}: tensor name appears twice in the header"]),
    "hole": (_hole, ["gap in the data buffer", "belong to no tensor", "expected data_offsets beginning at"]),
    "overlap": (_overlap, ["overlaps", "expected data_offsets beginning at"]),
    "removed-last": (_drop_last, ["bytes after the last tensor's data"]),
    "trailing-bytes": (lambda h, d: (dumps(h), d + bytes(8)), ["bytes after the last tensor's data"]),
    "dtype-null": (_set(UP, "dtype", None), ["unknown dtype", UP, "found null"]),
    "entry-null": (lambda h, d: (dumps({**h, UP: None}), d), ["header entry is not an object", UP, "found null"]),
    "entry-not-object": (lambda h, d: (dumps({**h, UP: [1, 2]}), d), ["header entry is not an object", UP]),
    "entry-no-offsets": (_no_offsets, ["header entry has no data_offsets", UP]),
    "metadata-int": (lambda h, d: (dumps({**h, "__metadata__": {"format": 1}}), d),
                     ["__metadata__: must map strings to strings", "expected an object of strings"]),
    "metadata-list": (lambda h, d: (dumps({**h, "__metadata__": ["pt"]}), d), ["__metadata__", '["pt"]']),
    "header-list": (lambda h, d: (b"[]", d), ["not a JSON object", "found a JSON array"]),
    "header-string": (lambda h, d: (b'"model"', d), ["not a JSON object", "found a JSON string"]),
    "header-number": (lambda h, d: (b"8", d), ["not a JSON object", "found a JSON number"]),
    "header-empty": (lambda h, d: (b"", d), ["empty header", "header length 0"]),
    "header-not-utf8": (lambda h, d: (dumps(h).replace(b'"format"', b'"\xff\xfeormat"'), d),
                        ["header is not valid UTF-8"]),
    "header-nan": (_raw(UP, "data_offsets", "[NaN, 8]"), ["corrupt header JSON", "NaN is not JSON"]),
    "lone-surrogate": (_lone_surrogate, ["corrupt header JSON", "not valid Unicode"]),
}


@pytest.mark.parametrize("case", HEADER_CASES, ids=list(HEADER_CASES))
def test_header_refused_like_safe_open(ckpt, capsys, case):
    edit, phrases = HEADER_CASES[case]
    src = ckpt()
    shard = src / "model.safetensors"
    header, data = split(shard)
    put(shard, *edit(header, data))
    with pytest.raises(Exception):  # safetensors itself will not open it ...
        with safe_open(shard, "pt") as f:
            list(f.keys())
    repack(src, capsys, "model.safetensors", *phrases)  # ... and neither do we


def test_header_length_above_safetensors_limit(ckpt, capsys):
    src = ckpt()
    shard = src / "model.safetensors"
    header, data = split(shard)
    put(shard, dumps(header), data, n=100_000_001)
    with pytest.raises(Exception):
        safe_open(shard, "pt")
    repack(src, capsys, "model.safetensors", "header length exceeds safetensors' limit",
           "expected at most 100000000 bytes, found 100000001")


# ---------------------------------------------------------------------------------------------------
# shard files that are not files


def test_directory_where_the_shard_should_be(ckpt, capsys):
    src = ckpt()
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").mkdir()
    with pytest.raises(Exception):
        safe_open(src / "model.safetensors", "pt")
    repack(src, capsys, "model.safetensors: model.safetensors is not a file", "found a directory")


def _index(src: Path) -> tuple[dict, str]:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return index, sorted(set(index["weight_map"].values()))[0]


def _rename_in_index(src: Path, new: str) -> None:
    index, victim = _index(src)
    index["weight_map"] = {k: (new if v == victim else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("how, phrases", [
    ("loop", ["a symbolic link loop"]),
    ("too-long", ["file name too long"]),
    ("nul", ["weight_map names an invalid path", "NUL"]),
    ("directory", ["is not a file", "found a directory"]),
])
def test_index_shard_that_cannot_be_opened(ckpt, capsys, how, phrases):
    src = ckpt(max_shard_size="200KB")
    _, victim = _index(src)
    (src / victim).unlink()
    if how == "loop":
        os.symlink(victim, src / victim)  # points at itself
    elif how == "too-long":
        _rename_in_index(src, "x" * 300 + ".safetensors")
    elif how == "nul":
        _rename_in_index(src, "model\0.safetensors")
    else:
        (src / victim).mkdir()
    repack(src, capsys, "model.safetensors.index.json", *phrases)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_file_linking_outside_the_checkpoint_is_never_read(ckpt, tmp_path, capsys, name):
    src = ckpt(max_shard_size="200KB")
    outside = tmp_path / f"elsewhere-{name}"
    shutil.move(src / name, outside)  # a perfectly good file, but not the checkpoint's
    os.symlink(outside, src / name)
    repack(src, capsys, name, "a link leading outside the checkpoint folder", "refusing to read it")


# ---------------------------------------------------------------------------------------------------
# config.json values


def edit_config(src: Path, edit) -> None:
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("value, shown", [(True, "true"), (4.0, "4.0"), ("4", '"4"'), (0, "0"), (-4, "-4"),
                                          (float("nan"), "NaN"), ([4], "[4]")])
def test_expert_count_must_be_a_positive_int(ckpt, capsys, value, shown):
    src = ckpt()  # Qwen3-MoE as transformers 5 saves it: num_local_experts, not num_experts
    edit_config(src, lambda c: c.update(num_local_experts=value))
    repack(src, capsys, "config.json: num_local_experts: invalid value",
           f"expected a positive integer, found {shown}")


def test_missing_size_names_the_key(ckpt, capsys):
    src = ckpt()
    edit_config(src, lambda c: c.pop("hidden_size"))
    repack(src, capsys, "config.json: hidden_size: missing (expected a positive integer)")


def test_top_k_above_expert_count(ckpt, capsys):
    src = ckpt()
    edit_config(src, lambda c: c.update(num_experts_per_tok=5))
    repack(src, capsys, "config.json: num_experts_per_tok: top-k is larger than the number of routed experts",
           "expected at most 4 (num_local_experts), found 5")


def test_absurd_layer_count_is_refused_without_walking_it(ckpt, capsys):
    src = ckpt()
    edit_config(src, lambda c: c.update(num_hidden_layers=10**12))
    # in a child with a hang guard (walking 10**12 layers would never end), not a timed claim
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "moeconvert", "repack", str(src), str(src.parent / "out"), "--backend",
                        "plain"], capture_output=True, text=True, timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "config.json: num_hidden_layers: more layers than the checkpoint has tensors for" in lines[0]
    assert "expected at most 2 (the highest layer index in tensor names is 1), found 1000000000000" in lines[0]
    assert not (src.parent / "out").exists()


def test_one_layer_too_many_names_the_missing_layer(ckpt, capsys):
    src = ckpt()
    shard = src / "model.safetensors"
    header, data = split(shard)
    header["model.layers.2.input_layernorm.weight"] = header.pop("model.layers.1.input_layernorm.weight")
    put(shard, dumps(header), data)  # now a layer 2 exists, with no experts
    edit_config(src, lambda c: c.update(num_hidden_layers=3))
    repack(src, capsys, "layers.2: config says layer 2 has routed experts (num_hidden_layers = 3)",
           "no expert tensors for it")


def test_absurd_sparse_step_is_refused_without_walking_it(ckpt, capsys):
    src = ckpt()
    edit_config(src, lambda c: c.update(decoder_sparse_step=10**12))
    repack(src, capsys, "layers.0: layer 0 has expert tensors but the config says it is dense")


@pytest.mark.parametrize("index", ["01", "1" * 30])
def test_expert_index_that_is_not_a_plain_number(ckpt, capsys, index):
    src = ckpt()
    shard = src / "model.safetensors"
    header, data = split(shard)
    name = "model.layers.1.mlp.experts.1.up_proj.weight"
    bad = name.replace(".experts.1.", f".experts.{index}.")
    header[bad] = header.pop(name)
    put(shard, dumps(header), data)
    repack(src, capsys, "model.safetensors", bad, "not a plain number", "without leading zeros")


@pytest.mark.parametrize("key, value, phrases", [
    ("mlp_only_layers", "0", ["config.json: mlp_only_layers: invalid value", "expected a list"]),
    ("mlp_only_layers", [0.5], ["config.json: mlp_only_layers", "layer indices"]),
    ("decoder_sparse_step", 0, ["config.json: decoder_sparse_step", "expected a positive integer, found 0"]),
    ("quantization_config", "w4a16", ["config.json: quantization_config", "expected an object", '"w4a16"']),
    ("quantization_config", ["compressed-tensors"], ["config.json: quantization_config", "expected an object"]),
    ("text_config", "qwen3", ["config.json: text_config", "expected an object"]),
    ("model_type", ["qwen3_moe"], ["config.json: model_type", "expected a string"]),
    ("norm_topk_prob", "yes", ["config.json: norm_topk_prob", "expected true or false"]),
])
def test_config_value_of_the_wrong_type(ckpt, capsys, key, value, phrases):
    src = ckpt()
    edit_config(src, lambda c: c.update({key: value}))
    repack(src, capsys, *phrases)


@pytest.mark.parametrize("change, phrases", [
    ({"n_group": 3}, ["config.json: n_group", "expected a divisor of 4 (n_routed_experts), found 3"]),
    ({"topk_group": 3}, ["config.json: topk_group", "expected at most 2 (n_group), found 3"]),
    ({"num_experts_per_tok": 3}, ["config.json: num_experts_per_tok", "kept groups",
                                  "expected at most 2 (topk_group x experts per group), found 3"]),
    ({"routed_scaling_factor": "2.5"}, ["config.json: routed_scaling_factor", "expected a finite number > 0"]),
    ({"first_k_dense_replace": -1}, ["config.json: first_k_dense_replace", "expected an integer >= 0"]),
])
def test_deepseek_routing_config(ckpt, capsys, change, phrases):
    src = ckpt("deepseek-v3")  # 4 experts in n_group 2, topk_group 1, top-k 2
    edit_config(src, lambda c: c.update(change))
    repack(src, capsys, *phrases)


@pytest.mark.parametrize("change, phrases", [
    ({"swiglu_limit": float("inf")}, ["config.json: swiglu_limit", "expected a finite number, found Infinity"]),
    ({"num_local_experts": "4"}, ["config.json: num_local_experts", 'found "4"']),
])
def test_gpt_oss_config(ckpt, capsys, change, phrases):
    src = ckpt("gpt-oss")
    edit_config(src, lambda c: c.update(change))
    repack(src, capsys, *phrases)


def test_packed_weights_with_a_float_dtype(example_ckpt, tmp_path, capsys):
    src = tmp_path / "w4a16"
    shutil.copytree(example_ckpt("qwen3-moe", "w4a16", num_layers=2, num_experts=4), src)
    shard = src / "model.safetensors"
    header, data = split(shard)
    for name, entry in header.items():
        if name.endswith(".weight_packed"):
            entry["dtype"] = "F32"  # same width: the header stays consistent, the words would not be
    put(shard, dumps(header), data)
    repack(src, capsys, "model.safetensors", "mlp.experts.0.gate_proj.weight_packed",
           "unexpected dtype (expected I32, found F32)")


# ---------------------------------------------------------------------------------------------------
# values the model dtype cannot hold


def test_float16_overflow_is_refused_naming_layer_and_expert(ckpt, capsys):
    src = ckpt()
    shard = src / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    w = tensors[name].float()
    tensors[name] = (w * (7.0e4 / w.abs().max())).to(torch.bfloat16)  # finite in bf16, not in fp16
    save_file(tensors, shard, metadata={"format": "pt"})
    n = int(torch.isinf(tensors[name].to(torch.float16)).sum())
    assert n > 0
    out = src.parent / "out"
    refused(["quantize", src, out, "--format", "mxfp4", "--backend", "plain", "--dtype", "float16"], capsys,
            "model.layers.1.mlp.experts: expert 3 (w13):", f"{n} values exceed float16's range",
            "> 65504", "use --dtype bfloat16")


def test_quality_report_is_never_non_finite():
    from moeconvert.quantize import Quality

    q = Quality()
    q.max_abs["w2"] = float("nan")
    with pytest.raises(InternalError):
        q.to_json()


def test_error_line_leaves_out_what_it_does_not_know():
    assert MoeConvertError("bad", file="f", found="x").line() == "f: bad (found x)"
    assert MoeConvertError("bad", tensor="t", expected="y").line() == "t: bad (expected y)"
    assert MoeConvertError("bad", file="f", tensor="t").line() == "f: t: bad"


def test_dry_run_estimate_of_a_huge_expert_allocates_no_expert(tmp_path, monkeypatch):
    """A consistent header-only checkpoint whose routed experts are 84 GiB each: ``--dry-run`` measures
    what it can and says what it could not, in a child whose address space is capped far below one
    expert (so a real allocation of one fails there, whatever this machine's memory)."""
    import resource
    import subprocess
    import sys

    from moeconvert import fullsize

    H, I = 1024, 14 << 20  # one expert: 3 x I x H bf16 = 84 GiB
    config = {**fullsize.MODELS["deepseek-v3"], "hidden_size": H, "moe_intermediate_size": I, "intermediate_size": 256,
              "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "n_routed_experts": 2,
              "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "vocab_size": 256, "num_attention_heads": 2,
              "num_key_value_heads": 2, "q_lora_rank": 64, "kv_lora_rank": 64}
    monkeypatch.setitem(fullsize.MODELS, "huge-expert", config)
    src = fullsize.make_header_only(tmp_path / "src", "huge-expert")
    assert 3 * I * H * 2 == 84 << 30

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))

    p = subprocess.run([sys.executable, "-m", "moeconvert", "quantize", str(src), str(tmp_path / "out"), "--format",
                        "mxfp4", "--backend", "marlin", "--dry-run", "--json"], capture_output=True, text=True,
                       timeout=600, preexec_fn=cap)
    assert p.returncode == 0, p.stderr[-3000:]
    est = json.loads(p.stdout)["estimate"]
    assert est["not_measured"] == ["layer"] and "layer" not in est["rates"]
    assert est["rates"]["digest"] > 0
    assert not (tmp_path / "out").exists()
