"""`repack --backend plain` end to end on real checkpoints of every family and scheme.

What the output must hold is checked three ways: against the source tensors read with safetensors'
own reader (independent of our decoder), by `verify --against` (our decoder, exact), and by the
invariants of the format (names, manifest, determinism, shards).
"""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from moeconvert.example import FAMILIES, make_example
from moeconvert.verify import verify_output

from helpers import cli, same_bits, st_tensors


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    cache = {}

    def get(family, scheme, **kw):
        key = (family, scheme, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_example(base / f"{family}-{scheme}-{len(cache)}", family, scheme, num_experts=4, **kw)
        return cache[key]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_every_family(made, tmp_path, family):
    src = made(family, "bf16")
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "plain", expect=0)
    manifest = json.loads((out / "moeconvert.json").read_text())
    s, o = st_tensors(src), st_tensors(out)
    moe = {lay["prefix"]: lay for lay in manifest["moe_layers"]}
    assert moe, "the map found no MoE layers"
    # Every non-expert tensor is byte-identical under its own name; no source tensor is lost.
    for name, t in s.items():
        if any(name.startswith(p + ".") for p in moe):
            continue
        assert same_bits(o[name], t), name
    for prefix, lay in moe.items():
        E, I = lay["num_experts"], lay["intermediate_size"]
        w13, w2 = o[f"{prefix}.w13_weight"], o[f"{prefix}.w2_weight"]
        for e in range(E):
            if family == "gpt-oss":
                gu = s[f"{prefix}.gate_up_proj"][e].T  # [2I, H], rows interleaved gate/up
                gate, up, down = gu[0::2], gu[1::2], s[f"{prefix}.down_proj"][e].T
                b = s[f"{prefix}.gate_up_proj_bias"][e]
                assert same_bits(o[f"{prefix}.w13_bias"][e], torch.cat([b[0::2], b[1::2]]))
                assert same_bits(o[f"{prefix}.w2_bias"][e], s[f"{prefix}.down_proj_bias"][e])
            else:
                names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
                gate, up, down = (s[f"{prefix}.{e}.{n}.weight"] for n in names)
            assert same_bits(w13[e, :I], gate.contiguous()) and same_bits(w13[e, I:], up.contiguous())
            assert same_bits(w2[e], down.contiguous())
    assert verify_output(out, against=str(src)).ok


@pytest.mark.parametrize("scheme,group_size,symmetric", [
    ("w4a16", 128, True), ("w4a16", 32, True), ("w4a16", -1, True),
    ("w4a16", 128, False), ("w4a16", -1, False), ("w8a16", 128, True), ("w8a16", 64, False),
])
def test_compressed_tensors_experts(made, tmp_path, scheme, group_size, symmetric):
    src = made("qwen3-moe", scheme, group_size=group_size, symmetric=symmetric)
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "plain", "--verify", expect=0)
    s, o = st_tensors(src), st_tensors(out)
    manifest = json.loads((out / "moeconvert.json").read_text())
    sch = manifest["scheme"]
    assert (sch["kind"], sch["bits"], sch["group_size"], sch["symmetric"]) == (
        "wna16", int(scheme[1]), group_size, symmetric)
    for lay in manifest["moe_layers"]:
        p, I = lay["prefix"], lay["intermediate_size"]
        for e in range(lay["num_experts"]):
            # plain keeps compressed-tensors' words: gate then up rows, stacked
            for suffix in ("weight_packed", "weight_scale"):
                ours = "weight" if suffix == "weight_packed" else suffix
                w13 = o[f"{p}.w13_{ours}"][e]
                assert same_bits(w13[:I], s[f"{p}.{e}.gate_proj.{suffix}"])
                assert same_bits(w13[I:], s[f"{p}.{e}.up_proj.{suffix}"])
                assert same_bits(o[f"{p}.w2_{ours}"][e], s[f"{p}.{e}.down_proj.{suffix}"])
            if not symmetric:
                pf = 32 // int(scheme[1])
                z13 = o[f"{p}.w13_weight_zero_point"][e]
                assert same_bits(z13[: I // pf], s[f"{p}.{e}.gate_proj.weight_zero_point"])
                assert same_bits(z13[I // pf:], s[f"{p}.{e}.up_proj.weight_zero_point"])
            else:
                assert f"{p}.w13_weight_zero_point" not in o


def test_output_is_deterministic(made, tmp_path):
    src = made("deepseek-v3", "w4a16", group_size=32)
    digests = []
    for name in ("a", "b"):
        cli("repack", src, tmp_path / name, "--backend", "plain", expect=0)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / name).iterdir()})
    assert digests[0] == digests[1]


def test_shards_and_index(made, tmp_path):
    src = made("mixtral", "bf16")
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "plain", "--max-shard-size", "300KB", expect=0)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    for f in shards:
        size = (out / f).stat().st_size
        with safe_open(out / f, "pt") as h:
            assert len(list(h.keys())) >= 1
            assert all(index["weight_map"][k] == f for k in h.keys())
        assert size <= 300_000 or len(list(safe_open(out / f, "pt").keys())) == 1
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in st_tensors(out).values())
    assert verify_output(out, against=str(src)).ok
    # the source's other files travel unchanged
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_tp_and_ep_cuts_follow_vllm(made, tmp_path):
    src = made("qwen3-moe", "w4a16", group_size=32)
    s = st_tensors(src)
    full = tmp_path / "full"
    cli("repack", src, full, "--backend", "plain", expect=0)
    f = st_tensors(full)
    parts = {}
    for tp in range(2):
        for ep in range(2):
            out = tmp_path / f"tp{tp}-ep{ep}"
            cli("repack", src, out, "--backend", "plain", "--tp-size", 2, "--tp-rank", tp, "--ep-size", 2,
                "--ep-rank", ep, expect=0)
            assert verify_output(out, against=str(src)).ok
            parts[tp, ep] = (st_tensors(out), json.loads((out / "moeconvert.json").read_text()))
    p = "model.layers.0.mlp.experts"
    E, I = 4, f[f"{p}.w13_weight"].shape[1] // 2
    half = I // 2
    for (tp, ep), (o, m) in parts.items():
        lay = m["moe_layers"][0]
        assert (lay["num_experts"], lay["expert_offset"], lay["intermediate_size"]) == (2, 2 * ep, half)
        experts = slice(2 * ep, 2 * ep + 2)
        rows = slice(tp * half, (tp + 1) * half)
        w13 = f[f"{p}.w13_weight"][experts]
        assert same_bits(o[f"{p}.w13_weight"], torch.cat([w13[:, :I][:, rows], w13[:, I:][:, rows]], 1))
        # down: packed K columns, and its group scales on group columns (vLLM cuts both on dim 1)
        assert same_bits(o[f"{p}.w2_weight"], f[f"{p}.w2_weight"][experts][:, :, tp * half // 8:(tp + 1) * half // 8].contiguous())
        assert same_bits(o[f"{p}.w2_weight_scale"], f[f"{p}.w2_weight_scale"][experts][:, :, tp * half // 32:(tp + 1) * half // 32].contiguous())
        # non-expert tensors are whole on every rank
        assert same_bits(o["model.embed_tokens.weight"], s["model.embed_tokens.weight"])


def test_channelwise_down_scales_are_not_cut(made, tmp_path):
    src = made("qwen3-moe", "w4a16", group_size=-1)
    cli("repack", src, tmp_path / "r1", "--backend", "plain", "--tp-size", 2, "--tp-rank", 1, expect=0)
    o, s = st_tensors(tmp_path / "r1"), st_tensors(src)
    p = "model.layers.1.mlp.experts"
    assert same_bits(o[f"{p}.w2_weight_scale"][3], s[f"{p}.3.down_proj.weight_scale"])


def test_dry_run_writes_nothing_and_describes_the_plan(made, tmp_path):
    src = made("glm4-moe", "bf16")
    out = tmp_path / "out"
    plan = json.loads(cli("repack", src, out, "--backend", "plain", "--dry-run", "--json", expect=0).out)
    assert not out.exists()
    assert plan["dry_run"] and plan["moe_layers"] == 2 and len(plan["shards"]) == 1
    assert plan["layers"][0]["tensors"]["w13_weight"]["shape"][0] == 4
    assert plan["bytes"] > 0


def test_inspect_json(made):
    src = made("deepseek-v3", "w4a16", group_size=128)
    rep = json.loads(cli("inspect", src, "--json", expect=0).out)
    assert rep["family"] == "deepseek-v3"
    # first_k_dense_replace=1: layer 0 is dense
    assert [x["layer"] for x in rep["moe_layers"]] == list(range(1, 1 + len(rep["moe_layers"])))
    assert all(x["scheme"] == "w4a16 g128 sym" and x["shared_experts"] for x in rep["moe_layers"])
    assert rep["backends"]["plain"]["ok"]


def test_verify_detects_a_flipped_bit(made, tmp_path):
    src = made("qwen3-moe", "w4a16")
    out = tmp_path / "out"
    cli("repack", src, out, "--backend", "plain", expect=0)
    shard = next(out.glob("*.safetensors"))
    m = json.loads((out / "moeconvert.json").read_text())
    # flip one bit inside w2_weight of the last layer, then fix up its checksum so only the
    # decode-and-compare step can catch it
    entry = m["moe_layers"][-1]["tensors"]["w2_weight"]
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    start = 8 + n + header[entry["name"]]["data_offsets"][0]
    raw[start + 5] ^= 0x10
    shard.write_bytes(bytes(raw))
    cli("verify", out, expect=1)  # the checksum catches it
    b, e = header[entry["name"]]["data_offsets"]
    entry["sha256"] = hashlib.sha256(raw[8 + n + b:8 + n + e]).hexdigest()
    (out / "moeconvert.json").write_text(json.dumps(m))
    cli("verify", out, expect=0)  # self-consistent again ...
    report = verify_output(out, against=str(src))
    assert not report.ok  # ... but no longer the source
    bad = [lr for lr in report.layers if lr.differences]
    assert len(bad) == 1 and "w2: 1 of" in bad[0].differences[0]
