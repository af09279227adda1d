"""Shared-prefix workload: one long system prompt, short unique suffixes.

    python -m benchmarks.prefix --model benchmarks/models/llama-100m --num-prompts 64
    python -m benchmarks.prefix --num-prompts 16 --peers octavo   # quick

Octavo with prefix caching on and off, and transformers (static batches, no
reuse). Each repeat draws a new prefix (seed + repeat) so a warm cache from
an earlier repeat never flatters the next. Hit rate = prompt tokens served
from the prefix cache / prompt tokens looked up, over the timed run.
"""
from __future__ import annotations

import argparse
import gc

from benchmarks.peers.hf import HFPeer
from benchmarks.peers.octavo_peer import OctavoPeer
from benchmarks.report import PeerResult, load_avg, median_result, print_table, write_json
from benchmarks.options import add_common_args, apply_threads, int_list
from benchmarks.workload import Workload, ordinary_token_ids, shared_prefix


def run_octavo(args: argparse.Namespace, workloads: list[Workload], caching: bool) -> PeerResult:
    peer = OctavoPeer.from_args(args, enable_prefix_caching=caching)
    peer.name = f"octavo prefix-cache {'on' if caching else 'off'}"
    peer.warmup()
    runs = []
    for wl in workloads:
        before = peer.stats()
        result = peer.run(wl)
        after = peer.stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        result.extra["prefix_hit_rate"] = hits / queries if queries else 0.0
        result.extra["load"] = load_avg()
        runs.append(result)
    return median_result(runs)


def run_hf(args: argparse.Namespace, workloads: list[Workload]) -> PeerResult:
    hf = HFPeer(args.model, args.dtype)
    hf.warmup()
    best, _ = hf.sweep(workloads[0], args.hf_batch_sizes)
    runs = [best] + [hf.run(wl, best.extra["batch_size"]) for wl in workloads[1:]]
    return median_result(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--peers", default="octavo,hf", help="comma-separated subset of octavo,hf")
    parser.add_argument("--hf-batch-sizes", type=int_list, default=[8, 16, 32])
    args = parser.parse_args()
    apply_threads(args)
    peers = [p for p in args.peers.split(",") if p]
    if not set(peers) <= {"octavo", "hf"}:
        raise ValueError(f"--peers must be a subset of octavo,hf; got {args.peers!r}")

    ids = ordinary_token_ids(args.model)
    workloads = [shared_prefix(args.num_prompts, ids, prefix_len=args.prefix_len, output_len=args.output_len,
                               seed=args.seed + r) for r in range(args.repeats)]
    print(f"workload: {workloads[0].summary()}")
    results: list[PeerResult] = []
    if "octavo" in peers:
        results += [run_octavo(args, workloads, True), run_octavo(args, workloads, False)]
        gc.collect()
    if "hf" in peers:
        results.append(run_hf(args, workloads))
    rows = [{"peer": r.peer, "requests": r.num_requests, "elapsed_s": r.elapsed_s, "out_tok_s": r.output_tok_s,
             "total_tok_s": r.total_tok_s, "prefix_hit_rate": r.extra.get("prefix_hit_rate"),
             "notes": r.notes} for r in results]
    print_table(rows, ["peer", "requests", "elapsed_s", "out_tok_s", "total_tok_s", "prefix_hit_rate", "notes"],
                title=f"shared-prefix workload, {args.model.name}, {args.dtype}")
    base = results[0].output_tok_s
    ratios = {f"{results[0].peer} / {r.peer}": base / r.output_tok_s for r in results[1:]}
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    write_json(args.json, {"benchmark": "prefix", "args": vars(args), "workload": workloads[0].summary(),
                           "results": [r.to_dict() for r in results], "ratios": ratios})


if __name__ == "__main__":
    main()
