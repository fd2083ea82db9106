# Sourced by the docs/gpu scripts that run kvchat from this checkout on a CUDA machine: the wheels of .whl/ installed
# beside the image's torch and triton, the package importable as `kvchat`, a scratch KVCHAT_HOME, and the machine
# (card, cores, date) written to $OUT/machine.txt beside the results.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvchat
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 KVCHAT_HOME=/tmp/kvhome
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u; } > "$OUT/machine.txt"
