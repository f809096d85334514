"""``moeconvert bench vllm-serve SRC OUT``: vLLM's whole engine started on the source and on the converted
folder, each in a fresh process, alternating; the start-up time and the greedy tokens.

Each run is ``python -m moeconvert.bench.vllm_engine FOLDER``: ``vllm.LLM(FOLDER)`` in one process (no
engine subprocess), eager mode, the same MoE backend for both (the folder's: Marlin or Triton), then a few fixed prompts greedily.
The source's start-up includes vLLM's own repack (or online quantization) of every MoE layer; the
folder's only the plugin's loading. Everything else (reading the files, building the model, profiling
memory, the KV cache) is the same work for both.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def engine_run(folder: Path, *, moe_backend: str = "marlin", quantization: str | None = None,
               attention_backend: str = "TRITON_ATTN", max_tokens: int = 8) -> dict:
    """Start ``vllm.LLM`` on ``folder`` in this process and generate; what the bench and tests compare."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    cfg = json.loads((folder / "config.json").read_text())
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype=(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), enforce_eager=True,
              max_model_len=256, seed=0, gpu_memory_utilization=0.5, skip_tokenizer_init=True,
              attention_backend=attention_backend, moe_backend=moe_backend, compilation_config={"mode": 0},
              quantization=quantization)
    init_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j + 1) % vocab for j in range(5 + 3 * i)]} for i in range(4)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, detokenize=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    return {"folder": str(folder), "init_s": init_s,
            "quantization": llm.llm_engine.vllm_config.model_config.quantization,
            "tokens": [list(o.outputs[0].token_ids) for o in got],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in got]}


def _child(folder: Path, moe_backend: str, quantization: str | None, timeout: float) -> dict:
    p = subprocess.run([sys.executable, "-m", "moeconvert.bench.vllm_engine", str(folder), moe_backend,
                        *([quantization] if quantization else [])],
                       capture_output=True, text=True, timeout=timeout)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"vLLM on {folder} failed (exit {p.returncode}): {tail}")
    r = json.loads(lines[-1])
    if "error" in r:
        raise ValueError(f"vLLM on {folder}: {r['error']}")
    return r


def bench_vllm_serve(src: Path | str, out_dir: Path, *, runs: int = 2, moe_backend: str | None = None,
                     timeout: float = 900, progress=None) -> dict:
    from moeconvert.sources import open_source

    src = open_source(str(src)).root  # a folder, or a Hub repo id (its snapshot in the Hub cache)
    manifest = json.loads((out_dir / "moeconvert.json").read_text())
    if moe_backend is None:  # the backend the folder's layout is for: marlin | triton
        moe_backend = manifest["layout"]["name"]
    # a bf16 source converted to MXFP4 is served by vLLM with its online MXFP4: `--quantization mxfp4`
    unquantized = not json.loads((src / "config.json").read_text()).get("quantization_config")
    src_quant = "mxfp4" if unquantized and (manifest["scheme"] or {}).get("kind") == "mxfp4" else None
    src_runs, out_runs = [], []
    for _ in range(runs):  # alternating, so drift on the machine hits both alike
        src_runs.append(_child(src, moe_backend, src_quant, timeout))
        out_runs.append(_child(out_dir, moe_backend, None, timeout))
        if progress:
            progress(1)
    a, b = src_runs[-1], out_runs[-1]
    worst = max((abs(x - y) for p, q in zip(a["logprobs"], b["logprobs"]) for x, y in zip(p, q)), default=0.0)
    med = lambda rs: statistics.median(r["init_s"] for r in rs)
    return {"source": str(src), "folder": str(out_dir), "runs": runs, "moe_backend": moe_backend,
            "source_quantization": a["quantization"], "folder_quantization": b["quantization"],
            "source_init_s": [r["init_s"] for r in src_runs], "folder_init_s": [r["init_s"] for r in out_runs],
            "median_source_init_s": med(src_runs), "median_folder_init_s": med(out_runs),
            "same_tokens": a["tokens"] == b["tokens"], "max_logprob_diff": worst}


def main() -> None:
    folder, backend = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "marlin"
    quantization = sys.argv[3] if len(sys.argv) > 3 else None
    try:
        r = engine_run(folder, moe_backend=backend, quantization=quantization)
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        import traceback

        r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    print(json.dumps(r))
    sys.stdout.flush()
    os._exit(0)  # the engine's threads would keep the process alive


if __name__ == "__main__":
    main()
