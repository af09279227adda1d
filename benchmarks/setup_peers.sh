#!/usr/bin/env bash
# Build the peers BENCHMARKS.md measures against, from source, into one folder:
# llama-cpp-python (the offline peer), llama.cpp's llama-server (the online peer)
# and the Python packages its GGUF converter imports (two llama.cpp builds: 10-15 min on 2 quiet cores,
# far longer on a loaded machine).
#
#   benchmarks/setup_peers.sh [folder]      # default: ../peers next to the checkout
#
# Then it prints the two variables benchmarks/run_suite.sh needs.
set -euo pipefail
VERSION=0.3.36
DEST=$(realpath -m "${1:-$(dirname "$0")/../../peers}")
mkdir -p "$DEST" && cd "$DEST"

python -m pip install -q "transformers>=4.57" sentencepiece gguf
if [ ! -d "llama_cpp_python-$VERSION" ]; then
    python -m pip download -q "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d .
    tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
# -march=native like Octavo's own kernels: both peers get this CPU's full instruction set. Only what the
# comparisons use is built: the text model library (no multimodal llava/mtmd library), then llama-server alone
# (no tests, tools or examples configured).
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" python -m pip install -q "./llama_cpp_python-$VERSION"
SRC="$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > /dev/null
cmake --build "$SRC/build" --target llama-server -j "$(nproc)" > /dev/null

echo "export LLAMA_CPP_SRC=$SRC"
echo "export LLAMA_SERVER=$SRC/build/bin/llama-server"
