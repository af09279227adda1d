"""How close Octavo's decode gets to this machine's limits.

    python -m benchmarks.roofline --model benchmarks/models/qwen2.5-0.5b
    python -m benchmarks.roofline --quick           # smaller buffers and fewer tokens

Measures memory read bandwidth (sum and copy over buffers of several sizes;
L3 here can be hundreds of MiB, so the buffer as large as the model's weights
is the one that matters for decode) and matmul GFLOP/s (square and
decode-shaped). Then:
- batch-1 decode tokens/s vs the bandwidth roofline: bandwidth / bytes read
  per token (every weight matrix once, the embedding row aside, plus the KV
  cache read by attention);
- large-batch decode tokens/s vs two compute roofs: the best GFLOP/s of the
  model's dtype and the best of any dtype measured (bf16 or float32, whichever
  this CPU runs faster), / (2 * matmul parameters) per token (attention FLOPs
  left out: small at these context lengths).
Batch-1 decode subtracts prefill: rate = (N - 1) / (t(N tokens) - t(1 token)),
both timed in the same round; with ``--llamacpp``, llama.cpp's batch-1 decode
is timed in turns with Octavo's (benchmarks/turns.py: ``--repeats`` rounds,
median (min-max)), each from an empty cache and in a process of its own.
Batch-B decode is timed in the engine over steps where all B sequences decode
(every prompt prefilled first; OctavoPeer.steady_decode_rate): timing whole
generate calls would also count the ragged end, when requests prefilled in
different steps finish in waves with the batch shrinking. It is timed in turns
with the fastest matmul of the table (its shape and dtype re-timed each round),
and each round's peak fraction is that round's decode GFLOP/s over that
round's matmul GFLOP/s: a shared machine's drift falls on both alike.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.report import load_avg, print_table, write_json
from benchmarks.turns import batch1_decode, fmt_spread, median_time, ratios, spread
from benchmarks.options import add_common_args, apply_threads, int_list
from benchmarks.peer_process import PeerProcess
from benchmarks.workload import ordinary_token_ids

if TYPE_CHECKING:
    from benchmarks.peers.octavo_peer import OctavoPeer

MIB = 2**20


def bandwidth_gbs(size_bytes: int, repeats: int) -> dict[str, float]:
    """Read bandwidth of a full-buffer sum, and of a copy (read + write counted)."""
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    t_sum = median_time(lambda: x.sum(), repeats)
    t_copy = median_time(lambda: y.copy_(x), repeats)
    return {"size_mib": size_bytes / MIB, "sum_read_gbs": size_bytes / t_sum / 1e9,
            "copy_gbs": 2 * size_bytes / t_copy / 1e9}


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    return 2 * m * k * n / median_time(lambda: torch.mm(a, b), repeats) / 1e9


@dataclass
class ModelShape:
    params: int  # all parameters, counting a tied embedding once
    matmul_params: int  # those multiplied per token: all but the embedding lookup (lm_head included)
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int

    @classmethod
    def from_config(cls, model: Path, params: int) -> ModelShape:
        cfg = json.loads((model / "config.json").read_text())
        embed = cfg["vocab_size"] * cfg["hidden_size"]
        tied = cfg.get("tie_word_embeddings", False)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(params=params, matmul_params=params if tied else params - embed,
                   layers=cfg["num_hidden_layers"], kv_heads=cfg["num_key_value_heads"],
                   head_dim=head_dim, hidden=cfg["hidden_size"])

    def bytes_per_token(self, weight_bytes: int, context: int, kv_bytes: int) -> float:
        """Bytes one batch-1 decode step must read: weights once, embedding row aside, plus K and V."""
        weights = self.matmul_params * weight_bytes
        kv = 2 * self.layers * self.kv_heads * self.head_dim * context * kv_bytes
        return weights + kv


def count_params(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def peak_rounds(peer: OctavoPeer, prompts: dict[int, list[list[int]]], steps: int,
                matmul: tuple[int, int, int, torch.dtype], repeats: int,
                flops_per_token: int) -> dict[int, dict[str, list[float]]]:
    """Each batch's steady decode in turns with the matmul ``(m, k, n, dtype)``: one warm-up decode per batch,
    then ``repeats`` rounds of every batch's decode followed by the matmul. Per batch and round: tok/s, decode
    GFLOP/s, the round's matmul GFLOP/s and their ratio (the peak fraction)."""
    for batch_prompts in prompts.values():
        peer.steady_decode_rate(batch_prompts, min(steps, 4))  # first-use work (recorded steps, buffers) out of it
    rounds: dict[int, dict[str, list[float]]] = {b: {"tok_s": [], "gflops": [], "peak_gflops": [], "fraction": []}
                                                  for b in prompts}
    for _ in range(repeats):
        rates = {b: peer.steady_decode_rate(p, steps) for b, p in prompts.items()}
        peak = matmul_gflops(*matmul, repeats=3)
        for b, rate in rates.items():
            gflops = rate * flops_per_token / 1e9
            for key, value in (("tok_s", rate), ("gflops", gflops), ("peak_gflops", peak), ("fraction", gflops / peak)):
                rounds[b][key].append(value)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, help="batch-1 decode length (default 128, --quick 32)")
    parser.add_argument("--large-new-tokens", type=int, default=32,
                        help="decode steps timed at large batch (after every prompt is prefilled)")
    parser.add_argument("--large-batches", type=int_list, help="batch sizes tried for peak decode "
                        "(default 64,128,256, --quick 128)")
    parser.add_argument("--quick", action="store_true", help="smaller buffers, fewer tokens and batch sizes")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also measure llama.cpp's batch-1 decode the same way (needs the GGUF)")
    args = parser.parse_args()
    apply_threads(args)
    args.repeats = max(args.repeats, 3)
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)
    large_batches = args.large_batches or ([128] if args.quick else [64, 128, 256])
    dtype = getattr(torch, args.dtype)
    weight_bytes = torch.finfo(dtype).bits // 8
    shape = ModelShape.from_config(args.model, count_params(args.model))
    load_start = load_avg()

    model_mib = max(64, shape.params * weight_bytes // MIB)
    sizes = sorted({64, 256, model_mib, 1024 if args.quick else 2048})
    bw = [bandwidth_gbs(s * MIB, args.repeats) for s in sizes]
    print_table(bw, ["size_mib", "sum_read_gbs", "copy_gbs"], title="memory bandwidth (median of repeats)")
    dram_gbs = bw[-1]["sum_read_gbs"]
    model_gbs = next(b["sum_read_gbs"] for b in bw if b["size_mib"] == model_mib)

    inter = json.loads((args.model / "config.json").read_text())["intermediate_size"]
    squares = [(n, n, n) for n in ((1024, 2048) if args.quick else (1024, 2048, 4096))]
    mm_shapes = squares + [(1, shape.hidden, inter), (32, shape.hidden, inter), (256, shape.hidden, inter)]
    mm = [{"m,k,n": f"{m},{k},{n}", "dtype": str(dt).split(".")[1], "gflops": matmul_gflops(m, k, n, dt, args.repeats)}
          for m, k, n in mm_shapes for dt in (torch.bfloat16, torch.float32)]
    print_table(mm, ["m,k,n", "dtype", "gflops"], title="torch.mm GFLOP/s (median of repeats)")
    # Two compute roofs: the best rate any shape reached in the model's dtype, and the best of any dtype
    # (on some CPUs bf16 runs at twice float32's rate, on others at half: a fraction of the model dtype's
    # rate alone would flatter a model in the slower one).
    compute_peak = max(r["gflops"] for r in mm if r["dtype"] == args.dtype)
    best_any = max(mm, key=lambda r: r["gflops"])

    from benchmarks.peers.llamacpp import gguf_path
    from benchmarks.peers.octavo_peer import OctavoPeer, engine_options
    from benchmarks.process_peers import LlamaCppEngine, OctavoEngine

    if max(large_batches) > args.max_num_seqs:
        raise ValueError(f"--large-batches must not exceed --max-num-seqs ({args.max_num_seqs})")
    ids = ordinary_token_ids(args.model)
    prompt = random.Random(1).choices(ids, k=args.prompt_len)
    # Batch 1: each engine in a process of its own (peer_process.py), in turns, every round timing each at N
    # and at 1 token. Loaded side by side in one process, llama.cpp's runtime cost Octavo a third of its
    # batch-1 rate on a 2-core Zen 4 VM (124 tok/s beside it, 175 alone).
    options = {"dtype": args.dtype, **engine_options(args, enable_prefix_caching=False)}
    peers = {"octavo": PeerProcess("octavo", OctavoEngine, args.model, options, None, threads=args.threads)}
    try:
        if args.llamacpp:
            n_ctx = args.prompt_len + args.new_tokens + 16
            peers["llama.cpp"] = PeerProcess("llama.cpp", LlamaCppEngine, args.model, gguf_path(args.model), n_ctx,
                                             args.threads, True, None, threads=args.threads)
        engines = {name: lambda p, n, peer=peer: peer.timed("decode", p, n) for name, peer in peers.items()}
        b1_rates = batch1_decode(engines, prompt, args.new_tokens, args.repeats, self_timed=True)
        for name in list(peers):
            peers.pop(name).close()
    finally:
        for peer in peers.values():  # those left by an error
            peer.kill()
    peer = OctavoPeer.from_args(args, enable_prefix_caching=False)
    b1 = {name: spread(r["decode_tok_s"]) for name, r in b1_rates.items()}
    context = args.prompt_len + args.new_tokens // 2
    per_token = shape.bytes_per_token(weight_bytes, context, kv_bytes=weight_bytes)
    rng = random.Random(0)
    big_prompts = {b: [[rng.choice(ids) for _ in range(args.prompt_len)] for _ in range(b)] for b in large_batches}
    flops_per_token = 2 * shape.matmul_params
    peak_mm = tuple(int(d) for d in best_any["m,k,n"].split(",")) + (getattr(torch, best_any["dtype"]),)
    big_rounds = peak_rounds(peer, big_prompts, args.large_new_tokens, peak_mm, args.repeats, flops_per_token)
    big = {b: spread(r["tok_s"])["median"] for b, r in big_rounds.items()}
    best_b = max(big, key=big.get)

    def read_row(measure: str, rate: dict[str, float], gbs: float, basis: str) -> dict[str, object]:
        roof = gbs * 1e9 / per_token
        return {"measure": measure, "tok_s": fmt_spread(rate, 1), "roofline_tok_s": roof,
                "fraction": rate["median"] / roof, "basis": basis}

    rows = []
    for name, rate in b1.items():
        rows.append(read_row(f"{name} batch-1 decode", rate, model_gbs, f"{model_gbs:.1f} GB/s at {model_mib} MiB"))
        rows.append(read_row(f"{name} batch-1 decode (DRAM)", rate, dram_gbs,
                             f"{dram_gbs:.1f} GB/s at {sizes[-1]} MiB"))
    for b, r in big.items():
        for gflops, basis in ((compute_peak, f"{compute_peak:.0f} GFLOP/s {args.dtype}"),
                              (best_any["gflops"], f"{best_any['gflops']:.0f} GFLOP/s, best of any dtype "
                                                   f"({best_any['dtype']} {best_any['m,k,n']})")):
            rows.append({"measure": f"batch-{b} decode", "tok_s": fmt_spread(spread(big_rounds[b]["tok_s"]), 1),
                         "roofline_tok_s": gflops * 1e9 / flops_per_token,
                         "fraction": r * flops_per_token / (gflops * 1e9), "basis": basis})
    print_table(rows, ["measure", "tok_s", "roofline_tok_s", "fraction", "basis"],
                title=f"decode vs roofline, {args.model.name} {args.dtype}: {shape.params / 1e6:.0f}M params, "
                      f"{per_token / 1e6:.0f} MB read per batch-1 token, {flops_per_token / 1e9:.2f} GFLOP per token")
    if "llama.cpp" in b1_rates:
        (ratio,) = ratios(b1_rates, "decode_tok_s", ["octavo"], ["llama.cpp"])
        print(f"batch-1 decode octavo / llama.cpp: {fmt_spread(ratio['ratio'])}x (median (min-max) of "
              f"{args.repeats} rounds)")
    for b, r in big_rounds.items():
        print(f"batch-{b} decode in turns with {best_any['dtype']} {best_any['m,k,n']}: "
              f"{fmt_spread(spread(r['gflops']), 0)} GFLOP/s against {fmt_spread(spread(r['peak_gflops']), 0)}, "
              f"peak fraction {fmt_spread(spread(r['fraction']))} (median (min-max) of {args.repeats} rounds)")
    print(f"load {load_start} -> {load_avg()}; peak decode at batch {best_b}")
    write_json(args.json, {"benchmark": "roofline", "args": vars(args), "shape": asdict(shape),
                           "bandwidth": bw, "matmul": mm, "decode": rows, "batch1_rounds": b1_rates,
                           "large_batch_rounds": big_rounds, "peak_batch": best_b})


if __name__ == "__main__":
    main()
