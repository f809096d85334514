#!/usr/bin/env bash
# What the tests need, on top of scripts/setup.sh, in the current Python environment:
#   * the test extras (pytest, transformers) and Ray (the `--executor ray` tests start a local Ray head);
#   * the engines' sources the oracle tests read as the reference, downloaded once into .oracles/
#     (tests/conftest.py finds them there): vLLM's wheels, one per version the oracles check (0.33.0, 0.34.0:
#     their Python, and triton_kernels as vendored in vllm/third_party), FlashInfer's Python (flashinfer-python)
#     and humming-kernels, at the versions vLLM 0.33.0 pins;
#   * vLLM's Python on the CPU in an environment of its own, .venv-vllm-cpu/, for the tests that run vLLM's
#     MoE layer and model loader with moeconvert's plugin (vLLM pins its own torch, transformers and
#     compressed-tensors; about 3 GB). MOECONVERT_SKIP_VLLM=1 leaves it out, and those tests then skip
#     saying why.
# Safe to run again: what is already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
./scripts/setup.sh
"$PY" -m pip install -q -e ".[test,ray]"

# the oracle sources; .oracles/.complete marks a finished download
vllm_pin=$(grep -oE '"vllm==[0-9][0-9.]*"' pyproject.toml | tr -d '"')  # the [vllm] extra's pin
if [ ! -e .oracles/.complete ] || ! ls .oracles/"${vllm_pin/==/-}"-*.whl .oracles/humming_kernels-*.whl >/dev/null 2>&1; then
  rm -rf .oracles && mkdir -p .oracles
  "$PY" -m pip download -q --no-deps "$vllm_pin" -d .oracles
  wheel=$(ls .oracles/"${vllm_pin/==/-}"-*.whl)
  # FlashInfer's Python at the version vLLM's wheel requires (its METADATA), and triton_kernels unpacked
  # from the vLLM wheel (a folder holding triton_kernels/, as the triton_kernels oracle tests take it)
  "$PY" - "$wheel" <<'PYEOF'
import re, subprocess, sys, zipfile
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
    pin = re.search(r"^Requires-Dist: (flashinfer-python==\S+)", text, re.M).group(1)
    humming = "humming-kernels" + re.search(r"^Requires-Dist: humming-kernels(?:\[[^\]]*\])?(==[^\s;]+)", text, re.M).group(1)
    prefix = "vllm/third_party/triton_kernels/"
    for name in z.namelist():
        if name.startswith(prefix):
            z.extract(name, ".oracles/triton_kernels-from-vllm")
subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", pin, humming, "-d", ".oracles"], check=True)
PYEOF
  touch .oracles/.complete
fi
# every other vLLM version the oracle tests check (tests/helpers.py VLLM_VERSIONS), each its own wheel; FlashInfer
# and humming-kernels stay those the pinned version asks for (0.34.0 pins flashinfer-python 0.7.3, which is not
# on every index). Only a missing wheel is downloaded, into a temporary folder first so that an interrupted
# download leaves none behind.
for v in 0.34.0; do
  if ! ls .oracles/vllm-"$v"-*.whl >/dev/null 2>&1; then
    tmp=$(mktemp -d .oracles/.download.XXXXXX)
    "$PY" -m pip download -q --no-deps "vllm==$v" -d "$tmp"
    mv "$tmp"/vllm-"$v"-*.whl .oracles/ && rm -rf "$tmp"
  fi
done

if [ -z "${MOECONVERT_SKIP_VLLM:-}" ] && [ ! -e .venv-vllm-cpu/.complete ]; then
  rm -rf .venv-vllm-cpu
  ./scripts/setup-vllm-cpu.sh .venv-vllm-cpu
  touch .venv-vllm-cpu/.complete
fi
