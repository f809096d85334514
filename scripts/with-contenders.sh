#!/usr/bin/env bash
# Run a command with the engines' MoE kernels that `moeconvert bench kernel` compares against, from a
# folder prepared on a machine with network access (for GPU machines without it):
#
#   DIR/vllm_moe_C.so.xz               vLLM 0.33.0's vllm/_moe_C_stable_libtorch.abi3.so, xz-compressed
#   DIR/triton_kernels/                vLLM 0.33.0's vllm/third_party/triton_kernels
#   DIR/humming_kernels-0.1.19-*.whl   pip download --no-deps humming-kernels==0.1.19
#
#   scripts/with-contenders.sh DIR moeconvert bench kernel [--tune] ...
#
# Installs moeconvert (editable, no dependencies) and the humming wheel into the current Python if
# they are missing, unpacks the ops library to /tmp, and points moeconvert at both.
set -euo pipefail
dir=$(cd "${1:?usage: with-contenders.sh DIR COMMAND...}" && pwd)
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import moeconvert" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e .
if ! "$PY" -c "import humming" 2>/dev/null; then
  whl=$(ls "$dir"/humming_kernels-*.whl 2>/dev/null | tail -1 || true)
  if [ -n "$whl" ]; then "$PY" -m pip install -q --no-deps "$whl"; else echo "no humming wheel in $dir" >&2; fi
fi
lib=/tmp/moeconvert-vllm_moe_C.so
[ -f "$lib" ] || { [ -f "$dir/vllm_moe_C.so.xz" ] && xz -d -c "$dir/vllm_moe_C.so.xz" > "$lib"; } || true
[ -f "$lib" ] && export MOECONVERT_VLLM_MOE_LIB=$lib
[ -d "$dir/triton_kernels" ] && export MOECONVERT_TRITON_KERNELS_SRC=$dir
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/humming_jit/cache} HUMMING_TMP_DIR=${HUMMING_TMP_DIR:-/tmp/humming_jit/tmp}
"$@"
