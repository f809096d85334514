"""moeconvert.kernels: the routing alignment and the fused WNA16 MoE Triton kernel.

The kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child process (the variable changes every
Triton kernel defined after it is set, so it must not leak into the other tests): the child runs
every case once and reports its relative error against ``runtime/reference.py``'s ``reference_moe`` on
the same decoded weights; the tests here read the report. fp16/fp32 only there (the interpreter gets
bf16 ``tl.dot`` and int->bf16 casts wrong); bf16 on a realistic shape is the GPU test.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

from moeconvert.kernels.align import max_padded_tokens, moe_align_block_size
from moeconvert.runtime.dispatch import reads

from helpers import cli
from interpreted import TOL, rel, record, result, run_child




# ---------------------------------------------------------------------------------------------------
# 1. alignment vs a plain Python loop


def align_by_loop(topk_ids: torch.Tensor, block_m: int, E: int, offset: int):
    """The obvious version: per local expert its pair indices in order, padded with the sentinel."""
    flat = [int(i) - offset for i in topk_ids.reshape(-1)]
    P = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(E):
        pairs = [p for p, i in enumerate(flat) if i == e]
        if not pairs:
            continue
        pad = -len(pairs) % block_m
        sorted_ids += pairs + [P] * pad
        expert_ids += [e] * ((len(pairs) + pad) // block_m)
    return sorted_ids, expert_ids


@pytest.mark.parametrize("M,k,E,offset,block_m", [
    (1, 1, 1, 0, 16), (1, 8, 64, 0, 16), (13, 2, 4, 0, 4), (13, 2, 4, 2, 4),  # EP: ids 0..1, 6..7 not mine
    (37, 4, 8, 8, 16), (200, 8, 16, 0, 64), (5, 3, 3, 100, 8),  # (37, 4, 8, 8): rank 1 of 2; last: none mine
])
def test_align_matches_a_python_loop(M, k, E, offset, block_m):
    g = torch.Generator().manual_seed(M * 31 + E)
    E_global = max(E + offset, 2 * E)
    ids = torch.randint(0, E_global, (M, k), generator=g, dtype=torch.int32)
    got = moe_align_block_size(ids, block_m, E, offset)
    want_sorted, want_experts = align_by_loop(ids, block_m, E, offset)
    used = int(got.num_tokens_post_padded.item())
    assert used == len(want_sorted)
    assert got.sorted_token_ids[:used].tolist() == want_sorted
    assert (got.sorted_token_ids[used:] == M * k).all()  # the rest is sentinel
    nb = used // block_m
    assert got.expert_ids[:nb].tolist() == want_experts
    assert (got.expert_ids[nb:] == -1).all()
    assert got.sorted_token_ids.numel() == max_padded_tokens(M * k, E, block_m) >= used
    assert got.sorted_token_ids.dtype == got.expert_ids.dtype == torch.int32


def supports(layout: str, kind: str) -> bool:
    """The layouts name the runtime kernels that read them; ``triton`` is the one of our kernels."""
    return (layout, kind) in reads("triton")


def test_supports_the_layouts_made_for_our_kernels_only():
    assert supports("triton", "wna16") and supports("triton-fast", "wna16") and supports("triton-fast", "mxfp4")
    # vLLM's triton MXFP4 layout (triton_kernels' swizzle) and the CUDA kernels' layouts are not ours to read
    assert not supports("triton", "mxfp4") and not supports("marlin", "wna16") and not supports("plain", "float")


# ---------------------------------------------------------------------------------------------------
# 2. the kernel, direct calls: tiny shapes, EP-cut ids (expert_offset 1 of 6 global experts)

E, H, I, TOP_K, OFFSET, E_GLOBAL = 4, 128, 64, 2, 1, 6
QUANTS = {"int4-sym-g32": (4, 32, True), "int4-asym-g64": (4, 64, False), "int8-channel": (8, -1, True)}


def _direct_cases():
    cases = []
    for q in QUANTS:
        for bias in (False, True):
            for M in (1, 13):
                cases.append(dict(id=f"fp32-{q}-{'bias' if bias else 'nobias'}-M{M}", dtype="float32", quant=q,
                                  bias=bias, M=M, act="silu"))
    for i, q in enumerate(QUANTS):
        for M in (1, 13):
            cases.append(dict(id=f"fp16-{q}-{'bias' if i % 2 else 'nobias'}-M{M}", dtype="float16", quant=q,
                              bias=bool(i % 2), M=M, act="silu"))
    # gpt-oss: biases, swigluoai with the manifest's alpha / limit, interleaved w13 rows, no EP cut
    cases.append(dict(id="fp32-int4-sym-g32-swigluoai-interleaved", dtype="float32", quant="int4-sym-g32",
                      bias=True, M=13, act="swigluoai", params={"alpha": 1.5, "limit": 3.0}, rows="interleaved",
                      offset=0))
    return cases


DIRECT = _direct_cases()


def _make_weights(bits, group_size, symmetric, dtype, bias, g, E=E, H=H, I=I, device="cpu"):
    """Random codes in the ``triton`` layout (pack_bytes, as its encode writes them) and the reference's
    fp32 weights from the same codes. Built by hand rather than by ``encode``: the layout refuses
    biases and channelwise scales (vLLM's Triton path does), the kernel takes them."""
    from moeconvert.kernels.moe_wna16 import WNA16Weights
    from moeconvert.layouts.triton_wna16 import pack_bytes
    from moeconvert.runtime.reference import DequantizedExperts, _dequant_wna16
    from moeconvert.schemes import WNA16Scheme

    s = WNA16Scheme(bits, group_size, symmetric, "float16")

    def proj(N, K):
        u = torch.randint(0, 1 << bits, (E, N, K), generator=g).to(device)
        G = s.groups(K)
        # scales ~ 1/(sqrt(K) * 2^(b-1)) keep the outputs O(1) whatever the bits
        sc = ((torch.rand(E, N, G, generator=g) + 0.5) / (K ** 0.5 * (1 << (bits - 1)))).to(device, dtype)
        z = None if symmetric else torch.randint(0, 1 << bits, (E, N, G), generator=g).to(device)
        b = (torch.randn(E, N, generator=g) * 0.1).to(device, dtype) if bias else None
        w = WNA16Weights(pack_bytes(u, bits, 2), sc, None if z is None else pack_bytes(z, bits, 1), b)
        return w, _dequant_wna16(u, sc, z, s), None if b is None else b.float()

    w13, f13, b13 = proj(2 * I, H)
    w2, f2, b2 = proj(H, I)
    return w13, w2, DequantizedExperts(f13, f2, b13, b2)


def _run_direct(case: dict) -> dict:
    from moeconvert.kernels.moe_wna16 import fused_moe_wna16
    from moeconvert.runtime.reference import activation_fn, reference_moe

    g = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    dtype = getattr(torch, case["dtype"])
    bits, gs, sym = QUANTS[case["quant"]]
    w13, w2, ref_w = _make_weights(bits, gs, sym, dtype, case["bias"], g)
    offset = case.get("offset", OFFSET)
    M = case["M"]
    x = torch.randn(M, H, generator=g).to(dtype)
    ids = torch.randint(0, E_GLOBAL if offset else E, (M, TOP_K), generator=g, dtype=torch.int32)
    if offset:  # both sides of the cut occur, and token 0 has a local expert
        ids[0] = torch.tensor([0, OFFSET], dtype=torch.int32)
        if M > 1:
            ids[1] = torch.tensor([E_GLOBAL - 1, OFFSET + 1], dtype=torch.int32)
    tw = torch.rand(M, TOP_K, generator=g)
    act = activation_fn(case["act"], case.get("params"))
    rows = case.get("rows", "gate_up")
    if rows == "interleaved":  # the kernel reads even/odd columns; the reference wants [gate; up]
        perm = torch.stack([torch.arange(I), torch.arange(I) + I], 1).reshape(-1)
        assert w13.zero_point is None  # (zero-point rows pair channels: a symmetric case keeps this simple)
        w13 = type(w13)(w13.qweight[:, perm], w13.scale[:, perm], None,
                        None if w13.bias is None else w13.bias[:, perm])
    y = fused_moe_wna16(x, w13, w2, tw, ids, act, bits=bits, group_size=gs, expert_offset=offset, w13_rows=rows)
    want = reference_moe(x.float(), ref_w, tw, ids, act, expert_offset=offset)
    return {"rel": rel(y, want), "dtype": str(y.dtype), "shape": list(y.shape), "finite": bool(y.isfinite().all()),
            "nonzero": bool(want.abs().sum() > 0)}


# ---------------------------------------------------------------------------------------------------
# 3. through the runtime: load(..., kernel="triton") of `repack --backend triton` folders

LOADS = {
    "w4a16-g32-sym": dict(args=dict(scheme="w4a16", group_size=32), repack=[], load={}),
    "w4a16-g64-asym-ep1of2": dict(args=dict(scheme="w4a16", group_size=64, symmetric=False),
                                  repack=["--ep-size", "2", "--ep-rank", "1"], load=dict(ep_size=2, ep_rank=1)),
}


def _run_load(folder: str, load_kw: dict) -> dict:
    from moeconvert.runtime import load

    model = load(folder, device="cpu", kernel="triton", **load_kw)
    layer = next(iter(model))
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, layer.hidden_size, generator=g)).to(torch.float16)
    ids = torch.randint(0, layer.entry.num_experts_global, (7, 2), generator=g, dtype=torch.int32)
    w = torch.rand(7, 2, generator=g)
    y = layer(x, w, ids)
    want = layer.reference(x, w, ids)
    return {"rel": rel(y, want), "kernel": layer.kernel, "dtype": str(y.dtype), "shape": list(y.shape),
            "want_shape": list(want.shape), "nonzero": bool(want.float().abs().sum() > 0)}


def _child(work: Path) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    spec = json.loads((work / "spec.json").read_text())
    results = {}
    for case in DIRECT:
        record(results, case["id"], _run_direct, case)
    for name, folder in spec["loads"].items():
        record(results, "load-" + name, _run_load, folder, LOADS[name]["load"])
    (work / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory, example_ckpt):
    pytest.importorskip("triton")
    work = tmp_path_factory.mktemp("kernels")
    loads = {}
    for name, spec in LOADS.items():
        src = example_ckpt("qwen3-moe", num_layers=1, num_experts=4, **spec["args"])
        out = work / name
        cli("repack", src, out, "--backend", "triton", *spec["repack"], expect=0)
        loads[name] = str(out)
    (work / "spec.json").write_text(json.dumps({"loads": loads}))
    run_child(__file__, "child", work, timeout=300)
    return json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("case", DIRECT, ids=[c["id"] for c in DIRECT])
def test_fused_moe_matches_the_reference_interpreted(interpreted, case):
    r = result(interpreted, case["id"])
    assert r["dtype"] == "torch." + case["dtype"] and r["shape"] == [case["M"], H]
    assert r["finite"] and r["nonzero"]
    assert r["rel"] < TOL[case["dtype"]], r


@pytest.mark.parametrize("name", list(LOADS))
def test_runtime_dispatches_a_triton_folder_to_our_kernel_interpreted(interpreted, name):
    r = result(interpreted, "load-" + name)
    assert r["kernel"] == "triton"
    assert r["dtype"] == "torch.float16" and r["shape"] == r["want_shape"] and r["nonzero"]
    assert r["rel"] < TOL["float16"], r


# ---------------------------------------------------------------------------------------------------
# 4. GPU: bf16 on a Qwen3-30B-A3B-shaped layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["int4-sym-g128", "int4-asym-g32", "int8-g128"])
@pytest.mark.parametrize("M", [1, 64, 512])
def test_fused_moe_bf16_realistic_shape_gpu(quant, M):
    from moeconvert.kernels.moe_wna16 import fused_moe_wna16
    from moeconvert.runtime.reference import activation_fn, reference_moe

    bits, gs, sym = {"int4-sym-g128": (4, 128, True), "int4-asym-g32": (4, 32, False), "int8-g128": (8, 128, True)}[quant]
    E, H, I, k = 64, 2048, 768, 8
    g = torch.Generator().manual_seed(M)
    w13, w2, ref_w = _make_weights(bits, gs, sym, torch.bfloat16, False, g, E=E, H=H, I=I, device="cuda")
    x = torch.randn(M, H, generator=g).to("cuda", torch.bfloat16)
    logits = torch.randn(M, E, generator=g).cuda()
    tw, ids = torch.topk(torch.softmax(logits, -1), k)
    act = activation_fn("silu")
    y = fused_moe_wna16(x, w13, w2, tw, ids.to(torch.int32), act, bits=bits, group_size=gs)
    want = reference_moe(x.float(), ref_w, tw, ids, act)
    assert y.dtype == torch.bfloat16 and y.shape == (M, H)
    assert rel(y, want) < TOL["bfloat16"]


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    _child(Path(sys.argv[2]))
