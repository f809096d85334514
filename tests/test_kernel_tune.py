"""The opt-in tune on first use (kernels/tune.py, ``load(..., tune=True)``, ``$MOECONVERT_KERNEL_TUNE``), on CPU.

The sweep's timings are GPU-only; here a stand-in timer decides which candidate is fastest, and the tests
check what is tuned, under which key, where it is written, and that a table that has the key is left
alone. The key must be the one ``fused_moe_fast`` looks up, so it is compared with the call the kernel makes.
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from moeconvert.errors import MoeConvertError
from moeconvert.kernels import configs
from moeconvert.kernels import tune as kt

from helpers import cli, rel

GPU = "Test GPU"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The user's cache in a temporary folder, no table named by the environment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(configs.ENV_TABLE, raising=False)
    configs.clear_cache()
    yield tmp_path / "cache" / "moeconvert" / "kernel-configs" / "test-gpu.json"
    configs.clear_cache()


@pytest.fixture
def stand_in_timer(monkeypatch):
    """Every GEMM candidate times 10 µs except one GEMM1 and one GEMM2 config per M (5 µs); counts calls."""
    fast = {}  # M -> (GEMM1 config, GEMM2 config) to win
    calls = []

    def align(self, bm):
        return bm, 0.0 if self.M == 1 else 2.0

    def gemm(which):
        def time_it(self, cfg, aligned):
            calls.append((which, self.M))
            assert cfg["BLOCK_M"] == aligned  # each GEMM is timed on the alignment of its own BLOCK_M
            return 5.0 if cfg == fast[self.M][which] else 10.0
        return time_it

    monkeypatch.setattr(kt.StepTimer, "align", align)
    monkeypatch.setattr(kt.StepTimer, "gemm1", gemm(0))
    monkeypatch.setattr(kt.StepTimer, "gemm2", gemm(1))
    return fast, calls


def _weights(fmt="int4", E=4, H=256, I=128, group=128):
    from moeconvert.kernels.moe_fast import FastWeights

    if fmt == "int8":
        return (FastWeights(torch.zeros(E, 2 * I // 16, 16 * H, dtype=torch.uint8), torch.ones(E, H // group, 2 * I)),
                FastWeights(torch.zeros(E, H // 16, 16 * I, dtype=torch.uint8), torch.ones(E, I // group, H)))
    return (FastWeights(torch.zeros(E, 2 * I // 16, 8 * H, dtype=torch.uint8), torch.ones(E, H // group, 2 * I)),
            FastWeights(torch.zeros(E, H // 16, 8 * I, dtype=torch.uint8), torch.ones(E, I // group, H)))


def test_the_shape_is_read_off_the_weights_as_the_kernel_runs_them():
    w13, w2 = _weights("int4", E=4, H=256, I=128)
    s = kt.LayerShape.of(w13, w2, fmt="int4", group=128, top_k=2)
    assert s.key == "int4/g128 E=4 k=2 H=256 I=128"
    w13, w2 = _weights("int8", E=6, H=128, I=64, group=64)
    assert kt.LayerShape.of(w13, w2, fmt="int8", group=-1, top_k=3).key == "int8/gch E=6 k=3 H=128 I=64"


def test_first_use_tunes_writes_the_users_table_and_the_kernel_finds_it(cache, stand_in_timer):
    fast, calls = stand_in_timer
    s = kt.LayerShape("int4", 128, 4, 2, 256, 128)
    # the winners, written by hand from the candidate space of this shape (4 experts, 2 pairs a token)
    fast[1] = (dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, SPLIT_K=2, num_warps=4, num_stages=4),
               dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=6))
    fast[256] = (dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, OPERAND_SCALE=1, num_warps=8,
                      num_stages=3),
                 dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, OPERAND_SCALE=0, num_warps=4,
                      num_stages=3))
    w13, w2 = _weights()
    r = kt.ensure_tuned(s, w13, w2, "cpu", device_name=GPU, ms=(1, 256), log=lambda *a: None)
    assert r["entry"] == {"1": list(fast[1]), "256": list(fast[256])}
    assert r["report"]["1"] == dict(total_us=10.0, align_us=0.0, gemm1_us=5.0, gemm2_us=5.0)
    data = json.loads(cache.read_text())
    assert data["device"] == GPU and data["entries"] == {"int4/g128 E=4 k=2 H=256 I=128": r["entry"]}
    assert configs.lookup(s.key, 1, GPU) == fast[1] and configs.lookup(s.key, 300, GPU) == fast[256]
    # known now: a second first use times nothing
    n = len(calls)
    assert kt.ensure_tuned(s, w13, w2, "cpu", device_name=GPU, ms=(1, 256), log=lambda *a: None) is None
    assert len(calls) == n


def test_a_layer_in_a_named_or_shipped_table_is_not_tuned(cache, stand_in_timer, tmp_path, monkeypatch):
    _, calls = stand_in_timer
    s = kt.LayerShape("mxfp4", 32, 4, 2, 256, 128)
    c = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=4)
    named = tmp_path / "mine.json"
    named.write_text(json.dumps({"entries": {"mxfp4/mx32 E=4 k=2 H=256 I=128": {"16": [c, c]}}}))
    monkeypatch.setenv(configs.ENV_TABLE, str(named))
    assert kt.ensure_tuned(s, *_weights(), "cpu", device_name=GPU, log=lambda *a: None) is None
    assert not calls and not cache.exists()
    # the H200's shipped table holds the bench shapes
    monkeypatch.delenv(configs.ENV_TABLE)
    shipped = kt.LayerShape("int4", 128, 128, 8, 2048, 768)
    assert kt.ensure_tuned(shipped, None, None, "cpu", device_name="NVIDIA H200", log=lambda *a: None) is None
    assert not calls


def _write_many(path: str, who: int, n: int) -> None:
    c = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=4)
    for i in range(n):
        configs.write_table(path, GPU, {f"int4/g128 E={who + 1} k=1 H=256 I={i + 1}": {"1": [c, c]}})


def test_ranks_writing_one_table_at_once_lose_no_entry(tmp_path):
    """The ranks of one model may tune into one GPU's table at the same time: the merge is under a lock."""
    path = tmp_path / "t.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(path), who, 25)) for who in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 75 and not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------------------------------------------
# the runtime: load(..., tune=True)


@pytest.fixture(scope="module")
def padded_mxfp4(example_ckpt, tmp_path_factory):
    """A ``triton-fast`` MXFP4 folder whose H (96) the layout pads to 128."""
    src = example_ckpt(family="qwen3-moe", scheme="bf16", num_layers=1, num_experts=4, hidden_size=96,
                       intermediate_size=64)
    out = tmp_path_factory.mktemp("tune") / "out"
    cli("quantize", src, out, "--format", "mxfp4", "--backend", "triton-fast", expect=0)
    return out


def test_the_runtime_tunes_the_key_fused_moe_fast_looks_up(padded_mxfp4, monkeypatch):
    from moeconvert.runtime import load
    from moeconvert.runtime import moeconvert_triton as mt

    model = load(padded_mxfp4, device="cpu", kernel="reference")
    layer = next(iter(model.moe_layers.values()))
    shape, _, _ = mt.fast_shape(layer)
    assert shape.key == "mxfp4/mx32 E=4 k=2 H=128 I=64"  # H padded as the layout stores it

    asked = []

    class Asked(Exception):
        pass

    def get_configs(fmt, E, top_k, *, H, I, M, group=0, device=None):
        asked.append(configs.entry_key(fmt, group, E, top_k, H, I))
        raise Asked

    monkeypatch.setattr(configs, "get_configs", get_configs)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    tw, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    with pytest.raises(Asked):
        mt.fast_forward(layer, x, tw, ids)
    assert asked == [shape.key]


def test_tune_true_without_cuda_is_refused_in_one_line(padded_mxfp4, cache, monkeypatch):
    from moeconvert.runtime import load

    with pytest.raises(MoeConvertError, match="needs a CUDA device"):
        load(padded_mxfp4, device="cpu", tune=True)
    # the variable is a standing preference: a CPU load goes on untuned and writes nothing
    monkeypatch.setenv(kt.ENV_TUNE, "1")
    assert load(padded_mxfp4, device="cpu", kernel="reference").moe_layers
    assert not cache.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the sweep times CUDA graphs")
def test_load_with_tune_times_real_candidates_and_the_layer_runs_them_gpu(padded_mxfp4, cache):
    """On a GPU: the sweep compiles and times the real candidates, the table gets the layer's key, and the
    layer then runs the tuned tiles and matches the reference."""
    from moeconvert.runtime import load
    from moeconvert.runtime import moeconvert_triton as mt

    name = torch.cuda.get_device_name()
    cache = cache.with_name(f"{configs.device_slug(name)}.json")
    model = load(padded_mxfp4, device="cuda", tune=True)
    layer = next(iter(model.moe_layers.values()))
    assert layer.kernel == "triton"
    shape, _, _ = mt.fast_shape(layer)
    entry = json.loads(cache.read_text())["entries"][shape.key]
    assert sorted(map(int, entry)) == list(kt.MS)
    assert configs.lookup(shape.key, 64, name) == tuple(entry["64"])
    for M in (1, 64):
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, layer.hidden_size, generator=g).to("cuda", torch.bfloat16)
        ids = torch.randint(0, 4, (M, 2), generator=g, dtype=torch.int32).cuda()
        w = torch.rand(M, 2, generator=g).cuda()
        y, want = layer(x, w, ids), layer.reference(x, w, ids)
        assert rel(y, want) < 2e-2  # bf16 activations, as test_kernels_fast's GPU cases


# ---------------------------------------------------------------------------------------------------
# what $MOECONVERT_KERNEL_TUNE and load(tune=) take (docs/kernels.md, "Tuning on first use")


@pytest.mark.parametrize("text,on", [("1", True), ("true", True), ("yes", True), ("TRUE", True), (" Yes ", True),
                                     ("0", False), ("false", False), ("no", False), ("No", False), ("", False),
                                     (None, False)])
def test_the_tune_variable_means_what_the_docs_say(monkeypatch, text, on):
    if text is None:
        monkeypatch.delenv(kt.ENV_TUNE, raising=False)
    else:
        monkeypatch.setenv(kt.ENV_TUNE, text)
    assert kt.tune_wanted() is on and kt.tune_wanted(None) is on
    assert kt.tune_wanted(True) is True and kt.tune_wanted(False) is False  # the argument decides


@pytest.mark.parametrize("text", ["2", "on", "off", "y", "enable", "true1", "1.0", "-1"])
def test_any_other_value_of_the_tune_variable_is_refused_at_load(tmp_path, monkeypatch, text):
    from moeconvert.runtime import load

    monkeypatch.setenv(kt.ENV_TUNE, text)
    with pytest.raises(MoeConvertError) as e:
        load(tmp_path, device="cpu")  # refused before the folder is read, on any device
    line = str(e.value)
    assert "\n" not in line and kt.ENV_TUNE in line and repr(text) in line
    assert all(v in line for v in ("1 | true | yes", "0 | false | no | unset")), line


@pytest.mark.parametrize("tune", ["false", "true", "", 0, 1, "0"])
def test_load_tune_takes_only_true_false_or_none(tmp_path, monkeypatch, tune):
    from moeconvert.runtime import load

    monkeypatch.delenv(kt.ENV_TUNE, raising=False)
    with pytest.raises(MoeConvertError) as e:
        load(tmp_path, device="cpu", tune=tune)
    assert "True | False | None" in str(e.value) and repr(tune) in str(e.value)


def test_an_unwritable_table_is_refused_before_the_sweep(cache, stand_in_timer, tmp_path):
    _, calls = stand_in_timer
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    s = kt.LayerShape("int4", 128, 4, 2, 256, 128)
    with pytest.raises(MoeConvertError, match="cannot write the tuned table"):
        kt.ensure_tuned(s, *_weights(), "cpu", device_name=GPU, table=blocker / "t.json", log=lambda *a: None)
    assert calls == []  # nothing was timed
