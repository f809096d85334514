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
import math
import os
import time
import traceback

import torch
import triton

from moeconvert.errors import MoeConvertError
from moeconvert.bench.contenders import Problem, Unavailable, parse_format, random_layout_tensors

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


def graph_us(fn, rep_ms: int = 100) -> float:
    """Microseconds per replay of a CUDA graph of ``fn()`` (run twice first on a side stream: JIT)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    t = triton.testing.do_bench(g.replay, warmup=max(5, rep_ms // 10), rep=rep_ms)
    del g
    return t * 1e3


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
    g = torch.Generator(device=device).manual_seed(1000 + M)
    x = torch.randn(M, p.H, device=device, dtype=dtype, generator=g)
    logits = torch.randn(M, p.E, device=device, generator=g)
    tw, ids = torch.topk(torch.softmax(logits, -1), p.top_k, -1)
    return x, tw.float(), ids.to(torch.int32), logits


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


# ---------------------------------------------------------------------------------------------------
# --tune


def _candidates(p: Problem, M: int, num_sms: int) -> list[tuple[int, list[dict], list[dict]]]:
    """(BLOCK_M, GEMM1 configs, GEMM2 configs) to try for one (shape, M): the tile widths and depths
    that matter at this M (4 stages; 6 too for two tiles when an expert gets few pairs), split-K for a
    GEMM whose programs would not fill the GPU, and for int8 both operand orders (``SWAP_AB``; 4-bit
    weights always multiply as the first operand)."""
    ppe = M * p.top_k / p.E
    bms = [16] if ppe <= 8 else [16, 32] if ppe <= 32 else [32, 64] if ppe <= 96 else [64, 128]
    swaps = (0, 1) if _fmt(p)[0] == "int8" else (0,)
    out = []
    for bm in bms:
        if bm <= 32:
            if p.fmt == "mxfp4":
                tiles = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 64, 8)]
            else:
                tiles = [(64, 128, 4), (128, 128, 4), (64, 256, 4), (64, 64, 4), (128, 128, 8)]
            blocks = min(p.E, M * p.top_k)
            # few pairs an expert: deeper pipelines for the first two tiles too (more bytes in flight)
            depths = [(bn, bk, w, 4) for bn, bk, w in tiles] + ([(bn, bk, w, 6) for bn, bk, w in tiles[:2]]
                                                                 if ppe <= 8 else [])
            g1, g2 = [], []
            for bn, bk, w, st in depths:
                for n, k, out_list in ((p.I, p.H, g1), (p.H, p.I, g2)):
                    programs = blocks * math.ceil(n / bn)
                    splits = (1, 2, 4) if programs < 2 * num_sms else (1, 2) if programs < 4 * num_sms else (1,)
                    out_list += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=sk, SWAP_AB=sw,
                                      GROUP_M=1) for sk in splits if k // bk >= sk for sw in swaps]
        else:
            tiles = [(64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (256, 64, 8)]
            base = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3, GROUP_M=8, SPLIT_K=1, SWAP_AB=sw)
                    for bn, bk, w in tiles for sw in swaps]
            g1, g2 = base, [dict(c) for c in base]
        out.append((bm, [dict(c, BLOCK_M=bm) for c in g1], [dict(c, BLOCK_M=bm) for c in g2]))
    return out


class StepTimer:
    """Times the steps of our layer one by one for one (shape, M): the align for a BLOCK_M, GEMM1 and
    GEMM2 (with its reduction: the sum over top-k, or split-K's zeroing and cast) for a config, each
    alone under a CUDA graph (``graph_us``)."""

    def __init__(self, p: Problem, M: int, device, w13, w2, dtype=torch.bfloat16):
        from moeconvert.kernels.moe_fast import ACTIVATIONS, FORMATS, mx_small_scales

        self.p, self.M, self.device, self.w13, self.w2 = p, M, device, w13, w2
        self.fmt, self.group = _fmt(p)
        self.f, self.act = FORMATS[self.fmt], ACTIVATIONS[p.activation]
        self.x, tw, self.ids, _ = routing_inputs(p, M, device, dtype)
        self.P = M * p.top_k
        self.a = torch.randn(self.P, p.I, device=device, dtype=dtype) * 0.1  # GEMM2's input
        self.h = torch.empty(self.P, p.I, device=device, dtype=dtype)  # GEMM1's output
        self.weights = tw.reshape(-1).contiguous()
        self.mx_fold = self.fmt == "mxfp4" and mx_small_scales(w13, w2)

    def align(self, bm: int):
        """(the alignment, its µs): one token's pairs need none (moe_fast.use_pair_blocks), 0 µs."""
        from moeconvert.kernels.moe_fast import PairBlocks, align, use_pair_blocks

        if use_pair_blocks(self.M):
            return PairBlocks(self.ids.reshape(-1).contiguous(), self.p.E, 0), 0.0
        aligned = align(self.ids, bm, self.p.E)
        return aligned, graph_us(lambda: align(self.ids, bm, self.p.E), rep_ms=20)

    def _launch(self, a, w, out, aligned, weights, cfg, gated, atomic_row_div, workspace=None):
        from moeconvert.kernels.moe_fast import launch_gemm

        launch_gemm(a, w, out, aligned, weights, fmt=self.f, group=self.group, gated=gated, act=self.act,
                    alpha=1.702, limit=7.0, a_row_div=self.p.top_k if gated else 1, atomic_row_div=atomic_row_div,
                    num_pairs=self.P, cfg=cfg, workspace=workspace, mx_fold=self.mx_fold)

    def gemm1(self, cfg: dict, aligned) -> float:
        """GEMM1 (split-K: with its workspace's zeroing)."""
        from moeconvert.kernels.moe_fast import gemm1_workspace

        def fn():
            ws = gemm1_workspace(cfg, aligned, self.p.I, self.P, self.device)
            self._launch(self.x, self.w13, self.h, aligned, None, cfg, True, 0, ws)

        return graph_us(fn, rep_ms=20)

    def gemm2(self, cfg: dict, aligned) -> float:
        M, H, k, dt = self.M, self.p.H, self.p.top_k, self.x.dtype
        if cfg.get("SPLIT_K", 1) > 1:
            def fn():
                out = torch.zeros(M, H, device=self.device, dtype=torch.float32)
                self._launch(self.a, self.w2, out, aligned, self.weights, cfg, False, k)
                return out.to(dt)
        else:
            def fn():
                y = torch.empty(self.P, H, device=self.device, dtype=dt)
                self._launch(self.a, self.w2, y, aligned, self.weights, cfg, False, 0)
                return y.view(M, k, H).sum(1)
        return graph_us(fn, rep_ms=20)


def _num_sms(device) -> int:
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def tune(p: Problem, device, ms: list[int], log=print, dtype=torch.bfloat16) -> dict:
    """{str(M): [GEMM1 config, GEMM2 config]} of the fastest tiles found for ``p``, with their times."""
    from moeconvert.kernels.moe_fast import check_config

    _, _, (w13, w2) = ours(p, device)
    fmt, _ = _fmt(p)
    sms = _num_sms(device)
    entry, report = {}, {}
    for M in ms:
        timer = StepTimer(p, M, device, w13, w2, dtype)
        best = None
        for bm, g1s, g2s in _candidates(p, M, sms):
            aligned, t_align = timer.align(bm)
            picked = []
            for which, cands, time_it in (("GEMM1", g1s, timer.gemm1), ("GEMM2", g2s, timer.gemm2)):
                times = []
                for c in cands:
                    check_config(c, fmt)
                    try:
                        times.append((time_it(c, aligned), c))
                    except Exception as e:  # a tile the GPU cannot hold (shared memory, registers)
                        log(f"  skip {which} {c}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                if not times:
                    break
                picked.append(min(times, key=lambda tc: tc[0]))
            if len(picked) < 2:
                continue
            total = t_align + picked[0][0] + picked[1][0]
            if best is None or total < best[0]:
                best = (total, picked[0][1], picked[1][1], t_align, picked[0][0], picked[1][0])
        if best is None:
            raise MoeConvertError(f"no tile config ran for {p.name} at M={M}")
        entry[str(M)] = [best[1], best[2]]
        report[str(M)] = dict(total_us=round(best[0], 1), align_us=round(best[3], 1), gemm1_us=round(best[4], 1),
                              gemm2_us=round(best[5], 1))
        log(f"  {p.name} M={M}: {report[str(M)]} GEMM1 {best[1]} GEMM2 {best[2]}")
    return {"entry": entry, "report": report}


def _steps(p: Problem, M: int, device, weights, hit: int, bw: float) -> dict:
    """Our layer's steps with the configs it runs (table or heuristic), each timed alone, and each GEMM's
    memory floor (its weight + scale bytes of the experts touched over the copy bandwidth)."""
    from moeconvert.kernels.configs import get_configs

    fmt, group = _fmt(p)
    c1, c2 = get_configs(fmt, p.E, p.top_k, H=p.H, I=p.I, M=M, group=group, device=device)
    timer = StepTimer(p, M, device, *weights)
    aligned, t_align = timer.align(c1["BLOCK_M"])
    w13_bytes, w2_bytes = hit * p.projection_bytes(2 * p.I, p.H), hit * p.projection_bytes(p.H, p.I)
    return {"align_us": round(t_align, 2), "gemm1_us": round(timer.gemm1(c1, aligned), 2),
            "gemm2_us": round(timer.gemm2(c2, aligned), 2), "gemm1_floor_us": round(w13_bytes / bw * 1e6, 2),
            "gemm2_floor_us": round(w2_bytes / bw * 1e6, 2), "configs": [c1, c2]}


def write_table(path, device_name: str, entries: dict) -> None:
    """Merge ``entries`` into the table at ``path`` (other layers' entries kept), atomically."""
    from pathlib import Path

    path = Path(path)
    data = {"device": device_name, "triton": triton.__version__, "entries": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            data["entries"] = dict(old.get("entries", {}))
        except (OSError, json.JSONDecodeError):
            pass
    data["entries"].update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    from moeconvert.kernels.configs import clear_cache

    clear_cache()


# ---------------------------------------------------------------------------------------------------
# the bench


def bench_kernel(shapes: list[str], ms: list[int], contenders: list[str], *, custom: list[str] = (), device="cuda",
                 fmt: str | None = None,
                 do_tune: bool = False, table: str | None = None, breakdown: bool = False, log=print) -> dict:
    from moeconvert.kernels import configs
    from moeconvert.bench import contenders as C

    for c in contenders:
        if c not in CONTENDERS:
            raise MoeConvertError("unknown contender", tensor="--contenders", expected=" | ".join(CONTENDERS), found=c)
    if fmt is not None:
        parse_format(fmt)
    probs = problems(shapes, fmt, custom)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise MoeConvertError("bench kernel times CUDA graphs: it needs a CUDA device", expected="cuda",
                              found=str(device))
    name = torch.cuda.get_device_name(device)
    result = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "rows": [], "tuned": {},
              "contender_notes": {}}
    if do_tune:
        path = table or str(configs.user_table_path(name))
        t0 = time.time()
        for p in probs:
            f, g = _fmt(p)
            log(f"tuning {p.name} ({p.fmt})")
            r = tune(p, device, ms, log)
            write_table(path, name, {configs.entry_key(f, g, p.E, p.top_k, p.H, p.I): r["entry"]})
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
        others = [v for k, v in row["us"].items() if k != "ours"]
        if "ours" in row["us"]:
            t = row["us"]["ours"]
            row["vs_best_contender"] = round(min(others) / t, 3) if others else None
            row["of_memory_floor"] = round(row["memory_floor_us"] / t, 3)
            row["of_compute_floor"] = round(row["compute_floor_us"] / t, 3)
    return rows

