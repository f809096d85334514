#!/usr/bin/env bash
# Install moeconvert (editable) into the current Python environment, with what `moeconvert example` needs
# (transformers, the real producer of its checkpoints): everything the README's main job runs, nothing more.
# The tests need more: scripts/setup-tests.sh. Safe to run again: it installs nothing that is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  # Without torch, pip resolves `torch` to a multi-GB CUDA build. A pinned 2.13.0 is a CPU build
  # where one is on local disk (the CI machine) and PyPI's default (CUDA) build on a GPU machine.
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[example]"
