#!/usr/bin/env bash
# Every measurement in BENCHMARKS.md, in one go; results (JSON + logs) land in benchmarks/results/.
#
#   eval "$(benchmarks/setup_peers.sh)"     # once: builds llama-cpp-python and llama-server
#   LLAMA_CPP_SRC=.../llama_cpp_python-0.3.36/vendor/llama.cpp LLAMA_SERVER=.../llama-server \
#       benchmarks/run_suite.sh [quick|full] [threads]
#
# quick: llama-100m only, small request counts (~6 min on 2 cores).
# full:  all three models, the request counts BENCHMARKS.md reports (~20 min on 2 quiet cores).
# threads defaults to all cores; use 1 when other jobs share the machine (see BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-quick}
THREADS=${2:-$(nproc)}
M=benchmarks/models
R=benchmarks/results/$MODE
mkdir -p "$R"
: "${LLAMA_CPP_SRC:?set LLAMA_CPP_SRC to llama.cpp's source folder (convert_hf_to_gguf.py)}"
: "${LLAMA_SERVER:?set LLAMA_SERVER to llama.cpp's llama-server binary}"

step() {  # name, then the command; logs its output, wall time and the load around it
    local name=$1; shift
    echo "== $name (load $(cut -d' ' -f1-3 /proc/loadavg))"
    local start=$SECONDS
    "$@" > "$R/$name.log" 2>&1 || { echo "FAILED: see $R/$name.log"; tail -20 "$R/$name.log"; exit 1; }
    grep -v -E "Loading weights|Writing model shards|USDT" "$R/$name.log" | tail -40
    echo "== $name took $((SECONDS - start)) s (load $(cut -d' ' -f1-3 /proc/loadavg))"
}

step models python tools/make_bench_models.py --gguf --llama-cpp-src "$LLAMA_CPP_SRC"
T=(--threads "$THREADS")

if [ "$MODE" = quick ]; then
    step throughput-llama-100m python -m benchmarks.throughput --model $M/llama-100m --num-prompts 32 \
        --hf-batch-sizes 16,32 --llamacpp-max-prompts 8 "${T[@]}" --json "$R/throughput-llama-100m.json"
    step linear-kernels-llama-100m python -m benchmarks.linear_kernels --model $M/llama-100m --rows 1,32,256 \
        --threads "$THREADS" --json "$R/linear-kernels-llama-100m.json"
    step attention-kernel-llama-100m python -m benchmarks.attention_kernel --model $M/llama-100m \
        --threads "$THREADS" --json "$R/attention-kernel-llama-100m.json"
    step step-breakdown-llama-100m python -m benchmarks.step_breakdown --model $M/llama-100m --batch 256 \
        --threads "$THREADS" --json "$R/step-breakdown-llama-100m.json"
    step roofline-llama-100m python -m benchmarks.roofline --model $M/llama-100m --quick --llamacpp "${T[@]}" \
        --json "$R/roofline-llama-100m.json"
    step kv-memory-llama-100m python -m benchmarks.kv_memory --model $M/llama-100m --num-prompts 64 "${T[@]}" \
        --json "$R/kv-memory-llama-100m.json"
    step prefix-llama-100m python -m benchmarks.prefix --model $M/llama-100m --num-prompts 16 \
        --hf-batch-sizes 16 "${T[@]}" --json "$R/prefix-llama-100m.json"
    step online-llama-100m python -m benchmarks.online --model $M/llama-100m --scenarios c8 --num-prompts 16 \
        --max-num-seqs 8 --llama-server "$LLAMA_SERVER" --threads "$THREADS" --out-dir "$R/online" \
        --json "$R/online-llama-100m.json"
    exit 0
fi

step throughput-llama-100m python -m benchmarks.throughput --model $M/llama-100m --num-prompts 256 \
    --hf-max-prompts 32 --hf-batch-sizes 16,32 --llamacpp-max-prompts 16 --repeats 3 "${T[@]}" \
    --json "$R/throughput-llama-100m.json"
step throughput-qwen2.5-0.5b python -m benchmarks.throughput --model $M/qwen2.5-0.5b --num-prompts 64 \
    --hf-max-prompts 16 --hf-batch-sizes 16 --llamacpp-max-prompts 4 "${T[@]}" \
    --json "$R/throughput-qwen2.5-0.5b.json"
# octavo-mini has a 512-token context: lengths clipped to fit.
step throughput-octavo-mini python -m benchmarks.throughput --model $M/octavo-mini --num-prompts 256 \
    --max-input-len 256 --max-output-len 192 --hf-max-prompts 64 --hf-batch-sizes 32,64 \
    --llamacpp-max-prompts 32 --repeats 3 "${T[@]}" --json "$R/throughput-octavo-mini.json"
step linear-kernels-llama-100m python -m benchmarks.linear_kernels --model $M/llama-100m \
    --rows 1,4,16,32,64,128,256,2048 --threads "$THREADS" --json "$R/linear-kernels-llama-100m.json"
step attention-kernel-llama-100m python -m benchmarks.attention_kernel --model $M/llama-100m \
    --threads "$THREADS" --json "$R/attention-kernel-llama-100m.json"
step step-breakdown-llama-100m python -m benchmarks.step_breakdown --model $M/llama-100m --batch 256 \
    --threads "$THREADS" --json "$R/step-breakdown-llama-100m.json"
step roofline-llama-100m python -m benchmarks.roofline --model $M/llama-100m --llamacpp "${T[@]}" \
    --json "$R/roofline-llama-100m.json"
step roofline-qwen2.5-0.5b python -m benchmarks.roofline --model $M/qwen2.5-0.5b --new-tokens 64 --llamacpp \
    --large-batches 64,128,256 "${T[@]}" --json "$R/roofline-qwen2.5-0.5b.json"
step kv-memory-llama-100m python -m benchmarks.kv_memory --model $M/llama-100m --num-prompts 256 "${T[@]}" \
    --json "$R/kv-memory-llama-100m.json"
step prefix-llama-100m python -m benchmarks.prefix --model $M/llama-100m --num-prompts 64 \
    --hf-batch-sizes 16,32 --repeats 3 "${T[@]}" --json "$R/prefix-llama-100m.json"
step online-llama-100m python -m benchmarks.online --model $M/llama-100m --scenarios c32,r2 --num-prompts 64 \
    --max-num-seqs 32 --llama-server "$LLAMA_SERVER" --threads "$THREADS" --out-dir "$R/online" \
    --json "$R/online-llama-100m.json"
