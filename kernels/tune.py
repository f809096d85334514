"""Tuning the ``triton-fast`` kernel's tiles for one layer: the sweep ``moeconvert bench kernel --tune``
runs, and the opt-in tune on first use (``$MOECONVERT_KERNEL_TUNE=1`` or ``load(..., tune=True)``).

A layer is tuned on the tensors it is given (the bench's random ones, or the loaded layer's own, so tuning
a model holds no second copy), per token count M: each BLOCK_M's alignment, then every GEMM1 and GEMM2
candidate alone under a CUDA graph (:func:`graph_us`); the fastest pair of one BLOCK_M wins. The entry is
keyed by what :func:`moe_fast.fused_moe_fast` looks up (format, group, the weights' E, K and I, top-k), so a
padded layer is found under the sizes the kernel runs, and merged into a table (configs.write_table).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from moeconvert.errors import MoeConvertError
from moeconvert.kernels import configs

#: the token counts a tune covers; configs.lookup takes the nearest on a log scale
MS = (1, 16, 64, 256, 4096)
ENV_TUNE = "MOECONVERT_KERNEL_TUNE"


#: what ``$MOECONVERT_KERNEL_TUNE`` may say (any case, surrounding blanks ignored): on, off (unset is off)
TUNE_ON, TUNE_OFF = ("1", "true", "yes"), ("", "0", "false", "no")


def tune_wanted(tune=None) -> bool:
    """The one reading of ``load(..., tune=)`` and ``$MOECONVERT_KERNEL_TUNE``: ``tune`` True or False
    decides; None defers to the variable (docs/kernels.md, "Tuning on first use"). Anything else, in
    the argument or the variable, is refused in one line naming it and the values it takes."""
    if tune is not None:
        if type(tune) is not bool:  # "false" is a true value to Python: refuse it rather than read it
            raise MoeConvertError("load's tune is True, False or None", tensor="tune",
                                  expected=f"True | False | None (None: ${ENV_TUNE})", found=repr(tune))
        return tune
    text = os.environ.get(ENV_TUNE, "")
    value = text.strip().lower()
    if value in TUNE_ON or value in TUNE_OFF:
        return value in TUNE_ON
    raise MoeConvertError("bad environment variable", tensor=ENV_TUNE,
                          expected=f"{' | '.join(TUNE_ON)} (on) or {' | '.join(TUNE_OFF[1:])} | unset (off)",
                          found=repr(text))


@dataclass(frozen=True)
class LayerShape:
    """What a tile config depends on: ``fmt`` (``int4`` | ``int8`` | ``mxfp4``), ``group`` (-1 or 0:
    channelwise; MXFP4: 32), ``E`` the experts held, ``H`` w13's (padded) K, ``I`` w2's K, and the
    activation (gpt-oss's swiglu runs another epilogue)."""

    fmt: str
    group: int
    E: int
    top_k: int
    H: int
    I: int
    activation: str = "silu"

    @classmethod
    def of(cls, w13, w2, *, fmt: str, group: int, top_k: int, activation: str = "silu") -> "LayerShape":
        """The shape ``fused_moe_fast`` runs for these weights (``moe_fast.FastWeights``)."""
        return cls(fmt, group, w13.weight.shape[0], top_k, w13.k(fmt), w2.k(fmt), activation)

    @property
    def key(self) -> str:
        return configs.entry_key(self.fmt, self.group, self.E, self.top_k, self.H, self.I)


def graph_us(fn, rep_ms: int = 100) -> float:
    """Microseconds per replay of a CUDA graph of ``fn()`` (run twice first on a side stream: JIT)."""
    import triton

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


def num_sms(device) -> int:
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def candidates(s: LayerShape, M: int, sms: int) -> list[tuple[int, list[dict], list[dict]]]:
    """(BLOCK_M, GEMM1 configs, GEMM2 configs) to try for one (shape, M): the tile widths and depths
    that matter at this M (blocks of 16 and 32 rows: 4 stages, 6 too for two tiles when an expert gets
    few pairs, split-K for a GEMM whose programs would not fill the GPU; blocks of 64 and 128 rows, from
    33 pairs an expert on: 3 stages, 4 too for the two tiles ``heuristic_configs`` deepens, and integer
    scales on the product and in the operand, ``OPERAND_SCALE``)."""
    ppe = M * s.top_k / s.E
    bms = [16] if ppe <= 8 else [16, 32] if ppe <= 32 else [32, 64] if ppe <= 96 else [64, 128]
    out = []
    for bm in bms:
        if bm <= 32:
            if s.fmt == "mxfp4":
                tiles = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 64, 8)]
            else:
                tiles = [(64, 128, 4), (128, 128, 4), (64, 256, 4), (64, 64, 4), (128, 128, 8)]
            blocks = min(s.E, M * s.top_k)
            # few pairs an expert: deeper pipelines for the first two tiles too (more bytes in flight)
            depths = [(bn, bk, w, 4) for bn, bk, w in tiles] + ([(bn, bk, w, 6) for bn, bk, w in tiles[:2]]
                                                                 if ppe <= 8 else [])
            g1, g2 = [], []
            for bn, bk, w, st in depths:
                for n, k, out_list in ((s.I, s.H, g1), (s.H, s.I, g2)):
                    programs = blocks * math.ceil(n / bn)
                    splits = (1, 2, 4) if programs < 2 * sms else (1, 2) if programs < 4 * sms else (1,)
                    out_list += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=sk, GROUP_M=1)
                                 for sk in splits if k // bk >= sk]
        else:
            # (BLOCK_N, BLOCK_K, warps, stages): 4 stages for the two tiles heuristic_configs takes with them
            tiles = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4),
                     (128, 128, 8, 3), (256, 64, 8, 3)]
            # MMA-bound: integer scales in the operand too (the MMA then overlaps the next unpacking)
            scales = (0,) if s.fmt == "mxfp4" else (0, 1)
            base = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, GROUP_M=8, SPLIT_K=1, OPERAND_SCALE=o)
                    for bn, bk, w, st in tiles for o in scales]
            g1, g2 = base, [dict(c) for c in base]
        out.append((bm, [dict(c, BLOCK_M=bm) for c in g1], [dict(c, BLOCK_M=bm) for c in g2]))
    return out


def routing_inputs(E: int, top_k: int, H: int, M: int, device, dtype=torch.bfloat16):
    """Seeded ``x [M, H]``, uniform top-k routing (the softmax of Gaussian logits) and the logits."""
    g = torch.Generator(device=device).manual_seed(1000 + M)
    x = torch.randn(M, H, device=device, dtype=dtype, generator=g)
    logits = torch.randn(M, E, device=device, generator=g)
    tw, ids = torch.topk(torch.softmax(logits, -1), top_k, -1)
    return x, tw.float(), ids.to(torch.int32), logits


class StepTimer:
    """Times the steps of one layer alone for one M: the align for a BLOCK_M, GEMM1 and GEMM2 (with its
    reduction: the sum over top-k, or split-K's zeroing and cast) for a config, each under a CUDA graph."""

    def __init__(self, s: LayerShape, M: int, device, w13, w2, dtype=torch.bfloat16):
        from moeconvert.kernels.moe_fast import ACTIVATIONS, FORMATS, mx_small_scales

        self.s, self.M, self.device, self.w13, self.w2 = s, M, device, w13, w2
        self.f, self.act = FORMATS[s.fmt], ACTIVATIONS[s.activation]
        self.x, tw, self.ids, _ = routing_inputs(s.E, s.top_k, s.H, M, device, dtype)
        self.P = M * s.top_k
        self.a = torch.randn(self.P, s.I, device=device, dtype=dtype) * 0.1  # GEMM2's input
        self.h = torch.empty(self.P, s.I, device=device, dtype=dtype)  # GEMM1's output
        self.weights = tw.reshape(-1).contiguous()
        self.mx_fold = s.fmt == "mxfp4" and mx_small_scales(w13, w2)

    def align(self, bm: int):
        """(the alignment, its µs): one token's pairs need none (moe_fast.use_pair_blocks), 0 µs."""
        from moeconvert.kernels.moe_fast import PairBlocks, align, use_pair_blocks

        if use_pair_blocks(self.M):
            return PairBlocks(self.ids.reshape(-1).contiguous(), self.s.E, 0), 0.0
        aligned = align(self.ids, bm, self.s.E)
        return aligned, graph_us(lambda: align(self.ids, bm, self.s.E), rep_ms=20)

    def _launch(self, a, w, out, aligned, weights, cfg, gated, atomic_row_div, workspace=None):
        from moeconvert.kernels.moe_fast import launch_gemm

        launch_gemm(a, w, out, aligned, weights, fmt=self.f, group=self.s.group, gated=gated, act=self.act,
                    alpha=1.702, limit=7.0, a_row_div=self.s.top_k if gated else 1, atomic_row_div=atomic_row_div,
                    num_pairs=self.P, cfg=cfg, workspace=workspace, mx_fold=self.mx_fold)

    def gemm1(self, cfg: dict, aligned) -> float:
        """GEMM1 (split-K: with its workspace's zeroing)."""
        from moeconvert.kernels.moe_fast import gemm1_workspace

        def fn():
            ws = gemm1_workspace(cfg, aligned, self.s.I, self.P, self.device)
            self._launch(self.x, self.w13, self.h, aligned, None, cfg, True, 0, ws)

        return graph_us(fn, rep_ms=20)

    def gemm2(self, cfg: dict, aligned) -> float:
        M, H, k, dt = self.M, self.w2.n(self.s.fmt), self.s.top_k, self.x.dtype
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


class NoConfigRan(RuntimeError):
    """No candidate tile of one (shape, M) ran on this GPU."""


def tune_layer(s: LayerShape, w13, w2, device, ms=MS, log=print, dtype=torch.bfloat16) -> dict:
    """``{"entry": {str(M): [GEMM1 config, GEMM2 config]}, "report": {str(M): times}}``: the fastest tiles
    found for the layer ``w13`` / ``w2`` (``moe_fast.FastWeights`` on ``device``)."""
    sms = num_sms(device)
    entry, report = {}, {}
    for M in ms:
        timer = StepTimer(s, M, device, w13, w2, dtype)
        best = None
        for bm, g1s, g2s in candidates(s, M, sms):
            aligned, t_align = timer.align(bm)
            picked = []
            for which, cands, time_it in (("GEMM1", g1s, timer.gemm1), ("GEMM2", g2s, timer.gemm2)):
                times = []
                for c in cands:
                    configs.check_config(c, s.fmt, which)
                    try:
                        times.append((time_it(c, aligned), c))
                    except Exception as e:  # a tile the GPU cannot hold (shared memory, registers)
                        log(f"  skip {which} {c}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                if not times:
                    break
                picked.append(min(times, key=lambda tc: tc[0]))
            if len(picked) < 2:
                continue
            total = t_align + picked[0][0] + picked[1][0]
            if best is None or total < best[0]:
                best = (total, picked[0][1], picked[1][1], t_align, picked[0][0], picked[1][0])
        if best is None:
            raise NoConfigRan(f"no tile config ran for {s.key} at M={M}")
        entry[str(M)] = [best[1], best[2]]
        report[str(M)] = dict(total_us=round(best[0], 1), align_us=round(best[3], 1), gemm1_us=round(best[4], 1),
                              gemm2_us=round(best[5], 1))
        log(f"  {s.key} M={M}: {report[str(M)]} GEMM1 {best[1]} GEMM2 {best[2]}")
    return {"entry": entry, "report": report}


def ensure_tuned(s: LayerShape, w13, w2, device, *, device_name: str | None = None, table=None, ms=MS,
                 log=print) -> dict | None:
    """Tune ``s`` and merge it into ``table`` (default: the user's cache for this GPU) unless a table the
    kernel reads already has it (configs.lookup's order). Returns the tune's result, or None if known."""
    device = torch.device(device)
    name = device_name or torch.cuda.get_device_name(device)
    if configs.has_entry(s.key, name):
        return None
    table = table or configs.user_table_path(name)
    configs.check_writable(table)  # a sweep takes minutes: refuse a table it could not write first
    log(f"tuning {s.key} on {name} (first use; written to {table})")
    r = tune_layer(s, w13, w2, device, ms, log)
    configs.write_table(table, name, {s.key: r["entry"]}, log)
    return r
