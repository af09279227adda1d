#!/usr/bin/env bash
# The CUDA path, checked and measured on a machine with an NVIDIA GPU, in one prepared run of a few minutes.
# From the repository root, with torch (CUDA build), triton and the test extra present:
#
#   benchmarks/gpu_check.sh [OUT_DIR]        # default benchmarks/results/gpu
#
# 1. versions and the GPU; 2. the CUDA tests (engine vs transformers, eager and CUDA graphs; the Triton kernel
# compiled); 3. offline throughput vs transformers on the same GPU with decode graphs; 4. online serving
# (`octavo serve --device cuda`, closed loop at 32 and 128 in flight); 5. batch-1 decode speed; 6. offline
# throughput with graphs off. Each step's output goes to OUT_DIR and has its own time limit (the whole run
# fits in about 8 minutes); a failing step is reported and the next one still runs.
# The project itself need not be installed (it runs from this folder), but its dependencies must import: on an
# image with CUDA torch and transformers that lacks some (fastapi, uvicorn, pydantic, msgspec, pyzmq, llguidance
# were missing on one), put their wheels on PYTHONPATH first.
# $PYTHON picks the interpreter (default python3: on GPU images, usually the one that holds CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$OUT"
M=benchmarks/models
PY=${PYTHON:-python3}
status=0

step() {  # name, time limit in seconds, then the command
    local name=$1 limit=$2; shift 2
    echo "== $name"
    local start=$SECONDS
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
        tail -25 "$OUT/$name.log"
    else
        status=1
        echo "FAILED ($name): last lines of $OUT/$name.log"; tail -40 "$OUT/$name.log"
    fi
    echo "== $name took $((SECONDS - start)) s"
}

step versions 60 "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__); print(torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
step tests 200 "$PY" -m pytest tests/cuda tests/attention/test_triton_decode.py -q -rs -p no:cacheprovider
[ -d $M/llama-100m ] || step models 60 "$PY" tools/make_bench_models.py --models llama-100m
step throughput-graphs 120 "$PY" -m benchmarks.throughput --model $M/llama-100m --device cuda --peers octavo,hf \
    --num-prompts 256 --hf-batch-sizes 32,64 --hf-max-prompts 64 --kv-cache-memory-bytes $((8 * 2**30)) \
    --json "$OUT/throughput-graphs.json"
step online 120 "$PY" -m benchmarks.online --model $M/llama-100m --servers octavo --device cuda --scenarios c32,c128 \
    --num-prompts 256 --output-len 128 --max-num-seqs 128 --kv-cache-memory-bytes $((8 * 2**30)) \
    --out-dir "$OUT/online" --json "$OUT/online.json"
step batch1-decode 60 "$PY" -m benchmarks.throughput --model $M/llama-100m --device cuda --peers octavo,hf \
    --num-prompts 4 --max-num-seqs 1 --hf-batch-sizes 1 --kv-cache-memory-bytes $((2**30)) \
    --json "$OUT/batch1-decode.json"
step throughput-eager 90 "$PY" -m benchmarks.throughput --model $M/llama-100m --device cuda --peers octavo \
    --num-prompts 256 --enforce-eager --kv-cache-memory-bytes $((8 * 2**30)) --json "$OUT/throughput-eager.json"
exit $status
