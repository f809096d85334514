"""A converted folder that was changed after conversion is never taken for the real one.

``moeconvert verify`` and ``load(verify=True)`` both catch a single flipped bit anywhere in the shards
(every kind of tensor, the header JSON and its ``__metadata__``, the 8-byte header length), and
``model.tensor`` never hands out bytes whose sha256 is not the manifest's. Every manifest field is
validated, and a manifest that disagrees with the tensors it describes (partition, expert counts,
shapes, layout metadata) is refused by both, with one line naming the field. A missing or corrupt
output config.json is one clear error too.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from helpers import cli as run_cli  # tests/ is on sys.path under pytest
from moeconvert.errors import MoeConvertError
from moeconvert.example import make_example
from moeconvert.runtime import KernelFallbackWarning, load
from moeconvert.runtime import fastload
from moeconvert.format import read_header
from moeconvert.verify import verify_output

MANIFEST = "moeconvert.json"


def cli(*args) -> int:
    return run_cli(*args).code


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Two real outputs: Qwen3-MoE asymmetric W4A16 in the plain layout (weights, scales, zero points,
    a softmax router) and DeepSeek-V3 W4A16 in the Marlin layout in two shards (a dense first layer,
    shared experts, a biased sigmoid router)."""
    base = tmp_path_factory.mktemp("tampering")
    qwen = make_example(base / "qwen", "qwen3-moe", "w4a16", group_size=32, symmetric=False, num_layers=2,
                        num_experts=4)
    deepseek = make_example(base / "deepseek", "deepseek-v3", "w4a16", num_layers=3, num_experts=4)
    assert cli("repack", qwen, base / "A", "--backend", "plain") == 0
    assert cli("repack", deepseek, base / "B", "--backend", "marlin", "--max-shard-size", "900KB") == 0
    assert len(list((base / "B").glob("*.safetensors"))) >= 2
    return {"A": base / "A", "B": base / "B"}


@pytest.fixture
def copy(outputs, tmp_path):
    def make(which: str = "A") -> Path:
        dst = tmp_path / which
        shutil.copytree(outputs[which], dst)
        return dst
    return make


def load_quietly(out: Path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        return load(out, device="cpu", **kw)


def refused_by_load(out: Path, *needles: str, **kw) -> str:
    with pytest.raises(MoeConvertError) as exc:
        load_quietly(out, **kw)
    line = str(exc.value)
    assert "\n" not in line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def refused_by_verify(out: Path, capsys, *needles: str) -> str:
    run = run_cli("verify", out)
    assert run.code == 2, run.err
    err = run.err.strip()
    assert err.startswith("moeconvert: error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def refused_by_both(out: Path, capsys, *needles: str) -> str:
    refused_by_verify(out, capsys, *needles)
    return refused_by_load(out, *needles, verify=True)


def edit_manifest(out: Path, fn) -> None:
    m = json.loads((out / MANIFEST).read_text())
    fn(m)
    (out / MANIFEST).write_text(json.dumps(m))


def manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


# ---------------------------------------------------------------------------------------------------
# single bit flips

def _kinds(m: dict) -> dict[str, list[str]]:
    """Tensor names of each kind in an output."""
    layer = {e["name"]: suffix for raw in m["moe_layers"] for suffix, e in raw["tensors"].items()}
    router = [n for raw in m["moe_layers"] for n in raw["router"]]
    shared = [n for raw in m["moe_layers"] for n in raw["shared_experts"]]
    other = [n for n in m["tensors"] if n not in router and n not in shared]
    return {
        "moe_weight": [n for n, s in layer.items() if s in ("w13_weight", "w2_weight")],
        "moe_scale": [n for n, s in layer.items() if s.endswith("weight_scale")],
        "moe_zero_point": [n for n, s in layer.items() if s.endswith("zero_point")],
        "router": [n for n in router if n.endswith("gate.weight")],
        "router_bias": [n for n in router if n.endswith("e_score_correction_bias")],
        "shared_expert": shared,
        "attention": [n for n in other if ".self_attn." in n and "norm" not in n],
        "norm": [n for n in other if "norm" in n],
        "embedding": [n for n in other if "embed_tokens" in n or n.startswith("lm_head")],
    }


#: 20 flips over every kind of tensor and every part of a header, in both outputs
FLIPS = [("A", k) for k in ("moe_weight", "moe_scale", "moe_zero_point", "router", "attention", "norm",
                             "embedding", "header_json", "header_metadata", "header_length")] + \
        [("B", k) for k in ("moe_weight", "moe_scale", "router", "router_bias", "shared_expert", "shared_expert",
                             "attention", "embedding", "header_metadata", "header_json")]
#: kinds load(verify=True) reads at once; the others are checked when model.tensor hands them out
LOADED = {"moe_weight", "moe_scale", "moe_zero_point", "router", "router_bias", "shared_expert"}


def _flip_target(out: Path, kind: str, rng: random.Random) -> tuple[Path, int, str | None]:
    """(shard, byte offset, tensor name or None for a header byte) of one flip of this kind."""
    m = manifest(out)
    if kind.startswith("header"):
        shard = out / rng.choice(m["shards"])["file"]
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        meta = raw.index(b'"__metadata__"', 8, 8 + n)
        meta_end = raw.index(b"}", meta) + 1
        if kind == "header_length":
            return shard, rng.randrange(8), None
        if kind == "header_metadata":
            return shard, rng.randrange(meta, meta_end), None
        return shard, rng.choice([i for i in range(8, 8 + n) if not meta <= i < meta_end]), None
    name = rng.choice(_kinds(m)[kind])
    entry = m["tensors"].get(name) or next(e for raw in m["moe_layers"] for e in raw["tensors"].values()
                                           if e["name"] == name)
    info = read_header(out / entry["file"])[name]
    return out / entry["file"], rng.randrange(info.start, info.end), name


@pytest.mark.parametrize("i", range(len(FLIPS)), ids=[f"{i:02d}-{o}-{k}" for i, (o, k) in enumerate(FLIPS)])
def test_a_flipped_bit_is_caught_by_verify_and_load(outputs, copy, capsys, i):
    which, kind = FLIPS[i]
    rng = random.Random(1234 + i)
    clean = outputs[which]
    out = copy(which)
    shard, at, name = _flip_target(out, kind, rng)
    with open(shard, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))

    # moeconvert verify: a header flip is an error (exit 2), a data flip a failed report (exit 1)
    captured = run_cli("verify", out, "--json")
    code = captured.code
    if name is None:
        assert code == 2 and "header checksum mismatch" in captured.err and shard.name in captured.err
    else:
        assert code == 1
        report = json.loads(captured.out)
        assert not report["ok"]
        bad = report["other_errors"] + [f"{lr['prefix']}.{e}" for lr in report["layers"] for e in lr["checksum_errors"]]
        assert len(bad) == 1 and bad[0].startswith(name) and "sha256 mismatch" in bad[0], bad
        assert all(not lr["decode_errors"] and not lr["differences"] for lr in report["layers"])

    # load(verify=True): refuses what it reads at once; hands nothing tampered out later
    if name is None or kind in LOADED:
        line = refused_by_load(out, verify=True)
        assert ("header checksum mismatch" if name is None else "checksum mismatch") in line
        assert (shard.name in line) and (name is None or name in line)
        return
    model = load_quietly(out, verify=True)
    clean_model = load_quietly(clean)
    for other in model.checked.tensors:
        if other == name:
            with pytest.raises(MoeConvertError, match="checksum mismatch: the tensor's bytes changed") as exc:
                model.tensor(name)
            assert name in str(exc.value) and shard.name in str(exc.value)
        else:
            a, b = model.tensor(other), clean_model.tensor(other)
            assert a.dtype == b.dtype and a.shape == b.shape, other
            assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), other


# ---------------------------------------------------------------------------------------------------
# manifest edits: refused by verify and by load, one line naming the field

def test_edited_tp_size(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["partition"].update(tp_size=2))
    line = refused_by_both(out, capsys, "moeconvert.json: moe_layers[0].intermediate_size", "partition.tp_size 2")
    assert "intermediate_size_total" in line
    refused_by_load(out, "partition.tp_size 2")  # a manifest check, with or without verify=True


def test_edited_ep_size(copy, capsys):
    out = copy("B")
    edit_manifest(out, lambda m: m["partition"].update(ep_size=2))
    refused_by_both(out, capsys, "moe_layers[0].num_experts", "ep_size 2")


def test_tp_rank_out_of_range(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["partition"].update(tp_rank=1))
    refused_by_both(out, capsys, "moeconvert.json: partition.tp_rank: expected a rank below partition.tp_size 1, "
                                 "found 1")


def test_edited_num_experts(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["moe_layers"][1].update(num_experts=3))
    refused_by_both(out, capsys, "moe_layers[1].num_experts", "disagree with the partition")


def test_edited_num_experts_with_a_matching_global_count(copy, capsys):
    out = copy("B")
    edit_manifest(out, lambda m: m["moe_layers"][0].update(num_experts=3, num_experts_global=3))
    refused_by_both(out, capsys, "moeconvert.json: moe_layers[0].num_experts: 3 disagrees with the leading dim of "
                                 "w13_weight [4,")


def test_edited_intermediate_size(copy, capsys):
    out = copy("A")

    def halve(m):
        lay = m["moe_layers"][0]
        for key in ("intermediate_size", "intermediate_size_total", "intermediate_size_padded"):
            lay[key] //= 2
    edit_manifest(out, halve)
    refused_by_both(out, capsys, "moe_layers[0].tensors.w13_weight: layout plain plans")


def test_edited_layout_metadata(copy, capsys):
    out = copy("B")
    edit_manifest(out, lambda m: m["moe_layers"][1]["layout_metadata"].update(w13_scale_perm="single"))
    refused_by_both(out, capsys, "moe_layers[1].layout_metadata")


def test_a_mismatch_past_the_first_60_characters_names_where_it_is(copy, capsys):
    """layout_metadata's JSON runs past 60 characters: the line shows the key that differs and both values
    there (each cut at 60, the two read the same)."""
    out = copy("B")
    meta = manifest(out)["moe_layers"][1]["layout_metadata"]
    assert json.dumps(meta).index('"w2_scale_perm"') > 60 and meta["w2_scale_perm"] == "single"
    edit_manifest(out, lambda m: m["moe_layers"][1]["layout_metadata"].update(w2_scale_perm="grouped"))
    refused_by_both(out, capsys, 'moe_layers[1].layout_metadata: expected what layout marlin states for',
                    '"single" at w2_scale_perm, found "grouped" there')


def test_missing_field(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["moe_layers"][0].pop("hidden_size"))
    refused_by_both(out, capsys, "moeconvert.json: moe_layers[0].hidden_size: missing (expected a positive int)")


def test_wrong_type(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["moe_layers"][1].update(num_experts="x"))
    line = refused_by_both(out, capsys)
    assert line == 'moeconvert.json: moe_layers[1].num_experts: expected a positive int, found "x"'


def test_edited_shape(copy, capsys):
    out = copy("A")

    def widen(m):
        m["moe_layers"][0]["tensors"]["w2_weight"]["shape"][1] += 1
    edit_manifest(out, widen)
    refused_by_both(out, capsys, "shard header disagrees with the manifest's moe_layers[0].tensors.w2_weight")


def test_edited_dtype(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["tensors"]["model.norm.weight"].update(dtype="F16"))
    refused_by_both(out, capsys, "model.norm.weight", "tensors[\"model.norm.weight\"]", "BF16")


def test_unknown_scheme_kind(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["moe_layers"][0]["scheme"].update(kind="int3"))
    refused_by_both(out, capsys, "moe_layers[0].scheme.kind: expected float | wna16 | mxfp4 | nvfp4, found \"int3\"")


def test_router_naming_an_unlisted_tensor(copy, capsys):
    out = copy("B")
    edit_manifest(out, lambda m: m["moe_layers"][0]["router"].append("model.layers.1.mlp.gate.nonesuch"))
    refused_by_both(out, capsys, "moe_layers[0].router: names a tensor the manifest does not list")


def test_shared_experts_dropped_from_a_layer(copy, capsys):
    out = copy("B")
    edit_manifest(out, lambda m: m["moe_layers"][1].update(shared_experts=[]))
    refused_by_both(out, capsys, "moeconvert.json: moe_layers[1]: model.layers.2.mlp.shared_experts.",
                    "in neither router nor shared_experts")


def test_edited_top_k_and_family(copy, capsys):
    out = copy("A")
    edit_manifest(out, lambda m: m["moe_layers"][0].update(top_k=3))
    refused_by_both(out, capsys, "moe_layers[0].top_k: expected 2 (config.json num_experts_per_tok), found 3")
    out2 = copy("B")
    edit_manifest(out2, lambda m: m.update(family="glm4-moe"))
    refused_by_both(out2, capsys, 'moeconvert.json: family: expected "deepseek-v3"')


def test_edited_header_checksum(copy, capsys):
    out = copy("B")
    edit_manifest(out, lambda m: m["shards"][1].update(header_sha256="0" * 64))
    refused_by_both(out, capsys, "header checksum mismatch", "shards[1].header_sha256")
    load_quietly(out)  # without verify=True nothing is hashed: the header itself is intact


def test_edited_tensor_checksum(copy, capsys):
    out = copy("A")
    name = "model.layers.0.mlp.gate.weight"
    edit_manifest(out, lambda m: m["tensors"][name].update(sha256="f" * 64))
    capsys.readouterr()
    assert cli("verify", out) == 1
    refused_by_load(out, "checksum mismatch", name, "expected sha256 ffffffffffffffff", verify=True)


def test_manifest_without_header_checksums(copy, capsys):
    out = copy("A")

    def older(m):
        m["format_version"] = 1
        for s in m["shards"]:
            del s["header_sha256"]
    edit_manifest(out, older)
    refused_by_both(out, capsys, "unsupported output format version 1", "predates shard header checksums")
    out2 = copy("B")
    edit_manifest(out2, lambda m: m["shards"][0].pop("header_sha256"))
    refused_by_both(out2, capsys, "moeconvert.json: shards[0].header_sha256: missing")


def test_manifest_that_is_not_an_object(copy, capsys):
    out = copy("A")
    (out / MANIFEST).write_text("[1, 2]")
    refused_by_both(out, capsys, "corrupt manifest: not a JSON object")


def _paths(m: dict) -> list[tuple]:
    """Every field of the manifest, down to one entry of each list and of each map of like entries."""
    paths = []

    def walk(obj, path):
        if isinstance(obj, dict):
            keys = list(obj)
            if path and path[-1] in ("tensors", "files", "copied_files"):
                keys = keys[:1]  # one entry stands for all
            for k in keys:
                paths.append((*path, k))
                if k not in ("layout_metadata", "made_for"):  # the layout's own words, compared whole
                    walk(obj[k], (*path, k))
        elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
            walk(obj[0], (*path, 0))

    walk(m, ())
    return paths


def test_every_field_missing_or_of_a_wrong_type_is_one_clear_line(copy):
    out = copy("B")
    original = manifest(out)
    paths = _paths(original)
    assert len(paths) > 60
    for path in paths:
        for mutation in ("delete", "wrong type"):
            m = json.loads(json.dumps(original))
            parent = m
            for key in path[:-1]:
                parent = parent[key]
            if mutation == "delete":
                if path[:2] == ("source", "files") and len(path) == 3:
                    continue  # which files the source had is the source's business
                del parent[path[-1]]
            else:
                parent[path[-1]] = 0.5
            (out / MANIFEST).write_text(json.dumps(m))
            for check in (lambda: load_quietly(out, verify=True), lambda: verify_output(out)):
                with pytest.raises(MoeConvertError) as exc:
                    check()
                line = str(exc.value)
                assert "\n" not in line and path[-1] in line, (path, mutation, line)


# ---------------------------------------------------------------------------------------------------
# config.json of the output

def test_corrupt_config(copy, capsys):
    out = copy("A")
    (out / "config.json").write_text('{"model_type": "qwen3_moe",')
    needles = ("config.json", "the output's config is not valid JSON", "copy it again from the source")
    refused_by_verify(out, capsys, *needles)
    refused_by_load(out, *needles)
    (out / "config.json").write_text("[]")
    refused_by_load(out, "config.json", "not a JSON object")


def test_missing_config(copy, capsys):
    out = copy("A")
    (out / "config.json").unlink()
    refused_by_verify(out, capsys, "the output has no config.json")
    refused_by_load(out, "the output has no config.json")


def test_edited_config_is_caught_by_its_checksum(copy, capsys):
    out = copy("B")
    cfg = json.loads((out / "config.json").read_text())
    cfg["routed_scaling_factor"] = 1.0 + cfg.get("routed_scaling_factor", 1.0)  # still valid, routing changed
    (out / "config.json").write_text(json.dumps(cfg))
    refused_by_both(out, capsys, "checksum mismatch: config.json changed after conversion")
    load_quietly(out)  # verify=False hashes nothing


def test_edited_copied_file_fails_the_report(copy, capsys):
    out = copy("A")
    (out / "generation_config.json").write_text("{}")
    run = run_cli("verify", out, "--json", expect=1)
    report = json.loads(run.out)
    assert report["other_errors"] == ["generation_config.json: sha256 mismatch (file changed after conversion)"]
    load_quietly(out, verify=True)  # the runtime does not read it


# ---------------------------------------------------------------------------------------------------
# the readers hash what they copy

def _flip_middle_of(out: Path, name: str) -> None:
    m = manifest(out)
    entry = next(e for raw in m["moe_layers"] for e in raw["tensors"].values() if e["name"] == name)
    info = read_header(out / entry["file"])[name]
    with open(out / entry["file"], "r+b") as f:
        f.seek((info.start + info.end) // 2)
        b = f.read(1)[0]
        f.seek((info.start + info.end) // 2)
        f.write(bytes([b ^ 1]))


@pytest.mark.parametrize("reader,kw", [("direct", {}), ("threaded", {"threads": 3, "buffer_mb": 0.01})])
def test_verified_load_gives_the_same_tensors(outputs, reader, kw):
    plain = load_quietly(outputs["B"], reader=reader, **kw)
    checked = load_quietly(outputs["B"], reader=reader, verify=True, **kw)
    for prefix, layer in plain.moe_layers.items():
        other = checked.moe_layers[prefix]
        for suffix, t in layer.tensors.items():
            assert other.tensors[suffix].equal(t)
        for name, t in layer.shared_tensors.items():
            assert other.shared_tensors[name].equal(t)


def test_threaded_reader_catches_a_flip_in_a_tensor_read_in_many_chunks(copy):
    out = copy("B")
    name = manifest(out)["moe_layers"][0]["tensors"]["w13_weight"]["name"]
    _flip_middle_of(out, name)
    refused_by_load(out, "checksum mismatch", name, reader="threaded", threads=4, buffer_mb=0.004, verify=True)


def test_jobs_keep_each_tensor_with_one_worker(outputs):
    model = load_quietly(outputs["B"])
    infos = list(model.checked.tensors.values())
    segs = [fastload._Segment(i, None) for i in infos]
    chunks = fastload.plan_chunks(segs, 8 << 10)
    jobs = fastload.plan_jobs(chunks)
    assert [c for job in jobs for c in job] == chunks and len(jobs) > 1
    owner = {}
    for j, job in enumerate(jobs):
        for ch in job:
            for seg, _, _, _ in ch.pieces:
                assert owner.setdefault(seg.info.name, j) == j, seg.info.name


def test_model_tensor_checks_on_every_call(copy):
    out = copy("A")
    verified, trusting = load_quietly(out, verify=True), load_quietly(out)
    name = "model.embed_tokens.weight"
    before = verified.tensor(name)
    info = verified.checked.tensors[name]
    with open(info.file, "r+b") as f:  # changed after the load
        f.seek(info.start)
        b = f.read(1)[0]
        f.seek(info.start)
        f.write(bytes([b ^ 0x80]))
    with pytest.raises(MoeConvertError, match="checksum mismatch"):
        verified.tensor(name)
    assert not trusting.tensor(name).equal(before)  # verify=False: a plain read, as documented


def test_verify_reads_each_byte_once(outputs, monkeypatch):
    from moeconvert.sources import Source

    seen: dict[str, int] = {}
    real_read, real_raw = Source.read, Source.read_raw

    def read(self, name, rows=None):
        t = real_read(self, name, rows)
        seen[name] = seen.get(name, 0) + t.numel() * t.element_size()
        return t

    def read_raw(self, name, chunk=16 << 20):
        for buf in real_raw(self, name, chunk):
            seen[name] = seen.get(name, 0) + len(buf)
            yield buf

    monkeypatch.setattr(Source, "read", read)
    monkeypatch.setattr(Source, "read_raw", read_raw)
    assert verify_output(outputs["B"]).ok
    infos = load_quietly(outputs["B"]).checked.tensors
    assert seen == {n: i.nbytes for n, i in infos.items()}


def test_header_checksum_is_the_bytes_before_the_data(outputs):
    for shard in manifest(outputs["B"])["shards"]:
        raw = (outputs["B"] / shard["file"]).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        assert hashlib.sha256(raw[:8 + n]).hexdigest() == shard["header_sha256"]
