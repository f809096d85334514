#!/usr/bin/env bash
# What serving from a folder saves, at real size, on one GPU: a Qwen3-30B-A3B-shaped W4A16 checkpoint
# (compressed-tensors pack-quantized, random but valid weights, about 17 GB) is written, converted for each
# layout, and vLLM's engine is started on the source and on each folder, alternating (`bench vllm-serve`).
#
#   scripts/bench-real-size.sh WORKDIR [LAYOUT ...]        (layouts default to: marlin humming)
#
# Needs a CUDA GPU, vLLM (`moeconvert[vllm]`) and, for humming, humming-kernels. From a checkout, install it
# editable (`pip install -e '.[vllm]'`): `python -m` puts the checkout's moeconvert/ first on sys.path, and
# that folder alone lacks moeconvert.runtime and moeconvert.kernels (pyproject.toml maps them from runtime/
# and kernels/), so a regular install's plugin would fail to load there. Writes into WORKDIR: the
# source (src/), one folder per layout (LAYOUT/), each conversion's log, and bench-LAYOUT.json with every run.
# Each layout's first start-up in a process pays its kernels' JIT compiles (humming, Triton); a warm-up
# start of the folder runs before the timed ones (WARMUP=0 leaves it out) so that both the source's and the folder's timed runs
# find warm caches (HUMMING_CACHE_DIR, TRITON_CACHE_DIR persist across processes). After the engine runs,
# `bench vllm-startup` times the load phase layer by layer (STARTUP=0 leaves it out). With DROP=1 each
# layout's folder is removed once measured, so the disk holds the source and one folder at a time.
# FAMILY=deepseek-v3 or kimi-k2 with LAYERS=N writes those models' first N layers instead (a MoE layer is
# 5.6 / 8.5 GB); SERVE=0 leaves out the engine runs (warm-up and vllm-serve), keeping vllm-startup's
# layer-by-layer figures: vLLM's MLA prefill needs FlashAttention or FlashInfer kernels. THROUGHPUT=0 leaves out
# the prefill and decode timing; PROFILE=1 adds a profiled round of each (bench vllm-serve --profile).
set -uo pipefail
work=${1:?usage: bench-real-size.sh WORKDIR [LAYOUT ...]}
shift
layouts=("$@")
[ ${#layouts[@]} -gt 0 ] || layouts=(marlin humming)
PY=${PYTHON:-python3}
speed=--throughput
[ "${THROUGHPUT:-1}" = 1 ] || speed=
[ -n "$speed" ] && [ "${PROFILE:-0}" = 1 ] && speed="$speed --profile"
RUNS=${RUNS:-2}
mkdir -p "$work"
log() { echo "[$(date +%H:%M:%S)] $*"; }
if [ ! -e "$work/src/moeconvert.done" ]; then
  log "writing the source checkpoint"
  t=$(date +%s)
  "$PY" -m moeconvert example "$work/src" --family "${FAMILY:-qwen3-30b-a3b}" ${LAYERS:+--layers "$LAYERS"} \
      --random-weights --scheme w4a16 --device "${DEVICE:-cuda}" --overwrite || exit 1
  touch "$work/src/moeconvert.done"
  log "source written in $(( $(date +%s) - t )) s: $(du -sh "$work/src" | cut -f1)"
fi
for layout in "${layouts[@]}"; do
  if [ ! -e "$work/$layout/moeconvert.json" ]; then  # a finished folder (its manifest is written last) is kept
    log "repack --backend $layout"
    t=$(date +%s)
    "$PY" -m moeconvert repack "$work/src" "$work/$layout" --backend "$layout" --overwrite > "$work/repack-$layout.log" 2>&1 \
      || { log "repack $layout failed: $(tail -1 "$work/repack-$layout.log")"; continue; }
    log "repack $layout: $(( $(date +%s) - t )) s; $(tail -2 "$work/repack-$layout.log" | tr '\n' ' ')"
  fi
  [ -n "${PREPARE_ONLY:-}" ] && continue
  case "$layout" in triton-fast) backend=triton ;; *) backend=$layout ;; esac
  if [ "${SERVE:-1}" = 1 ] && [ "${WARMUP:-1}" = 1 ]; then
    log "warm-up start of the $layout folder (JIT caches)"
    "$PY" -m moeconvert.bench.vllm_engine "$work/$layout" "$backend" - '{"max_model_len": 2048}' > "$work/warmup-$layout.json" 2>"$work/warmup-$layout.err"
    log "warm-up: $(cut -c1-300 "$work/warmup-$layout.json")"
  fi
  if [ "${SERVE:-1}" = 1 ]; then
    log "bench vllm-serve $layout, $RUNS run(s) each, alternating"
    "$PY" -m moeconvert bench vllm-serve "$work/src" "$work/$layout" --runs "$RUNS" --moe-backend "$backend" \
        --max-model-len 2048 $speed --json > "$work/bench-$layout.json" 2>"$work/bench-$layout.err"
    log "bench $layout done (exit $?): $(head -c 2000 "$work/bench-$layout.json")"
  fi
  if [ "${STARTUP:-1}" = 1 ]; then
    log "bench vllm-startup $layout (every MoE layer, vLLM's processing of the source vs the folder's loading)"
    "$PY" -m moeconvert bench vllm-startup "$work/src" "$work/$layout" --moe-backend "$backend" --json \
        > "$work/startup-$layout.json" 2>"$work/startup-$layout.err"
    log "bench vllm-startup $layout done (exit $?): $(head -c 1500 "$work/startup-$layout.json")"
  fi
  [ "${DROP:-0}" = 1 ] && rm -rf "${work:?}/$layout"
done
log "all done"
