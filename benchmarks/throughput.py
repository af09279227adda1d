"""Offline throughput: Octavo vs Hugging Face transformers vs llama.cpp, one workload, one run.

    python -m benchmarks.throughput --model benchmarks/models/llama-100m --num-prompts 256
    python -m benchmarks.throughput --num-prompts 32 --peers octavo,hf --hf-batch-sizes 16,32   # quick
    python -m benchmarks.throughput --num-prompts 128 --peers octavo --step-split   # where Octavo's time goes

Output tokens/s counts only the requested tokens (outputs are fixed by
ignore_eos); each peer loads its model before its clock starts and does one
warm-up generation.
"""
from __future__ import annotations

import argparse
import gc
from contextlib import nullcontext
from typing import Optional

from benchmarks.peers.hf import HFPeer
from benchmarks.peers.llamacpp import LlamaCppPeer
from benchmarks.peers.octavo_peer import OctavoPeer
from benchmarks.options import (
    add_common_args, add_sharegpt_args, apply_threads, int_list, sharegpt_from_args, timed_runs,
)
from benchmarks.report import PeerResult, load_avg, print_table, write_json
from benchmarks.step_split import StepSplit
from benchmarks.workload import Workload

PEERS = ("octavo", "hf", "llamacpp")


def subset_size(args: argparse.Namespace, peer: str, workload: Workload) -> int:
    """How many leading requests a slow peer runs (all unless capped)."""
    cap = {"hf": args.hf_max_prompts, "llamacpp": args.llamacpp_max_prompts}.get(peer, 0)
    return min(cap, len(workload.prompts)) if cap else len(workload.prompts)


def run_peer(name: str, args: argparse.Namespace, workload: Workload, peers: list[str],
             split: Optional[StepSplit] = None) -> tuple[PeerResult, list[PeerResult]]:
    """The peer's headline result plus the runs behind it: HF's batch-size
    sweep, or Octavo on the same leading subsets the capped peers ran, so
    every ratio can be taken over identical requests. ``split`` records
    Octavo's steps over the whole workload."""
    if name == "octavo":
        peer = OctavoPeer.from_args(args)
        peer.warmup()
        with split.recording(peer.llm.engine) if split else nullcontext():
            full = timed_runs(lambda: peer.run(workload), args.repeats)
        sizes = sorted({subset_size(args, p, workload) for p in peers} - {len(workload.prompts)})
        return full, [timed_runs(lambda: peer.run(workload.head(k)), args.repeats) for k in sizes]
    if name == "hf":
        hf = HFPeer(args.model, args.dtype, args.device)
        hf.warmup()
        sub = workload.head(subset_size(args, "hf", workload))
        best, sweep = hf.sweep(sub, args.hf_batch_sizes)
        if args.repeats > 1:
            best = timed_runs(lambda: hf.run(sub, best.extra["batch_size"]), args.repeats)
        return best, sweep
    if name == "llamacpp":
        sub = workload.head(subset_size(args, "llamacpp", workload))
        lc = LlamaCppPeer(args.model, n_ctx=sub.max_seq_len + 16, threads=args.threads)
        lc.warmup()
        return timed_runs(lambda: lc.run(sub), args.repeats), []
    raise ValueError(f"--peers: unknown peer {name!r}; choose from {', '.join(PEERS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_sharegpt_args(parser)
    parser.add_argument("--peers", default="octavo,hf,llamacpp", help=f"comma-separated subset of {PEERS}")
    parser.add_argument("--hf-batch-sizes", type=int_list, default=[8, 16, 32, 64])
    parser.add_argument("--hf-max-prompts", type=int, default=0,
                        help="run HF on only the first K prompts (it is slow); 0 = all")
    parser.add_argument("--llamacpp-max-prompts", type=int, default=0,
                        help="run llama.cpp on only the first K prompts; 0 = all")
    parser.add_argument("--step-split", action="store_true",
                        help="also print where Octavo's time went, by kind of step and rows (benchmarks/step_split.py)")
    args = parser.parse_args()
    apply_threads(args)
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise ValueError(f"--peers: unknown peer {p!r}; choose from {', '.join(PEERS)}")

    workload = sharegpt_from_args(args)
    print(f"workload: {workload.summary()}", flush=True)
    results: dict[str, PeerResult] = {}
    sweeps: dict[str, list[PeerResult]] = {}
    split = StepSplit() if args.step_split else None
    for name in peers:
        results[name], sweeps[name] = run_peer(name, args, workload, peers, split)
        print(f"{name}: {results[name].output_tok_s:.1f} output tok/s (load {load_avg()})", flush=True)
        gc.collect()

    rows = [{"peer": r.peer, "requests": r.num_requests, "out_tokens": r.output_tokens, "elapsed_s": r.elapsed_s,
             "out_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s, "notes": r.notes} for r in results.values()]
    extra_rows = [(f"  octavo first {r.num_requests}", r) for r in sweeps.get("octavo", [])]
    extra_rows += [(f"  hf bs={r.extra['batch_size']}", r) for r in sweeps.get("hf", [])]
    for label, r in extra_rows:
        rows.append({"peer": label, "requests": r.num_requests, "out_tokens": r.output_tokens,
                     "elapsed_s": r.elapsed_s, "out_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s})
    print_table(rows, ["peer", "requests", "out_tokens", "elapsed_s", "out_tok_s", "total_tok_s", "notes"],
                title=f"offline throughput, {args.model.name}, {args.dtype}")
    ratios = {}
    if "octavo" in results:
        octavo_by_size = {r.num_requests: r for r in [results["octavo"], *sweeps["octavo"]]}
        for p, r in results.items():
            if p == "octavo":
                continue
            same = octavo_by_size[r.num_requests]
            ratios[f"octavo/{p} (same {r.num_requests} requests)"] = same.output_tok_s / r.output_tok_s
            if r.num_requests != len(workload.prompts):
                ratios[f"octavo all {len(workload.prompts)}/{p}"] = results["octavo"].output_tok_s / r.output_tok_s
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    split_rows = split.rows() if split else []
    if split_rows:
        print_table(split_rows, ["kind", "rows_up_to", "steps", "seconds", "share", "ms_per_step", "tokens"],
                    title=f"Octavo's steps over the {len(workload.prompts)} requests ({args.repeats} run(s))")
    write_json(args.json, {
        "benchmark": "throughput", "args": vars(args), "workload": workload.summary(),
        "results": {k: v.to_dict() for k, v in results.items()},
        "runs_behind": {k: [r.to_dict() for r in v] for k, v in sweeps.items()}, "ratios": ratios,
        "step_split": split_rows,
    })


if __name__ == "__main__":
    main()
