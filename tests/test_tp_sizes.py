"""``--tp-sizes``: one full folder that also serves the TP sizes its layout cannot cut out of the full tensors.

For each such size T the converter stores every rank's encoding, ``{prefix}.tp{T}.{suffix}`` of shape
``[T, E, ...]``; rank r's block must be byte for byte what ``--tp-size T --tp-rank r`` writes. A size the
layout cuts exactly is recorded as such and stores nothing. ``verify`` hashes, decodes and (``--against``)
compares the stored ranks with the source; the manifest check holds the stored/cut choice to the layout's.
The vLLM plugin serving these folders is tested in tests/test_vllm_parallel.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import cli, st_tensors

# (example arguments, conversion): where a TP 2 rank is not a slice of the full tensors (the layouts say
# why: tests/test_vllm_parallel.py shows cutting gives other bytes), and one where it is
NOT_A_SLICE = {
    "marlin-channel-rank-padded": (dict(scheme="w4a16", group_size=-1, intermediate_size=192),
                                   ["repack", "--backend", "marlin"]),
    "marlin-g128-one-w2-group": (dict(scheme="w4a16", intermediate_size=256), ["repack", "--backend", "marlin"]),
    "marlin-mxfp4-rank-padded": (dict(scheme="bf16", intermediate_size=128),
                                 ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # I = 160 pads to 192 for humming (a multiple of 64), which does not halve into whole 64s: a rank's I = 80
    # is padded on its own, to 128, as the per-rank conversion and vLLM pad it
    "humming-mxfp4-rank-padded": (dict(scheme="bf16", intermediate_size=160, num_layers=1, num_experts=4),
                                  ["quantize", "--format", "mxfp4", "--backend", "humming"]),
}
EXACT = (dict(scheme="w4a16", intermediate_size=512), ["repack", "--backend", "marlin"])


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "moeconvert.json").read_text())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def converted(example_ckpt, tmp_path_factory):
    base = tmp_path_factory.mktemp("tp-sizes")
    made: dict = {}

    def make(kw: dict, verb: list[str], *extra: str, family: str = "qwen3-moe") -> tuple[Path, Path]:
        src = example_ckpt(family, **kw)
        key = (family, json.dumps(kw, sort_keys=True), tuple(verb), extra)
        if key not in made:
            out = base / f"out{len(made)}"
            cli(verb[0], src, out, *verb[1:], *extra, expect=0)
            made[key] = out
        return src, made[key]

    return make


@pytest.mark.parametrize("case", sorted(NOT_A_SLICE))
def test_each_stored_rank_is_the_per_rank_conversion(converted, case):
    kw, verb = NOT_A_SLICE[case]
    src, full = converted(kw, verb, "--tp-sizes", "1,2")
    manifest = _manifest(full)
    files = st_tensors(full)
    ranks = [st_tensors(converted(kw, verb, "--tp-size", "2", "--tp-rank", str(r))[1]) for r in range(2)]
    for layer in manifest["moe_layers"]:
        stored = layer["tp_sizes"]["2"]
        assert stored["stored"] is True and stored["intermediate_size"] == layer["intermediate_size_total"] // 2
        assert set(stored["tensors"]) == set(layer["tensors"])
        for suffix, e in stored["tensors"].items():
            assert e["name"] == f"{layer['prefix']}.tp2.{suffix}"
            t = files[e["name"]]
            assert t.shape[0] == 2
            for r in range(2):
                assert _same(t[r], ranks[r][f"{layer['prefix']}.{suffix}"]), (case, layer["prefix"], suffix, r)
        # the full tensors are still the TP 1 conversion's
        for suffix, e in layer["tensors"].items():
            assert _same(files[e["name"]], st_tensors(converted(kw, verb)[1])[e["name"]]), (case, suffix)
    r = cli("verify", full, "--against", src, "--json", expect=0)
    report = json.loads(r.out)
    assert report["ok"] and all(lr["compared"] for lr in report["layers"])


def test_a_size_the_layout_cuts_exactly_stores_nothing(converted):
    kw, verb = EXACT
    _, full = converted(kw, verb, "--tp-sizes", "1,2")
    _, plain = converted(kw, verb)
    manifest = _manifest(full)
    assert all(layer["tp_sizes"] == {"2": {"stored": False}} for layer in manifest["moe_layers"])
    assert set(st_tensors(full)) == set(st_tensors(plain))


def test_sizes_cut_and_stored_in_one_folder(converted):
    """I = 512, g128: Marlin cuts TP 2 (256 a rank) but not TP 4 (128 a rank: one w2 scale group)."""
    kw, verb = EXACT
    src, full = converted(kw, verb, "--tp-sizes", "1,2,4")
    for layer in _manifest(full)["moe_layers"]:
        assert layer["tp_sizes"]["2"] == {"stored": False} and layer["tp_sizes"]["4"]["stored"] is True
    files = st_tensors(full)
    rank3 = st_tensors(converted(kw, verb, "--tp-size", "4", "--tp-rank", "3")[1])
    layer = _manifest(full)["moe_layers"][0]
    for suffix, e in layer["tp_sizes"]["4"]["tensors"].items():
        assert _same(files[e["name"]][3], rank3[f"{layer['prefix']}.{suffix}"]), suffix
    cli("verify", full, "--against", src, expect=0)


def test_a_flipped_bit_in_a_stored_rank_fails_verify(converted, tmp_path):
    from moeconvert.format import read_header

    kw, verb = NOT_A_SLICE["marlin-channel-rank-padded"]
    src, full = converted(kw, verb, "--tp-sizes", "1,2")
    bad = tmp_path / "bad"
    shutil.copytree(full, bad)
    e = _manifest(bad)["moe_layers"][1]["tp_sizes"]["2"]["tensors"]["w2_weight"]
    info = read_header(bad / e["file"])[e["name"]]
    at = info.start + info.nbytes * 3 // 4  # rank 1's block
    with open(info.file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))
    r = cli("verify", bad, "--json", expect=1)
    report = json.loads(r.out)
    assert not report["ok"]
    errors = [x for lr in report["layers"] for x in lr["checksum_errors"]]
    assert errors == ["tp2.w2_weight: sha256 mismatch"], errors


def test_swapped_rank_blocks_fail_plain_verify(converted, tmp_path):
    """Rank 0's and rank 1's stored blocks swapped, digests updated: every byte is one the layout writes and
    decodes, but a rank's values are the full tensors' values cut for it, so verify (no source) refuses."""
    from moeconvert.format import read_header

    kw, verb = NOT_A_SLICE["marlin-channel-rank-padded"]
    _, full = converted(kw, verb, "--tp-sizes", "1,2")
    bad = tmp_path / "bad"
    shutil.copytree(full, bad)
    text = (bad / "moeconvert.json").read_text()
    for e in _manifest(bad)["moe_layers"][0]["tp_sizes"]["2"]["tensors"].values():
        info = read_header(bad / e["file"])[e["name"]]
        with open(info.file, "r+b") as f:
            f.seek(info.start)
            data = f.read(info.nbytes)
            half = info.nbytes // 2
            f.seek(info.start)
            f.write(data[half:] + data[:half])
        text = text.replace(e["sha256"], hashlib.sha256(data[half:] + data[:half]).hexdigest())
    (bad / "moeconvert.json").write_text(text)
    r = cli("verify", bad, "--json", expect=1)
    layer = json.loads(r.out)["layers"][0]
    assert not layer["checksum_errors"] and not layer["decode_errors"], layer
    assert {d.split(":")[0] for d in layer["differences"]} == {"TP 2 rank 0, experts 0..7", "TP 2 rank 1, experts 0..7"}
    assert all("not rank 0 of 2 of the layer's full tensors" in d or "not rank 1 of 2 of the layer's full tensors" in d
               for d in layer["differences"]), layer["differences"]
    assert {d.rsplit(": ", 2)[1] for d in layer["differences"]} == {"w13", "w2", "w13_scale"}  # w2's scales: whole H
    assert json.loads(r.out)["layers"][1]["ok"]


@pytest.mark.parametrize("change,want", [
    (lambda v: [v.pop(k) for k in list(v) if k != "stored"] and v.update(stored=False),
     "tensor in a shard but not in the manifest"),
    (lambda v: v["tensors"]["w2_weight"].update(shape=[2, 8, 8, 256]),
     "shard header disagrees with the manifest's moe_layers[0].tp_sizes[\"2\"].tensors.w2_weight"),
    (lambda v: v.update(intermediate_size=95), "moe_layers[0].tp_sizes[\"2\"].intermediate_size: expected 96, found 95"),
    (lambda v: v.update(stored=True, extra=1), "moe_layers[0].tp_sizes[\"2\"].extra: unknown field"),
], ids=["stored-false", "shape", "intermediate-size", "unknown-field"])
def test_a_tampered_tp_sizes_entry_is_refused_in_one_line(converted, tmp_path, change, want):
    kw, verb = NOT_A_SLICE["marlin-channel-rank-padded"]
    _, full = converted(kw, verb, "--tp-sizes", "1,2")
    bad = tmp_path / "bad"
    shutil.copytree(full, bad)
    m = _manifest(bad)
    change(m["moe_layers"][0]["tp_sizes"]["2"])
    (bad / "moeconvert.json").write_text(json.dumps(m))
    r = cli("verify", bad, expect=2)
    assert want in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1, r.err


def test_the_layer_check_holds_stored_or_cut_to_the_layout(converted):
    """I = 512, g128 on Marlin: TP 2 is a cut, TP 4 is not; a manifest saying otherwise is refused (the
    layer check, beneath the shard check that a real folder would meet first)."""
    from moeconvert.errors import MoeConvertError
    from moeconvert.layouts.output import check_layer

    kw, verb = EXACT
    _, full = converted(kw, verb, "--tp-sizes", "1,2,4")
    m = _manifest(full)
    check_layer(m, 0)  # as written: accepted
    sizes = m["moe_layers"][0]["tp_sizes"]
    stored4 = sizes["4"]
    sizes["4"] = {"stored": False}
    with pytest.raises(MoeConvertError, match=r"tp_sizes\[\"4\"\]\.stored: layout marlin cannot cut TP 4 out of the "
                                              r"full tensors \(.*\), expected true"):
        check_layer(m, 0)
    sizes["4"], sizes["2"] = stored4, dict(stored4)
    with pytest.raises(MoeConvertError, match=r"tp_sizes\[\"2\"\]\.stored: layout marlin cuts TP 2 out of the full "
                                              r"tensors exactly, expected false"):
        check_layer(m, 0)


@pytest.mark.parametrize("args,want", [
    (["--tp-sizes", "1,2", "--tp-size", "2"], "--tp-sizes makes a full folder"),
    (["--tp-sizes", "two"], "bad TP sizes"),
    (["--tp-sizes", "1,0"], "bad TP sizes"),
    (["--tp-sizes", "1,5"], "not divisible by the TP size"),
], ids=["with-a-partition", "not-a-number", "zero", "indivisible"])
def test_bad_tp_sizes_are_refused_in_one_line(example_ckpt, tmp_path, args, want):
    kw, verb = EXACT
    out = tmp_path / "out"
    r = cli(verb[0], example_ckpt("qwen3-moe", **kw), out, *verb[1:], *args, expect=2)
    assert want in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert not (out / "moeconvert.json").exists()
