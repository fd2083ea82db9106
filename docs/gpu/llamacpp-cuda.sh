#!/usr/bin/env bash
# llama.cpp's own CUDA build on the lent GPU machine: the yardstick for kvchat's engine on the same file and card.
#   here, once, from the project root:  ../shared/gpu/llamacpp-cuda.sh prepare   # .llsrc/llama.cpp.tar.gz (~12 MB)
#   on the GPU machine (carry .llsrc):   bash ../shared/gpu/llamacpp-cuda.sh build  # ~4 min on 16 cores, sm_90
#                                        bash ../shared/gpu/llamacpp-cuda.sh bench MODEL.gguf [DEPTHS]
# (A copy of ../shared/gpu/llamacpp-cuda.sh: on the GPU machine ../shared is not there.)
# The build folder lives in /tmp/lbuild while the machine stays warm, so a build cut off by the time limit goes on
# in the next call. llama-bench: -ngl 99 -fa 1, pp1024 and tg128 at each depth, three repetitions.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=/tmp/lbuild
case "${1:-}" in
  prepare)
    root=$(git rev-parse --show-toplevel); cd "$root"
    grep -qx '/.llsrc/' .git/info/exclude 2>/dev/null || echo '/.llsrc/' >> .git/info/exclude
    version=$(python3 -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || echo 0.3.36)
    t=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary :all: -d "$t" "llama-cpp-python==$version" || exit 1
    tar xzf "$t"/llama_cpp_python-*.tar.gz -C "$t"
    src=$(ls -d "$t"/llama_cpp_python-*/vendor/llama.cpp)
    rm -rf "$src"/.git "$src"/models/*.gguf "$src"/docs "$src"/.github "$src"/media
    mkdir -p .llsrc && tar czf .llsrc/llama.cpp.tar.gz -C "$(dirname "$src")" llama.cpp && rm -rf "$t"
    ls -la .llsrc ;;
  build)
    [ -d /tmp/llama.cpp ] || tar xzf .llsrc/llama.cpp.tar.gz -C /tmp
    [ -f $B/CMakeCache.txt ] || cmake -S /tmp/llama.cpp -B $B -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_TYPE=Release > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    timeout 560 cmake --build $B --target llama-bench -j "$(nproc)" > "$OUT/build.log" 2>&1; echo "build rc=$?"
    tail -3 "$OUT/build.log" ;;
  bench)
    timeout 500 $B/bin/llama-bench -m "$2" -ngl 99 -fa 1 -p 1024 -n 128 -d "${3:-0,8192,32768}" -r 3 -o md \
      > "$OUT/llama-bench.md" 2> "$OUT/llama-bench.log"; echo "llama-bench rc=$?"; cat "$OUT/llama-bench.md" ;;
  *) echo "usage: $0 prepare | build | bench MODEL.gguf [DEPTHS]" >&2; exit 2 ;;
esac
