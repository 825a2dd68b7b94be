#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (for the quantization comparison in docs/benchmarks.md) from the
# source vendored in the llama-cpp-python sdist on PyPI, tuned to this CPU (-DGGML_NATIVE=ON).
#
#   scripts/build_llama_cpp.sh [BUILD_DIR]      # default /tmp/llama.cpp; prints the llama-server path
#
# Environment: LLAMA_CPP_PYTHON_VERSION=0.3.36 (the sdist whose vendor/llama.cpp is built)
set -euo pipefail
BUILD=${1:-/tmp/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PIP=${PIP:-"$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/pip"}
mkdir -p "$BUILD"
cd "$BUILD"
if [[ ! -f "llama_cpp_python-$VERSION.tar.gz" ]]; then
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d . > /dev/null
fi
if [[ ! -d "llama_cpp_python-$VERSION" ]]; then tar xzf "llama_cpp_python-$VERSION.tar.gz"; fi
SRC="$BUILD/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$BUILD/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > "$BUILD/cmake.log"
cmake --build "$BUILD/build" --target llama-server -j "$(nproc)" > "$BUILD/build.log"
echo "$BUILD/build/bin/llama-server"
