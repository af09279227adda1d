"""KV memory efficiency: how much of the allocated KV memory holds real tokens.

    python -m benchmarks.kv_memory --model benchmarks/models/llama-100m --num-prompts 256

Octavo's paged cache is sampled after every engine step (blocks in use *
block_size vs tokens whose K/V are stored). The contiguous schemes are
computed from the same trace (the same running set at every step):
- max_model_len: each running request reserves max_model_len slots (a
  server that cannot know the output length in advance);
- prompt+max_tokens: each running request reserves exactly its own final
  length (the best any contiguous allocator can do);
- HF static batch: each batch of the throughput benchmark holds
  batch * (longest prompt + longest output) slots until its last request ends.
Efficiency is time-weighted: sum over steps of stored tokens / sum of allocated slots.
Prefix caching is off so freed blocks really are free.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from benchmarks.peers.octavo_peer import OctavoPeer
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.options import add_common_args, add_sharegpt_args, apply_threads, sharegpt_from_args
from benchmarks.workload import Workload


@dataclass
class Trace:
    """Per engine step: tokens stored, paged slots in use, and the running requests."""

    stored: list[int] = field(default_factory=list)
    paged_slots: list[int] = field(default_factory=list)
    running: list[list[int]] = field(default_factory=list)  # request indices

    def efficiency(self, slots: list[int]) -> float:
        return sum(self.stored) / sum(slots)


def record_trace(args: argparse.Namespace, workload: Workload) -> tuple[Trace, int]:
    """Run the workload through Octavo step by step; also returns max_model_len."""
    from octavo import SamplingParams

    engine = OctavoPeer.from_args(args, block_size=args.block_size, enable_prefix_caching=False).llm.engine
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    trace = Trace()
    while engine.has_unfinished_requests():
        engine.step()
        running = list(engine.scheduler.running)
        stats = engine.get_stats()
        trace.stored.append(sum(r.num_computed_tokens for r in running))
        trace.paged_slots.append((stats.num_total_blocks - stats.num_free_blocks) * args.block_size)
        trace.running.append([int(r.request_id) for r in running])
    return trace, engine.max_model_len


def static_batch_efficiency(workload: Workload, batch_size: int) -> float:
    """HF static batching: a batch holds its padded rectangle for all its steps;
    request i stores prompt + t tokens at step t until its own output ends."""
    stored = allocated = 0
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start:start + batch_size]
        outs = workload.output_lens[start:start + batch_size]
        width, steps = max(len(p) for p in prompts), max(outs)
        for t in range(1, steps + 1):
            allocated += len(prompts) * (width + t)
            stored += sum(len(p) + min(t, n) for p, n in zip(prompts, outs))
    return stored / allocated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_sharegpt_args(parser)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    args = parser.parse_args()
    apply_threads(args)

    workload = sharegpt_from_args(args)
    load_start = load_avg()
    trace, max_model_len = record_trace(args, workload)
    final_len = [len(p) + n for p, n in zip(workload.prompts, workload.output_lens)]
    contiguous_max = [len(run) * max_model_len for run in trace.running]
    contiguous_exact = [sum(final_len[i] for i in run) for run in trace.running]
    peak_paged = max(trace.paged_slots)
    rows = [
        {"scheme": f"octavo paged (block {args.block_size})", "efficiency": trace.efficiency(trace.paged_slots),
         "peak_slots": peak_paged},
        {"scheme": f"contiguous max_model_len ({max_model_len})", "efficiency": trace.efficiency(contiguous_max),
         "peak_slots": max(contiguous_max)},
        {"scheme": "contiguous prompt+max_tokens", "efficiency": trace.efficiency(contiguous_exact),
         "peak_slots": max(contiguous_exact)},
        {"scheme": f"HF static batch {args.hf_batch_size} (padded)",
         "efficiency": static_batch_efficiency(workload, args.hf_batch_size), "peak_slots": None},
    ]
    print(f"workload: {workload.summary()}")
    print_table(rows, ["scheme", "efficiency", "peak_slots"],
                title=f"KV memory holding real tokens, {len(trace.stored)} engine steps, "
                      f"peak {max(len(r) for r in trace.running)} running")
    print(f"requests that fit at once in Octavo's peak paged footprint ({peak_paged} slots) "
          f"with max_model_len reservations: {peak_paged // max_model_len}")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "kv_memory", "args": vars(args), "workload": workload.summary(),
                           "steps": len(trace.stored), "results": rows})


if __name__ == "__main__":
    main()
