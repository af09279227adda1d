"""Offline throughput: Octavo vs Hugging Face transformers vs llama.cpp, one workload, timed in turns.

    python -m benchmarks.throughput --model benchmarks/models/llama-100m --num-prompts 256 --repeats 3
    python -m benchmarks.throughput --num-prompts 32 --peers octavo,hf --hf-batch-sizes 16,32   # quick
    python -m benchmarks.throughput --num-prompts 128 --peers octavo --step-split   # where Octavo's time goes

Engines, like with like (every one batching, the same threads, greedy, outputs fixed by ignore_eos; output
tokens/s counts only the requested tokens):
- octavo: ``LLM.generate`` over every request (continuous batching, paged KV cache, prefix caching off).
- llamacpp: llama.cpp batched (benchmarks/peers/llamacpp_batch.py): every request a sequence of one context,
  prompts prefilled together, one ``llama_decode`` per step for every live sequence, on the model's GGUF.
- llamacpp-sequential: llama.cpp's high-level ``Llama`` API, one request after another, each from an empty
  cache (what that API does offline). It measures batching as much as engines, so it is labelled as such
  and never the headline; usually on the first ``--llamacpp-max-prompts`` requests.
- hf: transformers ``generate`` in static left-padded batches; its batch size is chosen first by a sweep
  over ``--hf-batch-sizes`` (one run each), then timed in turns at that size.

Timing (benchmarks/turns.py): every engine loaded and warmed, then ``--repeats`` rounds in which each engine
runs once; every ratio is Octavo's rate over the peer's within a round, on the same requests (Octavo also
runs the leading subsets a capped peer ran), reported as the median and the min-max over rounds.
"""
from __future__ import annotations

import argparse
import math
from contextlib import nullcontext
from typing import Any, Callable, Optional

from benchmarks.options import add_common_args, add_sharegpt_args, apply_threads, int_list, sharegpt_from_args
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.step_split import StepSplit
from benchmarks.turns import fmt_spread, in_rounds, ratios, spread
from benchmarks.workload import Workload

PEERS = ("octavo", "hf", "llamacpp", "llamacpp-sequential")


def subset(workload: Workload, cap: int) -> Workload:
    """The leading ``cap`` requests a slow peer runs (all when 0)."""
    return workload.head(min(cap, len(workload.prompts))) if cap else workload


def build_engines(args: argparse.Namespace, workload: Workload, peers: list[str], split: Optional[StepSplit]
                  ) -> tuple[dict[str, tuple[Callable[[], object], Workload]], dict[str, Callable[[], object]],
                             list[tuple[str, str]], dict[str, Any]]:
    """name -> (run, the requests it serves); warm-ups; (octavo engine, peer) pairs to compare; notes."""
    engines: dict[str, tuple[Callable[[], object], Workload]] = {}
    warmups: dict[str, Callable[[], object]] = {}
    pairs: list[tuple[str, str]] = []
    notes: dict[str, Any] = {}
    small = Workload("warm-up", workload.prompts[:4], [8] * min(4, len(workload.prompts)), "warm-up")
    octavo = None
    if "octavo" in peers:
        from benchmarks.peers.octavo_peer import OctavoPeer

        octavo = OctavoPeer.from_args(args, enable_prefix_caching=False)

        def run_octavo() -> None:
            with split.recording(octavo.llm.engine) if split else nullcontext():
                octavo.generate(workload)

        engines["octavo"] = (run_octavo, workload)
        warmups["octavo"] = lambda: octavo.generate(small)

    def octavo_on(served: Workload) -> Optional[str]:
        """The Octavo engine serving exactly ``served`` (added when it is a subset)."""
        if octavo is None:
            return None
        if len(served.prompts) == len(workload.prompts):
            return "octavo"
        name = f"octavo first {len(served.prompts)}"
        engines[name] = (lambda: octavo.generate(served), served)
        warmups[name] = lambda: None  # the same engine, warm
        return name

    if "llamacpp" in peers or "llamacpp-sequential" in peers:
        from benchmarks.peers.llamacpp import LlamaCppPeer
        from benchmarks.peers.llamacpp_batch import LlamaCppContext

        lc = LlamaCppPeer(args.model, n_ctx=workload.max_seq_len + 16, threads=args.threads)
        if "llamacpp" in peers:
            # One sequence per request; the context a multiple of the sequences (llama.cpp splits it evenly).
            n_ctx = len(workload.prompts) * 256 * math.ceil(workload.max_seq_len / 256)
            batch = LlamaCppContext(lc.llm, n_ctx=n_ctx, n_batch=2048, n_seq=len(workload.prompts))
            engines["llamacpp"] = (lambda: batch.generate(workload.prompts, workload.output_lens), workload)
            warmups["llamacpp"] = lambda: batch.generate(small.prompts, 8)
            pairs.append((octavo_on(workload), "llamacpp"))
        if "llamacpp-sequential" in peers:
            sub = subset(workload, args.llamacpp_max_prompts)
            engines["llamacpp-sequential"] = (lambda: lc.generate(sub), sub)
            warmups["llamacpp-sequential"] = lambda: lc.generate(small.head(1))
            pairs.append((octavo_on(sub), "llamacpp-sequential"))
    if "hf" in peers:
        from benchmarks.peers.hf import HFPeer

        hf = HFPeer(args.model, args.dtype, args.device)
        hf.warmup()
        sub = subset(workload, args.hf_max_prompts)
        best, sweep = hf.sweep(sub, args.hf_batch_sizes)
        bs = best.extra["batch_size"]
        notes["hf_sweep"] = {r.extra["batch_size"]: r.output_tok_s for r in sweep}
        print(f"hf batch sizes (one run each): {notes['hf_sweep']}; timed at {bs}", flush=True)
        engines[f"hf bs={bs}"] = (lambda: hf.run(sub, bs), sub)
        warmups[f"hf bs={bs}"] = lambda: None  # the sweep ran it
        pairs.append((octavo_on(sub), f"hf bs={bs}"))
    return engines, warmups, [(o, p) for o, p in pairs if o is not None], notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_sharegpt_args(parser)
    parser.add_argument("--peers", default="octavo,hf,llamacpp", help=f"comma-separated subset of {PEERS}")
    parser.add_argument("--hf-batch-sizes", type=int_list, default=[8, 16, 32, 64])
    parser.add_argument("--hf-max-prompts", type=int, default=0,
                        help="run HF on only the first K prompts (it is slow); 0 = all")
    parser.add_argument("--llamacpp-max-prompts", type=int, default=0,
                        help="run llama.cpp one request after another on only the first K prompts; 0 = all")
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
    split = StepSplit() if args.step_split else None
    engines, warmups, pairs, notes = build_engines(args, workload, peers, split)
    before = load_avg()
    times = in_rounds({name: run for name, (run, _) in engines.items()}, args.repeats, warmups)
    load = f"{before} -> {load_avg()}"
    rates = {name: {"requests": len(served.prompts),
                    "output_tok_s": [served.num_output_tokens / wall for wall, _ in times[name]],
                    "total_tok_s": [(served.num_prompt_tokens + served.num_output_tokens) / wall
                                    for wall, _ in times[name]],
                    "wall_s": [wall for wall, _ in times[name]]}
             for name, (_, served) in engines.items()}
    rows = [{"engine": name, "requests": r["requests"], "out_tok_s": fmt_spread(spread(r["output_tok_s"]), 1),
             "total_tok_s": fmt_spread(spread(r["total_tok_s"]), 1)} for name, r in rates.items()]
    print_table(rows, ["engine", "requests", "out_tok_s", "total_tok_s"],
                title=f"offline throughput, {args.model.name}, {args.dtype}, median (min-max) of {args.repeats} "
                      f"rounds in turns; load {load}")
    ratio_rows = [row for o, p in pairs for row in ratios(rates, "output_tok_s", [o], [p])]
    for r in ratio_rows:
        label = " (llama.cpp unbatched: measures batching too)" if r["peer"] == "llamacpp-sequential" else ""
        print(f"{r['octavo']} / {r['peer']}: {fmt_spread(r['ratio'])}x{label}")
    split_rows = split.rows() if split else []
    if split_rows:
        print_table(split_rows, ["kind", "rows_up_to", "steps", "seconds", "share", "ms_per_step", "tokens"],
                    title=f"Octavo's steps over every run of the {len(workload.prompts)} requests")
    write_json(args.json, {"benchmark": "throughput", "args": vars(args), "workload": workload.summary(),
                           "rounds": rates, "ratios": ratio_rows, "load": load, "notes": notes,
                           "step_split": split_rows})


if __name__ == "__main__":
    main()
