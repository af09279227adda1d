"""Prefill attention alone: one fresh prompt chunk's causal attention over every
layer of a model, through torch's SDPA in bf16 and in float32 (bf16 inputs
converted, the output rounded back), timed in turns so that a drifting machine
hits both alike; and which of the two the engine uses on this CPU
(octavo/attention/prefill.py).

    python -m benchmarks.prefill_attention --model benchmarks/models/llama-100m --lengths 32,64,256,1024,2048
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn import functional as F

from benchmarks.options import DEFAULT_MODEL, int_list
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.turns import in_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="read for its attention shape only")
    parser.add_argument("--lengths", type=int_list, default=[32, 64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from octavo.attention.prefill import attends_in_float32

    cfg = json.loads((args.model / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    torch.manual_seed(0)
    load_start = load_avg()
    rows = []
    for length in args.lengths:
        q = torch.randn(1, heads, length, head_dim).to(torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, length, head_dim).to(torch.bfloat16) for _ in range(2))
        def bf16() -> None:
            for _ in range(layers):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def float32() -> None:
            for _ in range(layers):
                F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                               enable_gqa=True).to(torch.bfloat16)

        median = in_turns({"bf16": bf16, "float32": float32}, args.repeats)
        # q.k and p.v over the causal half: 2 products of 2 FLOPs per (query, key, dim), per head and layer.
        flops = layers * heads * length * (length + 1) / 2 * head_dim * 4
        rows.append({"tokens": length, "bf16_ms": median["bf16"] * 1e3, "float32_ms": median["float32"] * 1e3,
                     "float32_time_ratio": median["float32"] / median["bf16"],
                     "gflops_best": flops / min(median.values()) / 1e9,
                     "engine_uses": "float32" if attends_in_float32(q) else "bf16"})
    print_table(rows, ["tokens", "bf16_ms", "float32_ms", "float32_time_ratio", "gflops_best", "engine_uses"],
                title=f"prefill attention, {args.model.name} ({layers} layers, {heads}/{kv_heads} heads of "
                      f"{head_dim}), one fresh chunk ({args.threads} threads, median of {args.repeats}, in turns)")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "prefill_attention", "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
