"""Batch-1 decode with int8/int4 weights: activation rows rounded to int8 (qdot_linear.c, the default) against
float rows (--quantized-activations float), every matrix quantized, the lm_head included. Process CPU time
per decoded token, in turns (benchmarks/turns.py): on a loaded machine a kernel's CPU time moves far less
than its wall time, and at one thread it holds no idle OpenMP spinning.

    python -m benchmarks.activation_rows --models benchmarks/models/llama-100m,benchmarks/models/qwen2.5-0.5b \
        --threads 1 --new-tokens 16 --rounds 3
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from benchmarks.peers.octavo_peer import OctavoPeer
from benchmarks.report import load_avg, print_table
from benchmarks.turns import fmt_spread, in_rounds, spread
from benchmarks.workload import Workload, ordinary_token_ids

ACTIVATIONS = ("int8", "float")


def bench_model(model: Path, quants: list[str], args: argparse.Namespace) -> list[dict[str, object]]:
    prompt = random.Random(1).choices(ordinary_token_ids(model), k=args.prompt_len)
    runs = {}
    for quant in quants:
        for activations in ACTIVATIONS:
            peer = OctavoPeer(model, "bfloat16", max_num_seqs=1, kv_cache_memory_bytes=2**28,
                              enable_prefix_caching=False, quantization=quant, quantization_group_size=args.group_size,
                              lm_head_quantization=quant, quantized_activations=activations)
            for steps in (1, args.new_tokens + 1):  # the one-token run is the prefill, taken off
                runs[f"{quant} {activations} {steps}"] = \
                    lambda peer=peer, steps=steps: peer.generate(Workload("decode", [prompt], [steps], "decode"))
    load = load_avg()
    times = in_rounds(runs, args.rounds)
    rows = []
    for quant in quants:
        ms = {a: [(cpu - cpu1) / args.new_tokens * 1e3 for (_, cpu), (_, cpu1) in
                  zip(times[f"{quant} {a} {args.new_tokens + 1}"], times[f"{quant} {a} 1"])] for a in ACTIVATIONS}
        rows.append({"model": model.name, "weights": f"{quant}+head",
                     "int8 rows CPU ms/token": fmt_spread(spread(ms["int8"])),
                     "float rows CPU ms/token": fmt_spread(spread(ms["float"])),
                     "int8 rows speed-up": fmt_spread(spread([f / i for f, i in zip(ms["float"], ms["int8"])])),
                     "load": f"{load} -> {load_avg()}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="benchmarks/models/llama-100m", help="comma-separated checkpoint folders")
    parser.add_argument("--quantizations", default="int8,int4")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for model in args.models.split(",")
            for row in bench_model(Path(model), args.quantizations.split(","), args)]
    print_table(rows, list(rows[0]), f"batch-1 decode, int8 vs float activation rows ({args.threads} threads; "
                                     "speed-up: float rows' CPU time / int8 rows', per round)")


if __name__ == "__main__":
    main()
