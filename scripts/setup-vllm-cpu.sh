#!/usr/bin/env bash
# A virtual environment with vLLM's Python on the CPU, for the vLLM plugin tests:
#   ./scripts/setup-vllm-cpu.sh VENV && MOECONVERT_VLLM_PYTHON=VENV/bin/python python3 -m pytest tests/test_vllm_plugin.py
#   VLLM_VERSION=0.34.0 ./scripts/setup-vllm-cpu.sh VENV     # another version the plugin serves (default 0.33.0)
# vLLM's wheel is a CUDA build pinned to torch 2.14; its Python modules import and build MoE layers on the
# CPU platform (VLLM_TARGET_DEVICE=cpu) with torch 2.13's CPU build, so the wheel goes in without its
# dependencies and these are installed beside it: the modules `import vllm.model_executor.layers.fused_moe`
# and vLLM's compressed-tensors config import, at the versions that vLLM version asks for where it pins one
# (its wheel's METADATA; the pins that differ between the versions served are set per version below).
# vLLM goes in last: pip checks what each install leaves, and after a wheel installed without its
# dependencies every later install would print one `ERROR: vllm X requires ...` line per pin this
# environment does not meet on purpose (CUDA torch 2.14, torchaudio, flashinfer, ...). Its own install
# skips that check (--no-warn-conflicts) for the same reason; the installs before it keep theirs.
set -euo pipefail
venv=${1:?usage: [VLLM_VERSION=0.33.0|0.34.0] setup-vllm-cpu.sh VENV}
version=${VLLM_VERSION:-0.33.0}
case "$version" in
  0.33.0) pins=("transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0" "filelock>=3.20.3") ;;
  0.34.0) pins=("transformers>=5.16.1,<5.23.0" "huggingface_hub>=2.0.0" "filelock>=4.2.4") ;;
  *) echo "setup-vllm-cpu.sh: VLLM_VERSION must be 0.33.0 or 0.34.0 (the versions the plugin serves), not $version" >&2
     exit 2 ;;
esac
cd "$(dirname "$0")/.."
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "torch==2.13.0"
echo "torch==2.13.0" > "$venv/constraints.txt"
# numpy < 2.4: Triton 3.6's interpreter (vLLM's Triton pin; moeconvert's own kernel runs under it in the
# plugin's triton-fast tests) converts one-element arrays to loop bounds with int(), which NumPy 2.4 refuses
"$py" -m pip install -q -c "$venv/constraints.txt" "numpy<2.4" regex "pydantic>=2.12" typing_extensions \
  "${pins[@]}" "safetensors>=0.6.2" "compressed-tensors==0.17.0" \
  packaging tqdm psutil requests pyyaml pyzmq cbor2 aiohttp cachetools cloudpickle msgspec pybase64 \
  pillow einops py-cpuinfo uvloop prometheus_client partial_json_parser "openai>=2.25.0" "oss-harmony>=0.0.11" \
  "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0" "fastapi[standard]>=0.133.0,<0.137.0" "triton==3.6.0"
"$py" -m pip install -q --no-deps -e .
# humming-kernels (vLLM 0.33.0's pin, for the plugin's humming tests) imports on the CPU with cuda-bindings
# (its CUDA ops are never called there); its other dependencies are vLLM's own or CUDA toolkits, left out
"$py" -m pip install -q -c "$venv/constraints.txt" "cuda-bindings==13.*"
"$py" -m pip install -q --no-deps --no-warn-conflicts "vllm==$version"
humming_whl=$(ls .oracles/humming_kernels-0.1.19-*.whl 2>/dev/null | tail -1 || true)
"$py" -m pip install -q --no-deps --no-warn-conflicts "${humming_whl:-humming-kernels==0.1.19}"
# The CUDA wheel has no vllm._C for the CPU platform, which vLLM reports as a warning on import; expected
# here (the plugin tests use no vLLM op from it), so only vLLM's errors are shown.
VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=ERROR "$py" -c "import vllm, vllm.model_executor.layers.fused_moe, vllm.utils.humming, humming; print('vLLM', vllm.__version__, 'and humming', humming.__version__, 'import on the CPU')"
