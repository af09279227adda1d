#!/usr/bin/env bash
# The CUDA path, checked and measured on a machine with an NVIDIA GPU, in one prepared run (the device tool lends
# one for minutes at a time). From the repository root, with torch (CUDA build), triton and the test extra present:
#
#   benchmarks/gpu_check.sh [OUT_DIR]        # default benchmarks/results/gpu
#
# 1. versions and the GPU; 2. the CUDA tests (engine vs transformers, eager and CUDA graphs; the Triton kernel
# compiled); 3. offline throughput vs transformers on the same GPU, graphs on and off; 4. batch-1 decode speed.
# Each step's output goes to OUT_DIR; a failing step is reported and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$OUT"
M=benchmarks/models
status=0

step() {  # name, then the command
    local name=$1; shift
    echo "== $name"
    local start=$SECONDS
    if "$@" > "$OUT/$name.log" 2>&1; then
        tail -25 "$OUT/$name.log"
    else
        status=1
        echo "FAILED ($name): last lines of $OUT/$name.log"; tail -40 "$OUT/$name.log"
    fi
    echo "== $name took $((SECONDS - start)) s"
}

step versions python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__); print(torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
step tests python -m pytest tests/cuda tests/attention/test_triton_decode.py -q -rs -p no:cacheprovider
[ -d $M/llama-100m ] || step models python tools/make_bench_models.py --models llama-100m
step throughput-graphs python -m benchmarks.throughput --model $M/llama-100m --device cuda --peers octavo,hf \
    --num-prompts 256 --hf-batch-sizes 32,64 --hf-max-prompts 64 --kv-cache-memory-bytes $((8 * 2**30)) \
    --json "$OUT/throughput-graphs.json"
step throughput-eager python -m benchmarks.throughput --model $M/llama-100m --device cuda --peers octavo \
    --num-prompts 256 --enforce-eager --kv-cache-memory-bytes $((8 * 2**30)) --json "$OUT/throughput-eager.json"
step batch1-decode python -m benchmarks.throughput --model $M/llama-100m --device cuda --peers octavo,hf \
    --num-prompts 4 --max-num-seqs 1 --hf-batch-sizes 1 --kv-cache-memory-bytes $((2**30)) \
    --json "$OUT/batch1-decode.json"
exit $status
