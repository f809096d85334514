"""``moeconvert bench convert`` runs the conversions it times and reports what it measured (no timing
is asserted: only that the figures exist, are consistent and came from real, successful runs)."""

import json

import pytest

from helpers import cli


def test_bench_convert_reports_each_run(example_ckpt, tmp_path):
    src = example_ckpt("qwen3-moe", "bf16")
    run = cli("bench", "convert", src, "--backend", "plain", "--format", "mxfp4", "--runs", "2", "--workdir", tmp_path,
              "--json", expect=0)
    r = json.loads(run.out)
    assert r["runs"] == 2 and len(r["convert_seconds"]) == len(r["cp_seconds"]) == len(r["dry_run_seconds"]) == 2
    assert 0 < r["output_bytes"] < r["source_bytes"]  # MXFP4 is smaller than bf16: the output really was written
    assert all(x > 0 for x in r["convert_peak_rss_bytes"])
    assert min(r["convert_seconds"]) <= r["median_convert_seconds"] <= max(r["convert_seconds"])
    assert list(tmp_path.iterdir()) == []  # outputs cleaned up


def test_bench_convert_fails_loudly_when_the_conversion_fails(example_ckpt, tmp_path):
    src = example_ckpt("qwen3-moe", "bf16")  # float experts: repack --backend marlin refuses them
    run = cli("bench", "convert", src, "--backend", "marlin", "--runs", "1", "--workdir", tmp_path, expect=2)
    assert "benchmark command failed" in run.err


def test_vllm_startup_compares_each_parameter_with_vllms_of_the_same_role():
    """vLLM keeps our names where its processing replaces the parameters (humming: ``w13_weight``; MXFP4) and
    its compressed-tensors names where Marlin repacks in place (``w13_weight_packed``): each is found."""
    import torch

    from moeconvert.bench.vllm_startup import _same_bytes

    def module(**params):
        m = torch.nn.Module()
        for k, v in params.items():
            m.register_parameter(k, torch.nn.Parameter(v, requires_grad=False))
        return m

    w, s = torch.arange(8, dtype=torch.int32), torch.ones(4, dtype=torch.bfloat16)
    ours = module(w13_weight=w, w13_weight_scale=s)
    assert _same_bytes(ours, module(w13_weight=w.clone(), w13_weight_scale=s.clone())) == \
        {"w13_weight": True, "w13_weight_scale": True}
    assert _same_bytes(ours, module(w13_weight_packed=w + 1, w13_weight_scale=s)) == \
        {"w13_weight": False, "w13_weight_scale": True}
    assert _same_bytes(ours, module(w13_weight_scale=s))["w13_weight"] == "vLLM holds no such tensor"


@pytest.mark.parametrize("name", ["marlin", "humming", "triton", "triton-fast"])
def test_vllm_startup_compares_bytes_only_for_layouts_vllms_processing_makes(name):
    """triton-fast is moeconvert's own layout: vLLM's Triton WNA16 experts hold other tensors for the same
    source, so their shapes are not a mismatch to report (the H200 run listed each as one)."""
    from moeconvert.bench.vllm_startup import bytes_compared
    from moeconvert.layouts import get_layout

    got = bytes_compared(get_layout(name))
    if name == "triton-fast":
        assert got == "no: vLLM's processing never makes the triton-fast layout (moeconvert.kernels " \
                      "fused_moe_fast (kernels/moe_fast.py))"
    else:
        assert got is True


def test_vllm_serve_reads_vllms_load_records_and_the_peaks_at_that_moment():
    """``bench vllm-serve``'s figures come from vLLM's own log records, in vLLM 0.33.0's words; the peaks are
    read when "Model loading took" arrives (right after the weights are processed), not at the end."""
    import logging

    from moeconvert.bench.vllm_engine import _LoadRecords

    records, log = _LoadRecords(), logging.getLogger("vllm.test_bench_records")
    log.addFilter(records)
    log.propagate = False
    log.setLevel(logging.INFO)  # as vLLM sets its loggers (VLLM_LOGGING_LEVEL's default)
    try:
        log.info("Initializing model took %.6f seconds", 1.25)
        log.info("Loading weights took %.2f seconds", 10.5)
        log.info("unrelated: Loading weights took 99 seconds later")  # only the first record of a kind counts
        assert "load_peak_host_gib" not in records.values
        log.info("Model loading took %s GiB memory and %.6f seconds", "16.02", 14.0)
    finally:
        log.removeFilter(records)
    v = records.values
    assert (v["init_model_s"], v["load_weights_s"], v["model_load_s"], v["model_gib"]) == (1.25, 10.5, 14.0, 16.02)
    assert v["load_peak_host_gib"] > 0


def test_the_load_peak_comes_from_the_allocators_history_not_its_reset_peak():
    """vLLM's model-loading profiler resets the allocator's peak as it ends, just before "Model loading took":
    the H200 run read 15.59 GiB for a source whose Marlin repack holds a second copy of each layer over a
    15.55 GiB model. The peak is taken from the recorded allocations and frees instead: here a repack that
    allocates a layer's new copy and a workspace before freeing the old copy."""
    from moeconvert.bench.vllm_engine import trace_peak

    GiB = 1 << 30
    model, layer = 15 * GiB, GiB // 4

    def ev(action, size):
        return {"action": action, "size": size, "addr": 0, "stream": 0}

    events = [ev("alloc", model)]
    for _ in range(3):  # per layer: new copy, workspace, free the old copy and the workspace
        events += [ev("alloc", layer), ev("alloc", layer), ev("free_requested", layer), ev("free_completed", layer),
                   ev("free_requested", layer), ev("free_completed", layer), ev("segment_free", 2 * layer)]
    assert trace_peak(events, start_bytes=GiB) == GiB + model + 2 * layer
    # a free requested but not yet completed (another stream still reads the block) is still held
    assert trace_peak([ev("alloc", layer), ev("free_requested", layer), ev("alloc", layer)]) == 2 * layer
    assert trace_peak([]) == 0


def test_vllm_serve_reports_each_run_and_compares_every_runs_tokens(example_ckpt, tmp_path, monkeypatch):
    """Each run's figures come back beside the medians (the H200 report had only the medians, and a prefill
    spread between two runs could not be told from a difference); the tokens of every run, not only the last
    pair, must equal the source's first run's, and the logprob difference is the largest over all of them."""
    from moeconvert.bench import vllm_engine

    src = example_ckpt("qwen3-moe", scheme="w4a16")
    out = tmp_path / "marlin"
    cli("repack", src, out, "--backend", "marlin", expect=0)
    runs = iter([  # source, folder, source, folder: the second source run differs in one token
        {"init_s": 20.0, "prefill_tok_s": 88.0, "tokens": [[1, 2]], "logprobs": [[-0.5, -0.25]]},
        {"init_s": 14.0, "prefill_tok_s": 70.0, "tokens": [[1, 2]], "logprobs": [[-0.5, -0.125]]},
        {"init_s": 30.0, "prefill_tok_s": 90.0, "tokens": [[1, 3]], "logprobs": [[-0.5, -0.25]]},
        {"init_s": 15.0, "prefill_tok_s": 72.0, "tokens": [[1, 2]], "logprobs": [[-0.5, -0.25]]},
    ])
    monkeypatch.setattr(vllm_engine, "_child", lambda folder, *a, **kw: {
        **next(runs), "max_model_len": 256, "quantization": "moeconvert" if folder == out else "compressed-tensors"})
    r = vllm_engine.bench_vllm_serve(src, out, runs=2)
    assert [x["prefill_tok_s"] for x in r["source_runs"]] == [88.0, 90.0]
    assert [x["prefill_tok_s"] for x in r["folder_runs"]] == [70.0, 72.0]
    assert r["source_medians"]["prefill_tok_s"] == 89.0 and r["folder_medians"]["init_s"] == 14.5
    assert r["source_runs"][0]["decode_tok_s"] is None  # not measured: said, not left out
    assert r["same_tokens"] is False  # the last pair agrees; the second source run does not
    assert r["max_logprob_diff"] == 0.125


def test_vllm_serve_profile_reports_the_last_runs_kernels(example_ckpt, tmp_path, monkeypatch):
    """--profile: the profiled round of the last run of each side comes back; an earlier run's is not taken."""
    from moeconvert.bench import vllm_engine

    src = example_ckpt("qwen3-moe", scheme="w4a16")
    out = tmp_path / "marlin"
    cli("repack", src, out, "--backend", "marlin", expect=0)
    runs = iter([{"init_s": float(i), "tokens": [[1]], "logprobs": [[-0.5]], "prefill_kernels": {"wall_ms": i},
                  "decode_kernels": {"wall_ms": 10 + i}} for i in range(4)])
    monkeypatch.setattr(vllm_engine, "_child", lambda folder, *a, **kw: {
        **next(runs), "max_model_len": 256, "quantization": None})
    speed = {"prefill_len": 8, "prefill_batch": 1, "decode_batch": 1, "decode_tokens": 2, "profile": True}
    r = vllm_engine.bench_vllm_serve(src, out, runs=2, throughput=speed)
    assert r["kernels"] == {"source": {"prefill_kernels": {"wall_ms": 2}, "decode_kernels": {"wall_ms": 12}},
                            "folder": {"prefill_kernels": {"wall_ms": 3}, "decode_kernels": {"wall_ms": 13}}}


def test_kernel_table_sums_each_kernels_launches_and_ranks_them():
    from moeconvert.bench.vllm_engine import kernel_table

    t = kernel_table([("moe_gemm", 300.0), ("attn", 100.0), ("moe_gemm", 500.0), ("sum", 100.0)], 0.002, top=2)
    assert (t["wall_ms"], t["gpu_busy_ms"], t["launches"]) == (2.0, 1.0, 4)
    assert t["top"] == [{"kernel": "moe_gemm", "launches": 2, "ms": 0.8, "share": 0.8},
                        {"kernel": "attn", "launches": 1, "ms": 0.1, "share": 0.1}]


def test_vllm_serve_refuses_profile_without_throughput(tmp_path):
    r = cli("bench", "vllm-serve", tmp_path / "src", tmp_path / "out", "--profile", expect=2)
    assert r.err.count("\n") == 1 and "--profile" in r.err and "--throughput" in r.err, r.err


def test_the_load_records_survive_vllm_reconfiguring_its_logger():
    """Starting vLLM's engine runs dictConfig on the "vllm" logger (vllm/logger.py: its handlers replaced,
    propagate off), which clears the handlers of "vllm" and of every logger below it: a handler never saw the
    real engine's records. A filter on the writing modules' loggers survives it, and the folder's loader
    writes its own "Loading weights took"."""
    import logging
    import logging.config

    from moeconvert.bench.vllm_engine import _LoadRecords

    records = _LoadRecords()
    loggers = records.listen()
    try:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                                   "handlers": {"null": {"class": "logging.NullHandler"}},
                                   "loggers": {"vllm": {"handlers": ["null"], "level": "INFO", "propagate": False}}})
        logging.getLogger("vllm.model_executor.model_loader.base_loader").info("Initializing model took %.6f seconds", 0.5)
        logging.getLogger("moeconvert.integrations.vllm.loader").info("Loading weights took %.2f seconds", 3.25)
        logging.getLogger("vllm.v1.worker.gpu.model_runner").info(
            "Model loading took %.2f GiB memory and %.6f seconds", 15.64, 4.25)
    finally:
        records.stop(loggers)
    v = records.values
    assert (v["init_model_s"], v["load_weights_s"], v["model_load_s"], v["model_gib"]) == (0.5, 3.25, 4.25, 15.64)


def test_vllm_serve_keeps_max_model_len_within_the_models_positions():
    """vLLM refuses a max_model_len beyond max_position_embeddings at start-up: tiny fixtures have 64."""
    from moeconvert.bench.vllm_engine import model_len

    assert model_len({"max_position_embeddings": 64}, 256) == 64
    assert model_len({"text_config": {"max_position_embeddings": 40960}}, 2048) == 2048
    assert model_len({}, 256) == 256
