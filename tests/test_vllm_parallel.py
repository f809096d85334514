"""One folder, every parallel shape: a folder converted without a partition serves vLLM's EP, TP (where the
layout declares its TP cuts exact), DP + EP and PP, each rank holding exactly what a per-rank conversion
(``repack --tp-size/--tp-rank`` or ``--ep-size/--ep-rank``) writes for it.

The first tests need no vLLM: each layout's declared TP cuts (``Layout.tp_cuts``) against per-rank
conversions, byte for byte, and the shapes where a layout says a cut is not exact are shown to be really
not. The others run vLLM 0.33.0's Python on its CPU platform in N processes on a gloo group
(``vllm_parallel_child.py``): vLLM's own parallel state, its own ``FusedMoEFactory`` (expert map, placement)
or its whole-model loader, the plugin loading the full folder on every rank.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import VLLM_CPU_ENV, cli, st_tensors
from test_vllm_plugin import VLLM_PYTHON, needs_vllm

CHILD = Path(__file__).with_name("vllm_parallel_child.py")

# name: (example arguments, conversion verb and options); sizes chosen so that TP 2 is exact (I / 2 a
# multiple of Marlin's 128-column unit for g128, of 128 for MXFP4)
SCHEMES = {
    "marlin-w4a16-g128": (dict(scheme="w4a16", intermediate_size=512), ["repack", "--backend", "marlin"]),
    "marlin-w4a16-g128-asym": (dict(scheme="w4a16", symmetric=False, intermediate_size=512),
                               ["repack", "--backend", "marlin"]),
    "marlin-w4a16-channel": (dict(scheme="w4a16", group_size=-1, intermediate_size=256),
                             ["repack", "--backend", "marlin"]),
    "marlin-w8a16-g128": (dict(scheme="w8a16", intermediate_size=512), ["repack", "--backend", "marlin"]),
    "marlin-mxfp4": (dict(scheme="bf16", intermediate_size=256), ["quantize", "--format", "mxfp4", "--backend", "marlin"]),
    # triton_kernels' MXFP4 (vLLM's TRITON backend runs swigluoai only: gpt-oss)
    "triton-mxfp4": (dict(scheme="bf16", intermediate_size=256), ["quantize", "--format", "mxfp4", "--backend", "triton"]),
    "triton-w4a16-g128": (dict(scheme="w4a16", intermediate_size=256), ["repack", "--backend", "triton"]),
    "triton-w4a16-g128-asym": (dict(scheme="w4a16", symmetric=False, intermediate_size=256),
                               ["repack", "--backend", "triton"]),
    "triton-w8a16-g128": (dict(scheme="w8a16", intermediate_size=256), ["repack", "--backend", "triton"]),
    # moeconvert's own layout (its Triton kernel as vLLM modular experts): I / 2 a multiple of 64
    "fast-w4a16-g128": (dict(scheme="w4a16", intermediate_size=256), ["repack", "--backend", "triton-fast"]),
    "fast-w4a16-g32-asym": (dict(scheme="w4a16", group_size=32, symmetric=False, intermediate_size=256),
                            ["repack", "--backend", "triton-fast"]),
    "fast-w4a16-channel": (dict(scheme="w4a16", group_size=-1, intermediate_size=256),
                           ["repack", "--backend", "triton-fast"]),
    "fast-w8a16-g128": (dict(scheme="w8a16", intermediate_size=256), ["repack", "--backend", "triton-fast"]),
    "fast-mxfp4": (dict(scheme="bf16", intermediate_size=256), ["quantize", "--format", "mxfp4", "--backend", "triton-fast"]),
    # compressed-tensors NVFP4 on Marlin: no TP rank is a slice (each rank padded and scaled on its own)
    "marlin-nvfp4": (dict(scheme="nvfp4", intermediate_size=256), ["repack", "--backend", "marlin"]),
    # the other source formats (``int_method``: GPTQ / AWQ made from the bf16 example by helpers.make_int_checkpoint):
    # the same layouts, the source's quantization config kept for every other layer
    "marlin-gptq": (dict(scheme="bf16", intermediate_size=512, int_method="gptq", group_size=32),
                    ["repack", "--backend", "marlin"]),
    "marlin-awq": (dict(scheme="bf16", intermediate_size=512, int_method="awq", group_size=64),
                   ["repack", "--backend", "marlin"]),
    "marlin-mxfp4-ct": (dict(scheme="mxfp4", intermediate_size=256), ["repack", "--backend", "marlin"]),
    # humming: no TP rank is a slice (each rank's sublayers padded and tiled on their own)
    "humming-gptq": (dict(scheme="bf16", intermediate_size=512, int_method="gptq", group_size=32),
                     ["repack", "--backend", "humming"]),
    "humming-nvfp4": (dict(scheme="nvfp4", intermediate_size=256), ["repack", "--backend", "humming"]),
}


def _source(example_ckpt, family: str, kw: dict) -> Path:
    """The checkpoint a scheme converts: the example itself, or its GPTQ / AWQ copy."""
    from helpers import make_int_checkpoint

    kw = dict(kw)
    method, group = kw.pop("int_method", None), kw.pop("group_size", None)
    if method is None:
        return example_ckpt(family, **kw, **({} if group is None else {"group_size": group}))
    bf16 = example_ckpt(family, **kw)
    out = bf16.parent / f"{method}-g{group}"
    if not (out / "config.json").exists():
        make_int_checkpoint(bf16, out, method, bits=4, group_size=group)
    return out


def _convert(example_ckpt, base: Path, family: str, scheme: str, *extra) -> Path:
    kw, verb = SCHEMES[scheme]
    src = _source(example_ckpt, family, kw)
    out = base / "-".join([family, scheme, *(str(x).strip("-") for x in extra)])
    if not (out / "moeconvert.json").exists():
        cli(verb[0], src, out, *verb[1:], *extra, expect=0)
    return out


@pytest.fixture(scope="module")
def convert(example_ckpt, tmp_path_factory):
    base = tmp_path_factory.mktemp("parallel")
    return lambda family, scheme, *extra: _convert(example_ckpt, base, family, scheme, *extra)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "moeconvert.json").read_text())


def _layout_and_shape(manifest: dict, entry: dict):
    from moeconvert.layouts.output import layer_shape_from_manifest, parse_scheme
    from moeconvert.layouts import get_layout

    scheme = parse_scheme(entry["scheme"], "scheme")
    return get_layout(manifest["layout"]["name"], scheme.kind), layer_shape_from_manifest(entry, manifest["dtype"]), scheme


# ---------------------------------------------------------------------------------------------------
# the layouts' TP cuts, without vLLM


# (family, scheme): every layout the plugin serves, gpt-oss's (interleaved w13 rows, expert biases) included
CUT_CASES = [("qwen3-moe", s) for s in sorted(SCHEMES) if s not in ("triton-mxfp4", "marlin-nvfp4")
             and not s.startswith("humming")]
CUT_CASES += [("gpt-oss", "marlin-mxfp4"), ("gpt-oss", "triton-mxfp4"), ("gpt-oss", "fast-mxfp4")]


@pytest.mark.parametrize("family,scheme", CUT_CASES)
def test_each_layouts_tp_cut_of_a_full_folder_is_the_per_rank_conversion(convert, family, scheme):
    """Byte for byte; gpt-oss's w2 bias is rank 0's alone (the other rank's conversion holds zeros, as vLLM's
    gpt-oss loader zeroes it there)."""
    full = convert(family, scheme)
    files, manifest = st_tensors(full), _manifest(full)
    for rank in range(2):
        ranked = convert(family, scheme, "--tp-size", "2", "--tp-rank", str(rank))
        want = st_tensors(ranked)
        for entry in manifest["moe_layers"]:
            layout, shape, s = _layout_and_shape(manifest, entry)
            cuts = layout.tp_cuts(shape, s, 2)
            assert isinstance(cuts, dict), cuts
            assert set(cuts) == set(entry["tensors"])
            for suffix, t in entry["tensors"].items():
                got = cuts[suffix].take(files[t["name"]], 2, rank)
                assert got.shape == want[t["name"]].shape, (suffix, rank)
                assert torch.equal(got.view(torch.uint8), want[t["name"]].contiguous().view(torch.uint8)), (suffix, rank)


def test_every_layout_the_plugin_serves_declares_its_tp_cuts():
    """A layout vLLM serves states, for itself, whether a TP rank is a slice of its full tensors; the base
    class's answer (not declared) would silently refuse every TP size."""
    from moeconvert.layouts import _registry
    from moeconvert.layouts.base import Layout

    served = [cls for classes in _registry().values() for cls in classes if cls.vllm_method]
    assert served and all(cls.tp_cuts is not Layout.tp_cuts for cls in served), served
    # the layouts SCHEMES above proves the cuts of: every served one but humming's (WNA16, MXFP4, NVFP4) and
    # Marlin NVFP4, which declare that no TP rank is a slice of their full tensors (each rank is padded and tiled, or
    # scaled, on its own)
    assert {cls.__name__ for cls in served} == {"MarlinLayout", "MarlinMXFP4Layout", "TritonWNA16Layout",
                                                "TritonMXFP4Layout", "HummingLayout", "HummingMXFP4Layout",
                                                "TritonFastWNA16Layout", "TritonFastMXFP4Layout",
                                                "MarlinNVFP4Layout", "HummingNVFP4Layout"}
    from moeconvert.canonical import LayerShape
    from moeconvert.layouts import get_layout
    from moeconvert.layouts.base import NotASlice
    from moeconvert.schemes import MXFP4Scheme, WNA16Scheme

    cut = get_layout("humming", "wna16").tp_cuts(LayerShape(8, 256, 256, dtype="bfloat16"),
                                                  WNA16Scheme(4, 128, True, "bfloat16"), 2)
    assert isinstance(cut, NotASlice) and cut.convertible and "pads and tiles each rank's sublayers" in str(cut)
    cut = get_layout("humming", "mxfp4").tp_cuts(LayerShape(8, 256, 256, dtype="bfloat16"), MXFP4Scheme(), 2)
    assert isinstance(cut, NotASlice) and cut.convertible and "pads and tiles each rank's sublayers" in str(cut)
    from moeconvert.schemes import NVFP4Scheme

    cut = get_layout("humming", "nvfp4").tp_cuts(LayerShape(8, 256, 256, dtype="bfloat16"), NVFP4Scheme(), 2)
    assert isinstance(cut, NotASlice) and cut.convertible and "pads and tiles each rank's sublayers" in str(cut)
    cut = get_layout("marlin", "nvfp4").tp_cuts(LayerShape(8, 256, 256, dtype="bfloat16"), NVFP4Scheme(), 2)
    assert isinstance(cut, NotASlice) and cut.convertible and "pads each rank's NVFP4 I on its own" in str(cut)


# (scheme, example sizes, what the layout says): shapes where a rank's tensors are not a slice
NOT_A_SLICE = {
    "marlin-one-w2-group": ("marlin-w4a16-g128", dict(intermediate_size=256), "holds one w2 scale group"),
    "marlin-rank-padded": ("marlin-w4a16-channel", dict(intermediate_size=192), "is padded to 128 for Marlin's thread tile"),
    "mxfp4-rank-padded": ("marlin-mxfp4", dict(intermediate_size=128), "is padded to 128 (a multiple of 128)"),
}


@pytest.mark.parametrize("case", sorted(NOT_A_SLICE))
def test_where_a_layout_says_a_tp_rank_is_not_a_slice_it_is_not(example_ckpt, tmp_path, case):
    """The refusal is not caution: cutting the full tensors the way an exact shape is cut gives other
    bytes than the per-rank conversion."""
    from moeconvert.layouts.base import TPCut

    scheme, sizes, why = NOT_A_SLICE[case]
    kw, verb = SCHEMES[scheme]
    src = _source(example_ckpt, "qwen3-moe", {**kw, **sizes})
    cli(verb[0], src, tmp_path / "full", *verb[1:], expect=0)
    manifest = _manifest(tmp_path / "full")
    entry = manifest["moe_layers"][0]
    layout, shape, s = _layout_and_shape(manifest, entry)
    reason = layout.tp_cuts(shape, s, 2)
    assert not isinstance(reason, dict) and why in reason.reason and reason.convertible, reason
    cli(verb[0], src, tmp_path / "r0", *verb[1:], "--tp-size", "2", "--tp-rank", "0", expect=0)
    full, rank0 = st_tensors(tmp_path / "full"), st_tensors(tmp_path / "r0")
    naive = {"w13_weight": TPCut(2, runs=2), "w2_weight": TPCut(1), "w13_weight_scale": TPCut(2, runs=2),
             "w2_weight_scale": TPCut(1)}
    differs = []
    for suffix, cut in naive.items():
        name = entry["tensors"][suffix]["name"]
        a, b = full[name], rank0[name]
        try:
            got = cut.take(a, 2, 0)
        except RuntimeError:
            differs.append(suffix)
            continue
        if got.shape != b.shape or not torch.equal(got.view(torch.uint8), b.contiguous().view(torch.uint8)):
            differs.append(suffix)
    assert differs, "the layout refuses a TP cut that is exact"


# ---------------------------------------------------------------------------------------------------
# vLLM on N processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Ranks:
    """``world`` vLLM processes on the CPU platform (tests/vllm_parallel_child.py), started once for the module
    and given one shape after another: vLLM's import (about 11 s a process) is paid once, not per shape. A
    shape that does not answer within the timeout stops them; the next shape starts new ones."""

    def __init__(self, tmp: Path, world: int = 2, *flags: str):
        self.tmp, self.world, self.flags, self.procs, self.logs = tmp, world, flags, [], []

    def start(self) -> None:
        # moeconvert's kernel (triton-fast folders' forward) runs on the CPU interpreted only; the other
        # shapes run no kernel
        env = {**os.environ, **VLLM_CPU_ENV, "MASTER_ADDR": "127.0.0.1", "TRITON_INTERPRET": "1"}
        self.logs = [open(self.tmp / f"rank{r}-{_free_port()}.log", "w+") for r in range(self.world)]
        self.procs = [subprocess.Popen([VLLM_PYTHON, str(CHILD), str(r), str(self.world), *self.flags], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=log, text=True, env=env)
                      for r, log in enumerate(self.logs)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        for log in self.logs:
            log.close()
        self.procs, self.logs = [], []

    def _stderr(self, r: int) -> str:
        self.logs[r].flush()
        return Path(self.logs[r].name).read_text()[-3000:]

    def run(self, folder: Path, shape: dict, timeout: float = 600) -> list[dict]:
        if not self.procs or any(p.poll() is not None for p in self.procs):
            self.stop()
            self.start()
        job = json.dumps({"folder": str(folder), "port": _free_port(), "shape": shape}) + "\n"
        for p in self.procs:
            p.stdin.write(job)
            p.stdin.flush()
        outs, deadline = [], time.monotonic() + timeout
        for r, p in enumerate(self.procs):
            while True:
                ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = p.stdout.readline() if ready else ""
                if not line:  # timed out, or the process ended
                    why = "timed out" if p.poll() is None else f"exited with {p.returncode}"
                    err = self._stderr(r)
                    self.stop()
                    raise AssertionError(f"rank {r} {why} on {shape}: {err}")
                if line.startswith(RESULT):
                    outs.append(json.loads(line[len(RESULT):]))
                    break
        return outs


RESULT = "RESULT "  # the child's answer line (tests/vllm_parallel_child.py)


@pytest.fixture(scope="module")
def rank_pools(tmp_path_factory):
    """The ranks for every folder but humming's, and the ranks that answer as an SM90 GPU for humming's
    (tests/vllm_plugin_child.py ``_humming_on_a_cpu``)."""
    base = tmp_path_factory.mktemp("ranks")
    pools = {False: _Ranks(base), True: _Ranks(base, 2, "--humming")}
    yield pools
    for pool in pools.values():
        pool.stop()


@pytest.fixture
def _ranks(rank_pools):
    """``_ranks(folder, tmp_path, **shape)``: every rank of ``shape`` (``mode`` "layers" or "model", ``tp``,
    ``pp``, ``dp``, ``ep``, ``placement``, ``redundant``, ``load_format``, ``forward``) run at once, each in
    its vLLM process; what each reports."""
    def run(folder: Path, tmp_path: Path, **shape) -> list[dict]:
        humming = _manifest(folder)["layout"]["name"] == "humming"
        return rank_pools[humming].run(folder, {"mode": "layers", **shape})

    return run


def _sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def _expected(convert, family: str, scheme: str, experts: list[int], ep_size: int, tp=(1, 0)) -> dict[str, dict]:
    """What a rank holding global ``experts`` (in slot order) at TP rank ``tp`` must hold, per layer prefix and
    tensor suffix, from conversions made for it: the ``--ep-size/--ep-rank`` conversion whose experts these
    are (vLLM's linear placement), else one ``--ep-size E --ep-rank e`` conversion per expert, stacked in
    slot order; ``--tp-size/--tp-rank`` for a TP rank."""
    manifest = _manifest(convert(family, scheme))
    E = manifest["moe_layers"][0]["num_experts_global"]
    tp_args = ["--tp-size", str(tp[0]), "--tp-rank", str(tp[1])] if tp[0] > 1 else []
    for r in range(ep_size):
        base, rem = divmod(E, ep_size)
        start = r * base + min(r, rem)
        if experts == list(range(start, start + base + (r < rem))):
            args = (["--ep-size", str(ep_size), "--ep-rank", str(r)] if ep_size > 1 else []) + tp_args
            folder = convert(family, scheme, *args)
            files = st_tensors(folder)
            return {m["prefix"]: {s: files[t["name"]] for s, t in m["tensors"].items()}
                    for m in _manifest(folder)["moe_layers"]}
    singles = {e: convert(family, scheme, "--ep-size", str(E), "--ep-rank", str(e), *tp_args) for e in set(experts)}
    files = {e: st_tensors(f) for e, f in singles.items()}
    return {m["prefix"]: {s: torch.cat([files[e][t["name"]] for e in experts]) for s, t in m["tensors"].items()}
            for m in _manifest(singles[experts[0]])["moe_layers"]}


def _assert_holds(got: dict, want: dict, what: str) -> None:
    assert "error" not in got, got["error"]
    assert sorted(got["layers"]) == sorted(want), what
    for prefix, layer in got["layers"].items():
        assert set(layer["params"]) == set(want[prefix]) and layer["loaded"] == sorted(want[prefix]), (what, prefix)
        for suffix, t in want[prefix].items():
            param = layer["params"][suffix]
            assert param["shape"] == list(t.shape), (what, prefix, suffix)
            assert param["sha256"] == _sha(t), (what, prefix, suffix)


# One case per plugin method and placement fact: which bytes each expert holds is the layout's own fact,
# tested without vLLM (test_layout_contract.py, the --ep-size conversions below), so schemes are not repeated.
EP_CASES = [  # family, scheme, placement asked for, placement vLLM takes
    ("qwen3-moe", "marlin-w4a16-g128", "linear", "linear"),
    # vLLM places round-robin only for grouped routing (DeepSeek-V3); Qwen3 falls back to linear
    ("qwen3-moe", "marlin-w4a16-g128", "round_robin", "linear"),
    ("deepseek-v3", "marlin-w4a16-g128", "round_robin", "round_robin"),
    ("deepseek-v3", "triton-w4a16-g128", "round_robin", "round_robin"),
    ("deepseek-v3", "fast-w8a16-g128", "round_robin", "round_robin"),
    # each rank's experts give the layer's NVFP4 scale factor (Layout.experts_problem finds nothing)
    ("qwen3-moe", "marlin-nvfp4", "linear", "linear"),
    # the other source formats, under their own quantization configs
    ("qwen3-moe", "marlin-gptq", "linear", "linear"),
    ("qwen3-moe", "marlin-awq", "linear", "linear"),
    ("qwen3-moe", "marlin-mxfp4-ct", "linear", "linear"),
    ("qwen3-moe", "humming-gptq", "linear", "linear"),
    ("qwen3-moe", "humming-nvfp4", "linear", "linear"),
]


@needs_vllm
@pytest.mark.parametrize("family,scheme,asked,placed", EP_CASES)
def test_ep2_from_a_full_folder_each_rank_holds_its_experts(_ranks, convert, tmp_path, family, scheme, asked, placed):
    """``--enable-expert-parallel`` on 2 ranks (TP 2 becomes EP 2): each rank's parameters hold the bytes of
    the conversion made for its experts, which vLLM's own expert map names."""
    full = convert(family, scheme)
    ranks = _ranks(full, tmp_path, tp=2, ep=True, placement=asked)
    E = _manifest(full)["moe_layers"][0]["num_experts_global"]
    for r, got in enumerate(ranks):
        assert "error" not in got, got["error"]
        layer = next(iter(got["layers"].values()))
        assert layer["placement"] == placed and layer["ep"] == [2, r] and layer["tp"] == [1, 0]
        experts = layer["physical_experts"]
        assert experts == (list(range(r, E, 2)) if placed == "round_robin" else list(range(r * E // 2, (r + 1) * E // 2)))
        _assert_holds(got, _expected(convert, family, scheme, experts, 2), f"rank {r}")


# One case per plugin method (and MXFP4 beside int): each scheme's cuts are checked against per-rank
# conversions without vLLM (CUT_CASES above); here, that the plugin applies a layout's declared cuts.
TP_CASES = [("qwen3-moe", s) for s in ("marlin-w4a16-g128", "marlin-mxfp4", "fast-w4a16-g32-asym", "fast-mxfp4")]
TP_CASES += [("deepseek-v3", "triton-w8a16-g128"), ("qwen3-moe", "marlin-gptq"), ("qwen3-moe", "marlin-awq"),
             ("qwen3-moe", "marlin-mxfp4-ct")]


@needs_vllm
@pytest.mark.parametrize("family,scheme", TP_CASES)
def test_tp2_from_a_full_folder_each_rank_holds_its_tp_conversion(_ranks, convert, tmp_path, family, scheme):
    """TP 2 without EP, served from the full folder by the layout's declared cuts: each rank's parameters
    hold the bytes of ``--tp-size 2 --tp-rank r``."""
    full = convert(family, scheme)
    E = _manifest(full)["moe_layers"][0]["num_experts_global"]
    for r, got in enumerate(_ranks(full, tmp_path, tp=2)):
        assert "error" not in got, got["error"]
        assert all(layer["tp"] == [2, r] for layer in got["layers"].values())
        _assert_holds(got, _expected(convert, family, scheme, list(range(E)), 1, tp=(2, r)), f"rank {r}")


# moeconvert's kernel (triton-fast) run by each rank: (family, scheme, shape)
# one EP and one TP shape: the kernel's int8 and MXFP4 paths are tested against the reference on their own
# (test_kernels_fast.py)
FAST_FORWARD = [("deepseek-v3", "fast-w4a16-g128", dict(tp=2, ep=True, placement="round_robin")),
                ("qwen3-moe", "fast-w4a16-g32-asym", dict(tp=2))]


@needs_vllm
@pytest.mark.parametrize("family,scheme,shape", FAST_FORWARD, ids=["fast-ep2-round-robin", "fast-tp2"])
def test_the_ranks_run_moeconverts_kernel_and_their_outputs_sum_to_the_reference(_ranks, convert, example_ckpt, tmp_path,
                                                                                family, scheme, shape):
    """Each rank's ``MoeconvertFastExperts`` (under Triton's interpreter) on the same 5 routed tokens: an EP rank
    adds only its experts' pairs (ids mapped through vLLM's expert map, round-robin included), a TP rank its
    slice of I; the two outputs sum, as vLLM's all-reduce sums them, to ``reference_moe`` on the source's own
    weights."""
    full = convert(family, scheme)
    src = example_ckpt(family, **SCHEMES[scheme][0])  # the checkpoint the folder was converted from
    ranks = _ranks(full, tmp_path, forward=str(src), **shape)
    for got in ranks:
        assert "error" not in got, got["error"]
    for prefix in ranks[0]["layers"]:
        outs = [torch.tensor(got["layers"][prefix]["forward"]["y"]) for got in ranks]
        want = torch.tensor(ranks[0]["layers"][prefix]["forward"]["want"])
        assert want.norm() > 0 and all(o.isfinite().all() and o.norm() > 0 for o in outs), prefix
        assert float((sum(outs) - want).norm() / want.norm()) < 2e-2, prefix
        # neither rank alone holds the layer
        assert all(float((o - want).norm() / want.norm()) > 0.1 for o in outs), prefix


@needs_vllm
@pytest.mark.parametrize("family,mode,scheme", [("deepseek-v3", "layers", "marlin-w4a16-g128"),
                                               ("qwen3-moe", "model", "fast-w4a16-g32-asym")])
def test_dp2_with_ep_each_rank_holds_its_ep_conversion(_ranks, convert, tmp_path, family, mode, scheme):
    """``--data-parallel-size 2 --enable-expert-parallel``: vLLM folds DP into EP (EP 2 = DP 2 x TP 1); on
    Qwen3 through vLLM's whole-model loader, as ``vllm serve`` loads it."""
    full = convert(family, scheme)
    E = _manifest(full)["moe_layers"][0]["num_experts_global"]
    for r, got in enumerate(_ranks(full, tmp_path, mode=mode, dp=2, ep=True)):
        assert "error" not in got, got["error"]
        layer = next(iter(got["layers"].values()))
        assert layer["ep"] == [2, r] and layer["tp"] == [1, 0]
        experts = list(range(r * E // 2, (r + 1) * E // 2))
        assert layer["physical_experts"] == experts
        _assert_holds(got, _expected(convert, family, scheme, experts, 2), f"rank {r}")


@needs_vllm
@pytest.mark.parametrize("scheme", ["marlin-w4a16-g128"])  # which layers a rank builds is no layout's fact
def test_pp2_each_rank_builds_and_loads_only_its_layers(_ranks, convert, tmp_path, scheme):
    """``--pipeline-parallel-size 2`` through vLLM's whole-model loader: each rank builds its half of the
    layers, and each MoE layer it builds holds the folder's tensors (TP 1, EP 1) unchanged."""
    full = convert("qwen3-moe", scheme)
    files, manifest = st_tensors(full), _manifest(full)
    ranks = _ranks(full, tmp_path, mode="model", pp=2)
    for got in ranks:
        assert "error" not in got, got["error"]
    held = [sorted(got["layers"]) for got in ranks]
    prefixes = [m["prefix"] for m in manifest["moe_layers"]]
    assert held == [prefixes[:len(prefixes) // 2], prefixes[len(prefixes) // 2:]]
    for r, got in enumerate(ranks):
        want = {m["prefix"]: {s: files[t["name"]] for s, t in m["tensors"].items()}
                for m in manifest["moe_layers"] if m["prefix"] in got["layers"]}
        _assert_holds(got, want, f"rank {r}")


@needs_vllm
def test_eplb_redundant_experts_are_copies_of_their_logical_experts(_ranks, convert, tmp_path):
    """EPLB with 2 redundant experts on EP 2 (Triton WNA16, whose vLLM method allows EPLB): physical expert
    ``E + j`` is a copy of logical expert ``j`` (vLLM's initial arrangement, eplb_state.py), so rank 1 holds
    physical 5..9 = logical 5, 6, 7, 0, 1, each from its own conversion."""
    full = convert("deepseek-v3", "triton-w4a16-g128")
    E = _manifest(full)["moe_layers"][0]["num_experts_global"]
    for r, got in enumerate(_ranks(full, tmp_path, tp=2, ep=True, redundant=2)):
        assert "error" not in got, got["error"]
        layer = next(iter(got["layers"].values()))
        physical = layer["physical_experts"]
        assert layer["global_num_experts"] == E + 2 and physical == list(range(r * 5, r * 5 + 5))
        logical = [p if p < E else (p - E) % E for p in physical]
        _assert_holds(got, _expected(convert, "deepseek-v3", "triton-w4a16-g128", logical, 2), f"rank {r}")


GPT_OSS_SHAPES = {  # name: vLLM's parallel flags (2 ranks), through the whole model as `vllm serve` loads it
    "ep2": dict(tp=2, ep=True),
    "tp2": dict(tp=2),
    "dp2-ep2": dict(dp=2, ep=True),
    "pp2": dict(pp=2),
}


# every shape on Marlin; triton_kernels' layout where its cuts differ (EP, TP), not for what PP and DP add
GPT_OSS_CASES = [("marlin-mxfp4", s) for s in sorted(GPT_OSS_SHAPES)] + [("triton-mxfp4", "ep2"), ("triton-mxfp4", "tp2")]


@needs_vllm
@pytest.mark.parametrize("scheme,shape", GPT_OSS_CASES)
def test_gpt_oss_each_rank_holds_its_conversion_with_the_moeconvert_load_format(_ranks, convert, tmp_path, scheme, shape):
    """gpt-oss with ``--load-format moeconvert`` (its only load format): vLLM's whole model on 2 ranks, each
    rank's expert parameters hold the bytes of the conversion made for it: its experts (``--ep-size
    --ep-rank``), its TP rank (``--tp-size --tp-rank``: w13 and its bias cut, w2's bias on rank 0 only, zeros
    on rank 1, as vLLM's gpt-oss loader holds it), or at PP 2 its layer of the full folder unchanged. The
    kernels need CUDA; the forward runs in tests/test_vllm_plugin.py's GPU tests."""
    full = convert("gpt-oss", scheme)
    manifest = _manifest(full)
    E = manifest["moe_layers"][0]["num_experts_global"]
    flags = GPT_OSS_SHAPES[shape]
    ranks = _ranks(full, tmp_path, mode="model", load_format="moeconvert", **flags)
    prefixes = [m["prefix"] for m in manifest["moe_layers"]]
    for r, got in enumerate(ranks):
        assert "error" not in got, got["error"]
        if shape == "pp2":
            files = st_tensors(full)
            assert sorted(got["layers"]) == [prefixes[r]]
            want = {m["prefix"]: {s: files[t["name"]] for s, t in m["tensors"].items()}
                    for m in manifest["moe_layers"] if m["prefix"] == prefixes[r]}
        elif flags.get("ep"):
            layer = next(iter(got["layers"].values()))
            experts = list(range(r * E // 2, (r + 1) * E // 2))
            assert layer["ep"] == [2, r] and layer["tp"] == [1, 0] and layer["physical_experts"] == experts
            want = _expected(convert, "gpt-oss", scheme, experts, 2)
        else:
            assert all(layer["tp"] == [2, r] for layer in got["layers"].values())
            want = _expected(convert, "gpt-oss", scheme, list(range(E)), 1, tp=(2, r))
            assert all(bool(t["w2_bias"].any()) == (r == 0) for t in want.values())  # rank 0's alone
        _assert_holds(got, want, f"{shape} rank {r}")


REFUSED = {  # case: (folder, shape, the one line's telling part)
    "eplb-on-marlin": (("deepseek-v3", "marlin-w4a16-g128"), dict(tp=2, ep=True, redundant=2),
                       "MarlinWNA16Method (vLLM's Marlin MoE kernel) cannot follow it: vLLM 0.33.0 moves experts "
                       "between ranks only for kernels whose own MoE method supports it, and its Marlin WNA16 method "
                       "does not (CompressedTensorsWNA16MoEMethod.supports_eplb is TRITON only): serve without "
                       "--enable-eplb, or convert with --backend triton (moeconvert repack "),
    "tp-not-a-slice": (("qwen3-moe", "marlin-w4a16-g128", dict(intermediate_size=256)), dict(tp=2),
                       "a marlin TP rank of 2 is not a slice of them (a TP rank holds one w2 scale group"),
    "tp-stored-default-loader": (("qwen3-moe", "marlin-w4a16-g128", dict(intermediate_size=256), "--tp-sizes", "1,2"),
                                 dict(tp=2), "the folder stores its TP 2 rank tensors beside the full ones, which only "
                                 "moeconvert's model loader reads: serve with --load-format moeconvert"),
    "one-rank-folder": (("qwen3-moe", "marlin-w4a16-g128", "--ep-size", "2", "--ep-rank", "0"), dict(tp=2),
                        "this folder was converted for TP 1 rank 0, EP 2 rank 0; this vLLM builds the layer for TP 2"),
    "fast-eplb": (("deepseek-v3", "fast-w4a16-g128"), dict(tp=2, ep=True, redundant=2),
                  "TritonFastMethod (moeconvert's Triton kernel) cannot follow it: moeconvert's triton-fast experts "
                  "have not been run with vLLM's expert rebalancing: serve without --enable-eplb, or convert with "
                  "--backend triton (moeconvert repack "),
    # I 192 in groups of 32: a TP rank's I 96 is not whole 64-input fragment atoms
    "fast-tp-no-rank-holds": (("qwen3-moe", "fast-w4a16-g32-asym", dict(intermediate_size=192)), dict(tp=2),
                              "a triton-fast TP rank of 2 is not a slice of them (a TP rank of 2 cannot hold this "
                              "layer: intermediate_size I (per TP partition) = 96 must be a multiple of 64"),
    "gpt-oss-default-loader": (("gpt-oss", "triton-mxfp4"), dict(mode="model", tp=2, ep=True),
                               "a gpt-oss folder is served with --load-format moeconvert only (vLLM's gpt-oss loader "
                               "slices and transposes every tensor named w13_weight / w2_weight itself"),
}


@needs_vllm
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_shapes_a_folder_does_not_cover_are_refused_in_one_line(_ranks, convert, example_ckpt, tmp_path, case):
    what, shape, want = REFUSED[case]
    if len(what) > 2 and isinstance(what[2], dict):  # a folder of other sizes (and options)
        kw, verb = SCHEMES[what[1]]
        folder = tmp_path / "full"
        cli(verb[0], _source(example_ckpt, what[0], {**kw, **what[2]}), folder, *verb[1:], *what[3:], expect=0)
    else:
        folder = convert(*what)
    for r, got in enumerate(_ranks(folder, tmp_path, **shape)):
        assert "\n" not in got["error"] and want in got["error"], got["error"]
        assert got["error"].startswith("ValueError: moeconvert: model.layers.")
        if case == "tp-not-a-slice":  # names the conversion that adds this TP size to the folder
            assert got["error"].endswith("--backend marlin --tp-sizes 1,2"), got["error"]
        assert got["layers"] == {}


# ---------------------------------------------------------------------------------------------------
# --load-format moeconvert: each rank reads only its bytes


@needs_vllm
@pytest.mark.parametrize("shape", [dict(tp=2, ep=True), dict(tp=2), dict(dp=2, ep=True)],
                         ids=["ep2", "tp2", "dp2-ep2"])
def test_each_rank_reads_only_its_experts_with_the_moeconvert_load_format(_ranks, convert, tmp_path, shape):
    """vLLM's whole-model load with ``--load-format moeconvert`` (the plugin's registered model loader):
    each rank's expert parameters hold its per-rank conversion's bytes, and what the process read while
    loading (the kernel's rchar counter in /proc/self/io) is the rank's share of the stacked tensors plus
    every other tensor, give or take the shard headers and a few KiB: never the other rank's experts."""
    full = convert("qwen3-moe", "marlin-w4a16-g128")
    manifest = _manifest(full)
    rest, headers = _stacked_and_rest(full)
    E = manifest["moe_layers"][0]["num_experts_global"]
    ranks = _ranks(full, tmp_path, mode="model", load_format="moeconvert", **shape)
    for r, got in enumerate(ranks):
        assert "error" not in got, got["error"]
        if shape.get("ep"):
            want = _expected(convert, "qwen3-moe", "marlin-w4a16-g128", list(range(r * E // 2, (r + 1) * E // 2)), 2)
        else:
            want = _expected(convert, "qwen3-moe", "marlin-w4a16-g128", list(range(E)), 1, tp=(2, r))
        _assert_holds(got, want, f"rank {r}")
        share = sum(t.numel() * t.element_size() for layer in want.values() for t in layer.values())
        assert share + rest <= got["read_bytes"] <= share + rest + headers + 64 * 1024, (r, got["read_bytes"], share, rest)


# ---------------------------------------------------------------------------------------------------
# --tp-sizes: a TP size the layout cannot cut, stored in the same folder


STORED_TP = {  # case: (scheme, example sizes where a TP 2 rank is not a slice of the full tensors)
    "marlin-channel-rank-padded": ("marlin-w4a16-channel", dict(intermediate_size=192)),
    "marlin-g128-one-w2-group": ("marlin-w4a16-g128", dict(intermediate_size=256)),
    "marlin-mxfp4-rank-padded": ("marlin-mxfp4", dict(intermediate_size=128)),
    # humming: every TP size is stored (vLLM's CPU platform builds no NVFP4 / MXFP4 linear layer, so the whole
    # model is loaded from a GPTQ source; humming-nvfp4's EP case above builds its MoE layers alone)
    "humming-gptq": ("humming-gptq", {}),
}


def _stacked_and_rest(full: Path) -> tuple[int, int]:
    """(bytes of every tensor but the stacked expert tensors, bytes of the shards' headers)."""
    import struct

    from moeconvert.format.manifest import layer_tensor_entries

    manifest = _manifest(full)
    stacked = {e["name"] for i, m in enumerate(manifest["moe_layers"]) for _, e in layer_tensor_entries(m, i)}
    rest = headers = 0
    for shard in full.glob("*.safetensors"):
        n = struct.unpack("<Q", shard.read_bytes()[:8])[0]
        headers += 8 + n
        header = json.loads(shard.read_bytes()[8:8 + n])
        rest += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                    if k != "__metadata__" and k not in stacked)
    return rest, headers


@needs_vllm
@pytest.mark.parametrize("case", sorted(STORED_TP))
def test_tp2_stored_by_tp_sizes_each_rank_reads_only_its_conversion(_ranks, example_ckpt, tmp_path, case):
    """``convert --tp-sizes 1,2`` where Marlin cannot cut TP 2 out of the full tensors, then vLLM's whole-model
    load at TP 2 with ``--load-format moeconvert``: each rank's parameters hold ``--tp-size 2 --tp-rank r``'s
    bytes, read from the rank's stored block and nothing of the other rank's or of the full tensors."""
    scheme, sizes = STORED_TP[case]
    kw, verb = SCHEMES[scheme]
    src = _source(example_ckpt, "qwen3-moe", {**kw, **sizes})
    full = tmp_path / "full"
    cli(verb[0], src, full, *verb[1:], "--tp-sizes", "1,2", expect=0)
    assert all(m["tp_sizes"]["2"]["stored"] for m in _manifest(full)["moe_layers"])
    rest, headers = _stacked_and_rest(full)
    for r, got in enumerate(_ranks(full, tmp_path, mode="model", load_format="moeconvert", tp=2)):
        assert "error" not in got, got["error"]
        out = tmp_path / f"rank{r}"
        cli(verb[0], src, out, *verb[1:], "--tp-size", "2", "--tp-rank", str(r), expect=0)
        files = st_tensors(out)
        want = {m["prefix"]: {s: files[t["name"]] for s, t in m["tensors"].items()} for m in _manifest(out)["moe_layers"]}
        assert all(layer["tp"] == [2, r] for layer in got["layers"].values())
        _assert_holds(got, want, f"rank {r}")
        share = sum(t.numel() * t.element_size() for layer in want.values() for t in layer.values())
        assert share + rest <= got["read_bytes"] <= share + rest + headers + 64 * 1024, (r, got["read_bytes"], share, rest)
