"""``moeconvert bench kernel``: our fused MoE kernel against the engines' on the same layers, one run.

Per layer shape and token count M: the whole-layer time under a CUDA graph (``triton.testing.do_bench``
on the graph's replay, L2 flushed between replays) of

* ``ours``: kernels/moe_fast.py on random ``triton-fast`` tensors (align, GEMM1 + activation, GEMM2, sum);
* the contenders of moeconvert/bench/contenders.py where they can run (vLLM Marlin, humming, triton_kernels),

all from the same ``x``, routing and (for triton_kernels) router logits, with uniform random routing
(top-k of the softmax of Gaussian logits). Next to them, measured in the same run:

* the memory floor: bytes of the distinct experts touched (weights + scales of the format) plus the
  activations read and written (x and the output, bf16), over the device-to-device copy bandwidth;
* the compute floor: the layer's ``2 * M * top_k * 3 * H * I`` flops at the bf16 dense GEMM rate
  (``torch.mm`` of 8192^3).

``--tune`` first sweeps the kernel's tile configs per (shape, M) (docs/kernels.md says which) and
writes the table the kernel then reads (configs.py), by default the user's cache for this GPU.
``--breakdown`` adds our layer's steps (align, GEMM1, GEMM2 with its reduction), each timed alone with
the configs the layer runs, next to each GEMM's share of the memory floor.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback

import torch
import triton

from moeconvert.errors import MoeConvertError
from moeconvert.bench.contenders import Problem, Unavailable, parse_format, random_layout_tensors
from moeconvert.kernels.configs import check_pair
from moeconvert.kernels.tune import LayerShape, NoConfigRan, StepTimer, graph_us, tune_layer
from moeconvert.kernels.tune import routing_inputs as tune_routing_inputs

SHAPES = {  # E, top_k, H, I, format
    "mixtral": (8, 2, 4096, 14336, "int4-g128"),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "int4-g128"),
    "qwen3-235b-a22b": (128, 8, 4096, 1536, "int4-g128"),
    "deepseek-v3": (256, 8, 7168, 2048, "int4-g128"),
    "gpt-oss-120b": (128, 4, 2880, 2880, "mxfp4"),
}
MS = (1, 16, 64, 256, 4096)
CONTENDERS = ("marlin", "humming", "triton_kernels")


def parse_shape(text: str) -> tuple[str, int, int, int, int]:
    """``E,top_k,H,I`` (a layer of the user's own model) -> (name, E, top_k, H, I)."""
    try:
        E, k, H, I = (int(v) for v in text.split(","))
    except ValueError:  # not four, or not integers
        E = k = H = I = 0
    if min(E, k, H, I) < 1 or k > E:
        raise MoeConvertError("a layer shape is four positive integers, top-k at most E", tensor="--shape",
                              expected="E,top_k,H,I (e.g. 256,8,7168,2048)", found=text)
    return f"E{E}-k{k}-H{H}-I{I}", E, k, H, I


def problems(names: list[str], fmt: str | None = None, custom: list[str] = ()) -> list[Problem]:
    """The named shapes (in their own format unless ``fmt``), then each ``--shape E,top_k,H,I`` (in ``fmt``,
    else int4-g128)."""
    out = []
    for n in names:
        if n not in SHAPES:
            raise MoeConvertError("unknown shape", tensor="--shapes", expected=" | ".join(SHAPES), found=n)
        E, k, H, I, f = SHAPES[n]
        out.append(Problem(n, E, k, H, I, fmt or f))
    for text in custom:
        out.append(Problem(*parse_shape(text), fmt or "int4-g128"))
    return out


# ---------------------------------------------------------------------------------------------------
# timing and floors


def copy_bandwidth(device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=100)
    del x, y
    return 2 * (2 << 30) / (t * 1e-3)


def dense_rate(device) -> float:
    """Flop/s of a bf16 ``torch.mm`` 8192 x 8192 x 8192."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: torch.mm(a, b), warmup=10, rep=200)
    return 2 * 8192 ** 3 / (t * 1e-3)


def routing_inputs(p: Problem, M: int, device, dtype=torch.bfloat16):
    """The tuner's seeded inputs (kernels/tune.py) for ``p``: every contender gets the same ones."""
    return tune_routing_inputs(p.E, p.top_k, p.H, M, device, dtype)


# ---------------------------------------------------------------------------------------------------
# ours


def _fmt(p: Problem) -> tuple[str, int]:
    """(moe_fast format, group size) of a problem."""
    if p.fmt == "mxfp4":
        return "mxfp4", 32
    return f"int{p.scheme.bits}", p.scheme.group_size


def ours(p: Problem, device):
    from moeconvert.kernels.moe_fast import fused_moe_fast, mx_small_scales
    from moeconvert.runtime.moeconvert_triton import weights_from_tensors

    t = random_layout_tensors("triton-fast", p, device)
    w13, w2 = weights_from_tensors(t, "w13"), weights_from_tensors(t, "w2")
    fmt, group = _fmt(p)
    small = fmt == "mxfp4" and mx_small_scales(w13, w2)  # as the runtime's layer reads it once

    def run(x, tw, ids, logits, configs=None):
        return fused_moe_fast(x, w13, w2, tw, ids, fmt=fmt, group_size=group, activation=p.activation,
                              configs=configs, mx_small_scales=small)

    return run, sum(v.numel() * v.element_size() for v in t.values()), (w13, w2)


def read_configs(path: str) -> dict[str, tuple[dict, dict]]:
    """``--configs FILE``: a JSON object ``{"name": [GEMM1 config, GEMM2 config], ...}`` (kernels/configs.py's
    keys, both GEMMs with one BLOCK_M), each pair timed as our layer's column ``ours:name`` beside the
    configs the layer picks itself (``ours``)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise MoeConvertError(f"cannot read the config pairs: {e}", file=path, tensor="--configs") from None
    if not isinstance(data, dict) or not data:
        raise MoeConvertError("config pairs must be a non-empty JSON object", file=path, tensor="--configs",
                              expected='{"name": [{GEMM1}, {GEMM2}]}', found=type(data).__name__)
    out = {}
    for name, pair in data.items():
        check_pair(pair, None, str(name), path)  # the format's own constraints: check_configs_for
        out[str(name)] = (dict(pair[0]), dict(pair[1]))
    return out


def check_configs_for(probs: list[Problem], pairs: dict[str, tuple[dict, dict]], path: str = "--configs") -> None:
    """Every pair is one the kernel takes for every problem's format (kernels/configs.check_pair)."""
    for p in probs:
        for name, pair in pairs.items():
            try:
                check_pair(pair, _fmt(p)[0], name, path)
            except MoeConvertError as e:
                raise MoeConvertError(f"{e.message} ({p.name}, {p.fmt})", file=e.file, tensor=e.tensor,
                                      expected=e.expected, found=e.found) from None


def pinned(built, pair: tuple[dict, dict]):
    """``ours``' (run, bytes, weights) with every call running ``pair`` instead of the configs it picks."""
    run, nbytes, weights = built
    return (lambda x, tw, ids, logits: run(x, tw, ids, logits, configs=pair)), nbytes, weights


# ---------------------------------------------------------------------------------------------------
# --tune (kernels/tune.py)


def layer_shape(p: Problem, w13, w2) -> LayerShape:
    """What our kernel runs for ``p``'s tensors (w13's K padded as the layout pads it)."""
    fmt, group = _fmt(p)
    return LayerShape.of(w13, w2, fmt=fmt, group=group, top_k=p.top_k, activation=p.activation)


def tune(p: Problem, device, ms: list[int], log=print, dtype=torch.bfloat16) -> dict:
    """kernels/tune.py's sweep on random ``triton-fast`` tensors of ``p``: ``{"key", "entry", "report"}``."""
    _, _, (w13, w2) = ours(p, device)
    s = layer_shape(p, w13, w2)
    try:
        r = tune_layer(s, w13, w2, device, ms, log, dtype)
    except NoConfigRan as e:
        raise MoeConvertError(f"{p.name}: {e}") from None
    return dict(r, key=s.key)


def _steps(p: Problem, M: int, device, weights, hit: int, bw: float) -> dict:
    """Our layer's steps with the configs it runs (table or heuristic), each timed alone, and each GEMM's
    memory floor (its weight + scale bytes of the experts touched over the copy bandwidth)."""
    from moeconvert.kernels.configs import get_configs

    fmt, group = _fmt(p)
    s = layer_shape(p, *weights)
    c1, c2 = get_configs(fmt, s.E, s.top_k, H=s.H, I=s.I, M=M, group=group, device=device)
    timer = StepTimer(s, M, device, *weights)
    aligned, t_align = timer.align(c1["BLOCK_M"])
    w13_bytes, w2_bytes = hit * p.projection_bytes(2 * p.I, p.H), hit * p.projection_bytes(p.H, p.I)
    return {"align_us": round(t_align, 2), "gemm1_us": round(timer.gemm1(c1, aligned), 2),
            "gemm2_us": round(timer.gemm2(c2, aligned), 2), "gemm1_floor_us": round(w13_bytes / bw * 1e6, 2),
            "gemm2_floor_us": round(w2_bytes / bw * 1e6, 2), "configs": [c1, c2]}


# ---------------------------------------------------------------------------------------------------
# the bench


def bench_kernel(shapes: list[str], ms: list[int], contenders: list[str], *, custom: list[str] = (), device="cuda",
                 fmt: str | None = None,
                 do_tune: bool = False, table: str | None = None, breakdown: bool = False, log=print,
                 pairs: dict[str, tuple[dict, dict]] | None = None, pairs_file: str = "--configs") -> dict:
    from moeconvert.kernels import configs
    from moeconvert.bench import contenders as C

    for c in contenders:
        if c not in CONTENDERS:
            raise MoeConvertError("unknown contender", tensor="--contenders", expected=" | ".join(CONTENDERS), found=c)
    if fmt is not None:
        parse_format(fmt)
    probs = problems(shapes, fmt, custom)
    check_configs_for(probs, pairs or {}, pairs_file)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise MoeConvertError("bench kernel times CUDA graphs: it needs a CUDA device", expected="cuda",
                              found=str(device))
    name = torch.cuda.get_device_name(device)
    result = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "rows": [], "tuned": {},
              "contender_notes": {}}
    if do_tune:
        path = table or str(configs.user_table_path(name))
        configs.check_writable(path)  # before the sweep, not after it
        t0 = time.time()
        for p in probs:
            log(f"tuning {p.name} ({p.fmt})")
            r = tune(p, device, ms, log)
            configs.write_table(path, name, {r["key"]: r["entry"]}, log)
            result["tuned"][p.name] = r["report"]
            torch.cuda.empty_cache()
        result["tune_seconds"] = round(time.time() - t0, 1)
        log(f"wrote {path} ({result['tune_seconds']} s)")
        table = path
    if table:  # the bench reads the table just written (or named) first
        os.environ[configs.ENV_TABLE] = table
    result["table"] = table
    bw, rate = copy_bandwidth(device), dense_rate(device)
    result["copy_TBps"], result["bf16_TFLOPs"] = round(bw / 1e12, 3), round(rate / 1e12, 1)
    log(f"{name}: copy {bw / 1e12:.2f} TB/s, bf16 mm {rate / 1e12:.0f} TFLOP/s")
    for p in probs:
        builders = {"ours": lambda: ours(p, device)}
        for name, pair in (pairs or {}).items():  # ours again, with each named config pair
            builders[f"ours:{name}"] = lambda pair=pair: pinned(ours(p, device), pair)
        for c in contenders:
            builders[c] = {"marlin": lambda: C.marlin(p, device), "humming": lambda: C.humming(p, device, ms),
                           "triton_kernels": lambda: C.triton_kernels(p, device)}[c]
        rows = time_problem(p, ms, builders, device, bw, rate, result["contender_notes"], breakdown)
        for row in rows:
            log(json.dumps(row))
        result["rows"] += rows
    return result


def time_problem(p: Problem, ms: list[int], builders: dict, device, bw: float, rate: float, notes: dict,
                 breakdown: bool = False) -> list[dict]:
    """One row per token count M, timing each contender ``builders`` makes (``name -> () -> (run, ...)``).

    One contender at a time: it is built, timed at every M on the same routing inputs as the others, and
    freed before the next is built, so the GPU never holds two copies of the layer (Kimi-K2's int4 layer
    is 8.7 GB, and a contender's own conversion needs room besides)."""
    inputs = {M: routing_inputs(p, M, device) for M in ms}
    rows = []
    for M in ms:
        ids = inputs[M][2]
        hit = int(torch.unique(ids).numel())
        mem_bytes = hit * p.expert_bytes + 2 * M * p.H * 2
        rows.append({"shape": p.name, "fmt": p.fmt, "E": p.E, "top_k": p.top_k, "H": p.H, "I": p.I, "M": M,
                     "experts_hit": hit, "layer_MB": round(p.E * p.expert_bytes / 1e6, 1),
                     "memory_floor_us": round(mem_bytes / bw * 1e6, 2),
                     "compute_floor_us": round(2 * M * p.top_k * 3 * p.H * p.I / rate * 1e6, 2), "us": {},
                     "errors": {}})
    for who, build in builders.items():
        try:
            built = build()
        except Unavailable as e:
            notes[f"{who}/{p.name}"] = str(e)
            continue
        except Exception as e:
            notes[f"{who}/{p.name}"] = f"{type(e).__name__}: {str(e)[:200]}"
            if who != "ours":
                traceback.print_exc()
            continue
        run = built[0]
        for row in rows:
            x, tw, ids, logits = inputs[row["M"]]
            try:
                row["us"][who] = round(graph_us(lambda: run(x, tw, ids, logits)), 2)
            except Exception as e:
                row["errors"][who] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if who == "ours" and breakdown:
                row["ours_steps"] = _steps(p, row["M"], device, built[2], row["experts_hit"], bw)
        del built, run
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in rows:
        others = [v for k, v in row["us"].items() if not k.startswith("ours")]  # the engines' kernels
        if "ours" in row["us"]:
            t = row["us"]["ours"]
            row["vs_best_contender"] = round(min(others) / t, 3) if others else None
            row["of_memory_floor"] = round(row["memory_floor_us"] / t, 3)
            row["of_compute_floor"] = round(row["compute_floor_us"] / t, 3)
    return rows

