"""``moeconvert bench kernel`` and its config tables, on CPU: refusals, the tuning space, the tables.

The timings themselves are GPU-only (docs/kernels.md has the H200 table); nothing here times anything.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from moeconvert.kernels import configs
from moeconvert.layouts import get_layout
from moeconvert.kernels.configs import write_table
from moeconvert.kernels.tune import LayerShape, candidates
from moeconvert.bench.kernel import SHAPES, _fmt, problems
from moeconvert.bench.contenders import Problem, padded_shape, random_layout_tensors

from helpers import cli
from interpreted import REPO, run_child


def _candidates(p: Problem, M: int, sms: int):
    """The tuning space of a bench problem (its sizes as given: the bench shapes need no padding)."""
    fmt, group = _fmt(p)
    return candidates(LayerShape(fmt, group, p.E, p.top_k, p.H, p.I, p.activation), M, sms)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_bench_kernel_refuses_without_a_gpu_in_one_line():
    code, out, err = cli("bench", "kernel", "--shapes", "mixtral", "--tokens", "1")
    assert code == 2 and err.count("\n") == 1 and "needs a CUDA device" in err


@pytest.mark.parametrize("argv,needle", [
    (["--shapes", "llama"], "unknown shape"),
    (["--contenders", "cutlass"], "unknown contender"),
    (["--tokens", "0"], "bad token counts"),
    (["--tokens", "x"], "bad token counts"),
    (["--format", "fp8"], "unknown weight format"),
    (["--format", "int4-g96"], "unknown weight format"),
    (["--format", "int4-g128-sym"], "unknown weight format"),
    (["--shape", "256,8,7168"], "E,top_k,H,I"),
    (["--shape", "8,9,64,64"], "top-k at most E"),
    (["--shape", "8,2,x,64"], "E,top_k,H,I"),
])
def test_bench_kernel_bad_arguments_exit_2(argv, needle):
    code, out, err = cli("bench", "kernel", *argv)
    assert code == 2 and needle in err and err.count("\n") == 1, err


def _pairs_file(tmp_path, data) -> str:
    path = tmp_path / "pairs.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


_C = lambda **kw: dict(dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), **kw)


@pytest.mark.parametrize("data,needle", [
    ("{not json", "cannot read the config pairs"),
    ([], "non-empty JSON object"),
    ({"a": [_C()]}, "a list of two objects"),
    ({"a": [_C(), {"BLOCK_M": 16, "BLOCK_N": 64}]}, "no BLOCK_K"),
    ({"a": [_C(), _C(BLOCK_M=32)]}, "16 and 32"),
    ({"a": [_C(BLOCK_K=32), _C()]}, "64-input fragment atoms"),  # int4 needs whole 64-input atoms
    ({"a": [_C(OPERAND_SCALE=2), _C()]}, "GEMM1.OPERAND_SCALE"),
])
def test_bench_kernel_refuses_bad_config_pairs_before_timing(tmp_path, data, needle):
    path = _pairs_file(tmp_path, data)
    code, out, err = cli("bench", "kernel", "--shapes", "mixtral", "--tokens", "1", "--configs", path)
    assert code == 2 and needle in err and err.count("\n") == 1 and path in err, err


def test_config_pairs_name_columns_of_ours_and_only_the_engines_set_the_best(tmp_path, monkeypatch):
    import moeconvert.bench.kernel as bk

    pair = (_C(BLOCK_K=64, OPERAND_SCALE=1), _C(BLOCK_N=128))
    assert bk.read_configs(_pairs_file(tmp_path, {"wide": [pair[0], pair[1]]})) == {"wide": pair}
    seen = []
    run = lambda x, tw, ids, logits, configs=None: seen.append(configs) or 0.0
    pinned_run, _, _ = bk.pinned((run, 1, None), pair)
    pinned_run(None, None, None, None)
    run(None, None, None, None)
    assert seen == [pair, None]  # the pinned column runs the pair; ours picks its own configs
    monkeypatch.setattr(bk, "graph_us", lambda fn, rep_ms=100: fn())
    build = lambda us: (lambda: ((lambda x, tw, ids, logits: us), None, None))
    rows = bk.time_problem(Problem("tiny", 4, 2, 256, 128, "int4-g128"), [1],
                           {"ours": build(10.0), "ours:wide": build(2.0), "marlin": build(5.0)}, "cpu", 4e12, 1e15, {})
    assert rows[0]["us"] == {"ours": 10.0, "ours:wide": 2.0, "marlin": 5.0}
    assert rows[0]["vs_best_contender"] == 0.5  # marlin over ours; the pinned column is not a contender


def test_problem_bytes_by_hand():
    # Mixtral's layer at int4 g128: 8 experts x 3 x 4096 x 14336 weights x (0.5 B + a bf16 scale per 128)
    p = problems(["mixtral"])[0]
    assert p.E * p.expert_bytes == 8 * 3 * 4096 * 14336 * (0.5 + 2 / 128)
    assert Problem("x", 128, 4, 2880, 2880, "mxfp4").expert_bytes == 3 * 2880 * 2880 * (0.5 + 1 / 32)
    # int8 channelwise, asymmetric: 1 B a weight, per row one bf16 scale and one 1-byte zero point
    q = Problem("x", 4, 2, 256, 64, "int8-gch-asym")
    assert q.projection_bytes(128, 256) == 128 * 256 + 128 * 3 and q.projection_bytes(256, 64) == 256 * 64 + 256 * 3
    # int4 g32 asymmetric: zero points are 4 bits a group
    assert Problem("x", 4, 2, 256, 64, "int4-g32-asym").projection_bytes(128, 256) == 128 * 256 / 2 + 128 * 8 * 2.5


@pytest.mark.parametrize("fmt,scheme", [("int4-g128", (4, 128, True)), ("int8-gch", (8, -1, True)),
                                        ("int4-g32-asym", (4, 32, False)), ("int8-g64-asym", (8, 64, False))])
def test_formats_name_their_scheme(fmt, scheme):
    s = Problem("x", 4, 2, 256, 256, fmt).scheme
    assert (s.bits, s.group_size, s.symmetric) == scheme


def test_custom_shapes_follow_the_named_ones():
    ps = problems(["mixtral"], "int8-g128", ["256,8,7168,2048", "4,1,64,32"])
    assert [(p.name, p.E, p.top_k, p.H, p.I, p.fmt) for p in ps] == [
        ("mixtral", 8, 2, 4096, 14336, "int8-g128"), ("E256-k8-H7168-I2048", 256, 8, 7168, 2048, "int8-g128"),
        ("E4-k1-H64-I32", 4, 1, 64, 32, "int8-g128")]
    assert problems([], None, ["8,2,64,64"])[0].fmt == "int4-g128"


def test_tuning_tries_integer_scales_in_the_operand_only_where_the_mma_is_the_limit():
    p = problems(["qwen3-30b-a3b"], "int8-g128")[0]
    scales = lambda q, M: {(bm, c.get("OPERAND_SCALE")) for bm, g1, g2 in _candidates(q, M, 132) for c in g1 + g2}
    assert scales(p, 16) == {(16, None)}  # decode: the scale on the fp32 product alone
    assert scales(p, 4096) == {(bm, o) for bm in (64, 128) for o in (0, 1)}
    assert scales(problems(["qwen3-30b-a3b"])[0], 4096) == {(bm, o) for bm in (64, 128) for o in (0, 1)}
    assert {o for _, o in scales(problems(["gpt-oss-120b"])[0], 4096)} == {0}  # MXFP4 scales the operand anyway


@pytest.mark.parametrize("layout", ["triton-fast", "marlin"])
@pytest.mark.parametrize("fmt", ["int4-g128", "mxfp4", "int4-g32-asym", "int8-gch", "int4-gch-asym"])
def test_random_layout_tensors_follow_the_layout_plan(layout, fmt):
    p = Problem("small", 4, 2, 256, 256, fmt)
    t = random_layout_tensors(layout, p, "cpu")
    shape = padded_shape(layout, p)
    plan = {s.suffix: s for s in get_layout(layout, p.kind).plan(shape, p.scheme)}
    assert set(t) == set(plan)
    for name, v in t.items():
        assert tuple(v.shape) == tuple(plan[name].shape) and v.dtype == plan[name].dtype, name
        if v.dtype.is_floating_point:
            assert torch.isfinite(v.float()).all(), name


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", [1, 16, 64, 256, 4096])
def test_tuning_candidates_are_valid_configs(name, M):
    p = problems([name])[0]
    fmt, _ = _fmt(p)
    groups = _candidates(p, M, 132)
    assert groups
    for bm, g1, g2 in groups:
        assert g1 and g2
        for c in g1 + g2:
            configs.check_config(c, fmt)
            assert c["BLOCK_M"] == bm
        for c in g1:  # a split never leaves a K split without steps (GEMM1: K = H, GEMM2: K = I)
            assert math.ceil(p.H / c["BLOCK_K"]) >= c["SPLIT_K"]
        for c in g2:
            assert math.ceil(p.I / c["BLOCK_K"]) >= c["SPLIT_K"]
        # split-K is tried only where a GEMM's programs (blocks x column tiles) would not fill 132 SMs
        # 4 times, and always where the 128-column tiles would not fill them twice
        programs = lambda c: min(p.E, M * p.top_k) * math.ceil(p.I / c["BLOCK_N"])
        assert all(bm <= 32 and programs(c) < 4 * 132 for c in g1 if c["SPLIT_K"] > 1)
        if bm <= 32 and programs({"BLOCK_N": 128}) < 2 * 132:
            assert any(c["SPLIT_K"] > 1 for c in g1)


@pytest.mark.parametrize("fmt", ["int4", "int8", "mxfp4"])
@pytest.mark.parametrize("E,k,H,I", [(8, 2, 4096, 14336), (128, 8, 2048, 384), (256, 8, 7168, 2048), (1, 1, 64, 64)])
@pytest.mark.parametrize("M", [1, 7, 64, 300, 8192])
def test_heuristic_configs_are_valid_and_share_block_m(fmt, E, k, H, I, M):
    c1, c2 = configs.heuristic_configs(fmt, E, k, H, I, M)
    configs.check_pair((c1, c2), fmt)
    assert c1["BLOCK_M"] == c2["BLOCK_M"]
    assert math.ceil(H / c1["BLOCK_K"]) >= c1["SPLIT_K"] >= 1 and math.ceil(I / c2["BLOCK_K"]) >= c2["SPLIT_K"] >= 1
    if M == 1 and (E, k, H, I) == (128, 8, 2048, 384):  # 8 blocks x 6 column tiles: 4 splits, 192 programs
        assert c1["SPLIT_K"] == 4


def test_write_table_merges_and_lookup_reads_it(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    c = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=4)
    a, b = "int4/g128 E=4 k=2 H=256 I=128", "int8/gch E=8 k=1 H=128 I=64"
    write_table(path, "Test GPU", {a: {"1": [c, c]}})
    write_table(path, "Test GPU", {b: {"64": [dict(c, BLOCK_M=32), dict(c, BLOCK_M=32)]}})
    data = json.loads(path.read_text())
    assert set(data["entries"]) == {a, b} and data["device"] == "Test GPU"
    monkeypatch.setenv(configs.ENV_TABLE, str(path))
    assert configs.lookup(b, 100, "Test GPU")[0]["BLOCK_M"] == 32
    assert not list(tmp_path.glob("*.tmp"))
    # lookups are kept for the process; writing the table again makes the next one read it
    write_table(path, "Test GPU", {b: {"64": [dict(c, BLOCK_M=64), dict(c, BLOCK_M=64)]}})
    assert configs.lookup(b, 100, "Test GPU")[0]["BLOCK_M"] == 64
    got = configs.lookup(b, 100, "Test GPU")
    got[0]["BLOCK_M"] = 1  # callers get copies
    assert configs.lookup(b, 100, "Test GPU")[0]["BLOCK_M"] == 64


def test_shipped_h200_table_covers_the_bench_shapes_with_valid_configs():
    path = REPO / "kernels" / "tuned" / "nvidia-h200.json"
    data = json.loads(path.read_text())
    assert data["device"] == "NVIDIA H200"
    for p in problems(list(SHAPES)):
        fmt, group = _fmt(p)
        entry = data["entries"][configs.entry_key(fmt, group, p.E, p.top_k, p.H, p.I)]
        assert sorted(int(m) for m in entry) == [1, 16, 64, 256, 4096]
        for c1, c2 in entry.values():
            configs.check_pair([c1, c2], fmt)
            assert math.ceil(p.H / c1["BLOCK_K"]) >= c1["SPLIT_K"] and math.ceil(p.I / c2["BLOCK_K"]) >= c2["SPLIT_K"]


def test_contenders_are_built_and_timed_one_at_a_time(monkeypatch):
    """Each contender's copy of the layer is freed before the next is built (a large layer fits once, not
    once per contender), every contender is timed at every M on the same inputs, and one that cannot be
    built is a note, not a row."""
    import moeconvert.bench.kernel as bk

    live, peak, seen = [0], [0], {}

    class Held:  # stands for a contender's copy of the layer
        def __init__(self):
            live[0] += 1
            peak[0] = max(peak[0], live[0])

        def __del__(self):
            live[0] -= 1

    def builder(name, us):
        def build():
            held = Held()

            def run(x, tw, ids, logits):
                seen.setdefault(name, []).append((x.shape[0], ids.data_ptr()))
                return held and us
            return run, None, held
        return build

    def unavailable():
        raise bk.Unavailable("not installed here")

    monkeypatch.setattr(bk, "graph_us", lambda fn, rep_ms=100: fn())
    p = Problem("tiny", 4, 2, 256, 128, "int4-g128")
    notes: dict = {}
    rows = bk.time_problem(p, [1, 16], {"ours": builder("ours", 10.0), "marlin": builder("marlin", 5.0),
                                        "humming": unavailable}, "cpu", 4e12, 1e15, notes)
    assert peak[0] == 1 and live[0] == 0
    assert [r["M"] for r in rows] == [1, 16] and all(r["us"] == {"ours": 10.0, "marlin": 5.0} for r in rows)
    assert all(r["vs_best_contender"] == 0.5 for r in rows)
    assert seen["ours"] == seen["marlin"]  # the same routing inputs, M by M
    assert notes == {"humming/tiny": "not installed here"}


# ---------------------------------------------------------------------------------------------------
# --tune's selection and --breakdown's steps, on CPU: the real kernel launches under the interpreter,
# with a stand-in for the CUDA-graph timer whose times fall with every call (so the last candidate of
# every sweep is the fastest, and the last BLOCK_M the best)


def _tune_child(out: Path) -> None:
    import moeconvert.bench.kernel as bk
    import moeconvert.kernels.tune as kt

    calls = []

    def falling_time(fn, rep_ms=100):
        fn()
        calls.append(1)
        return 1000.0 - len(calls)

    bk.graph_us = kt.graph_us = falling_time
    p = Problem("tiny", 4, 2, 256, 128, "int4-g128")
    r = bk.tune(p, "cpu", [1, 40], log=lambda *a: None, dtype=torch.float32)
    n_tune = len(calls)
    _, _, weights = bk.ours(p, "cpu")
    steps = bk._steps(p, 40, "cpu", weights, 2, 4e12)
    out.write_text(json.dumps({"tune": r, "calls": n_tune, "steps": steps}))


@pytest.fixture(scope="module")
def tuned_on_cpu(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("tune") / "r.json"
    run_child(__file__, "tune-child", out, timeout=600)
    return json.loads(out.read_text())


def test_tune_keeps_the_fastest_config_of_each_gemm_and_the_best_block_m(tuned_on_cpu):
    p = Problem("tiny", 4, 2, 256, 128, "int4-g128")
    r = tuned_on_cpu["tune"]
    groups = {M: _candidates(p, M, 132) for M in (1, 40)}
    # every candidate ran once, and each BLOCK_M's align once (one token: no align, a block per pair)
    assert tuned_on_cpu["calls"] == sum((M > 1) + len(g1) + len(g2) for M in groups for _, g1, g2 in groups[M])
    assert r["report"]["1"]["align_us"] == 0
    for M, g in groups.items():
        bm, g1, g2 = g[-1]
        assert r["entry"][str(M)] == [g1[-1], g2[-1]]
        rep = r["report"][str(M)]
        assert rep["total_us"] == pytest.approx(rep["align_us"] + rep["gemm1_us"] + rep["gemm2_us"], abs=0.2)
    assert [c["BLOCK_M"] for c in r["entry"]["40"]] == [32, 32]


def test_breakdown_times_each_step_with_the_configs_the_layer_runs(tuned_on_cpu):
    st = tuned_on_cpu["steps"]
    assert st["configs"] == [dict(c) for c in configs.heuristic_configs("int4", 4, 2, 256, 128, 40)]
    assert st["align_us"] > st["gemm1_us"] > st["gemm2_us"] > 0  # the falling stand-in: timed in that order
    # 2 experts touched: w13 = 2 x 2 x 256 x 128 weights at 0.515625 B over 4 TB/s
    assert st["gemm1_floor_us"] == round(2 * 2 * 256 * 128 * 0.515625 / 4e12 * 1e6, 2)
    assert st["gemm2_floor_us"] == round(2 * 256 * 128 * 0.515625 / 4e12 * 1e6, 2)


if __name__ == "__main__" and sys.argv[1:2] == ["tune-child"]:
    _tune_child(Path(sys.argv[2]))
