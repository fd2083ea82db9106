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

extras=""
[ "${1:-}" = "--dev" ] && extras="[test]"
"${pip[@]}" install -q -e ".${extras}"
