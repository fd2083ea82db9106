#!/usr/bin/env bash
# Installs kvchat into ./.venv (created when missing).   ./install.sh          the app
#                                                         ./install.sh --dev    the app and its test tools
# PyTorch first, chosen for this machine: an unpinned `torch` from PyPI brings several GB of CUDA libraries,
# which a machine without an NVIDIA GPU does not need.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" install torch                      # PyPI's Linux build is the CUDA one
  elif "${pip[@]}" install -q --no-index --no-deps torch==2.13.0 2>/dev/null; then
    "${pip[@]}" install -q torch==2.13.0           # a CPU wheel kept on this machine (find-links); deps from PyPI
  else
    "${pip[@]}" install torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi

# llama-cpp-python comes as source only, and pip builds it for the CPU at hand (-march=native). On an x86-64 CPU
# with AMX that build crashed inside llama.cpp (gemma-3-270m, the tests' Q4 models: a segfault; an illegal
# instruction where the wheel was carried to another CPU, 2026-11-26), and which SIMD paths it takes decides how
# llama.cpp rounds, which the parity tests see. So on x86-64 it is built for AVX2, which every such CPU of the last
# decade has: the same code on each. pip reuses a built wheel by the source's name, not its build flags: this build
# has a cache of its own.
if [ "$(uname -m)" = x86_64 ] && [ -z "${CMAKE_ARGS:-}" ] \
    && ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  llama=$(grep -o '"llama-cpp-python[^"]*"' pyproject.toml | tr -d '"')
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    PIP_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/kvchat/pip-llama-avx2" "${pip[@]}" install -q "$llama"
fi

extras=""
[ "${1:-}" = "--dev" ] && extras="[test]"
"${pip[@]}" install -q -e ".${extras}"
