"""Where Octavo's CPU time goes, as evidence for BENCHMARKS.md.

    # op level: torch.profiler over one offline run
    python -m benchmarks.cpu_profile --model benchmarks/models/llama-100m --num-prompts 32 --max-output-len 64
    # Python level: sample with py-spy, then summarise the raw file
    py-spy record -r 50 -f raw -o benchmarks/results/octavo.pyspy -- \\
        python -m benchmarks.throughput --peers octavo --num-prompts 32 --max-output-len 64
    python -m benchmarks.cpu_profile --pyspy-raw benchmarks/results/octavo.pyspy
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from benchmarks.options import add_common_args, add_sharegpt_args, apply_threads, sharegpt_from_args
from benchmarks.report import print_table


def summarize_pyspy(raw: Path, top: int, within: str = "generate") -> None:
    """Self time by leaf frame and inclusive time by octavo frame, over samples
    whose stack passes through ``within`` (so loading is left out)."""
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if not any(within in f for f in frames):
            continue
        n = int(count)
        total += n
        leaf[frames[-1]] += n
        for frame in set(frames):
            if "octavo/" in frame:
                inclusive[frame] += n
    if not total:
        raise ValueError(f"no samples in {raw} pass through {within!r}")
    print_table([{"self": v / total, "frame": k} for k, v in leaf.most_common(top)], ["self", "frame"],
                title=f"py-spy self time ({total} samples)")
    print_table([{"inclusive": v / total, "frame": k} for k, v in inclusive.most_common(top)],
                ["inclusive", "frame"], title="py-spy inclusive time, octavo frames")


def torch_profile(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.peers.octavo_peer import OctavoPeer

    peer = OctavoPeer.from_args(args)
    peer.warmup()
    workload = sharegpt_from_args(args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = peer.run(workload)
    print(f"{result.output_tok_s:.1f} output tok/s under the profiler ({workload.summary()})")
    events = prof.key_averages()
    wall = sum(e.self_cpu_time_total for e in events)
    rows = [{"op": e.key, "self_share": e.self_cpu_time_total / wall, "calls": e.count,
             "us_per_call": e.self_cpu_time_total / max(e.count, 1)}
            for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]]
    print_table(rows, ["op", "self_share", "calls", "us_per_call"], title="torch.profiler self CPU time by op")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_sharegpt_args(parser, num_prompts=32)
    parser.add_argument("--pyspy-raw", type=Path, help="summarise this py-spy raw file instead of profiling")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    if args.pyspy_raw:
        summarize_pyspy(args.pyspy_raw, args.top)
        return
    apply_threads(args)
    torch_profile(args)


if __name__ == "__main__":
    main()
