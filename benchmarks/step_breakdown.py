"""Where a decode step's time goes at batch B: wall time per step split into
the engine's parts, measured by timing each part's calls during steady decode
(every prompt prefilled first, as in benchmarks/roofline.py). With --prefill,
a prompt step's instead: each timed step prefills B fresh prompts at once
(B x --prompt-len tokens, at most --max-num-batched-tokens) and samples one
token each.

    python -m benchmarks.step_breakdown --model benchmarks/models/llama-100m --batch 256
    python -m benchmarks.step_breakdown --model benchmarks/models/llama-100m --prefill --batch 12 --prompt-len 170
    python -m benchmarks.step_breakdown --model benchmarks/models/qwen2.5-0.5b-yarn128k-2l --batch 1 \
        --prompt-len 16384 --steps 16 --threads 1 --cpu-time    # long-context decode on a loaded machine

The parts do not overlap: a call made inside another timed call counts for the
outer one only (the lm_head's product is "lm_head"; "sampler" includes its greedy
argmax), and "the rest" is the step minus all parts listed (Python between the
kernels: module calls, embedding, views, output bookkeeping). Each timed call adds
~1 us of wrapper. ``--cpu-time`` (with ``--threads 1``) times by the thread's CPU
time, which other jobs on a loaded machine inflate far less than wall time. Steps
run eagerly: a recorded step (a kernel tape, up to 64 rows) replays its kernels
without the Python calls the wrappers time.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.options import DEFAULT_MODEL
from benchmarks.report import load_avg, print_table, write_json


def _timed(owner: Any, name: str, part: str, totals: dict[str, float], calls: dict[str, int],
           active: list[str], clock: Callable[[], float]) -> Callable[[], None]:
    """Wrap owner.name so its time by ``clock`` adds to totals[part] unless another
    timed call encloses it (``active`` holds the open ones); returns the undo."""
    original = owner.__dict__[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if active:
            return original(*args, **kwargs)
        active.append(part)
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            totals[part] += clock() - start
            calls[part] += 1
            active.pop()

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def _subclasses(cls: type) -> list[type]:
    """cls and every class below it that is imported."""
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_subclasses(sub))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prefill", action="store_true", help="time prompt steps instead of decode steps")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the thread's CPU time (needs --threads 1): a machine shared with other jobs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.prefill and args.batch * args.prompt_len > args.max_num_batched_tokens:
        parser.error("--prefill: --batch x --prompt-len must fit one step's --max-num-batched-tokens")
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time times one thread: use --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)

    from benchmarks.peers.octavo_peer import OctavoPeer
    from octavo import SamplingParams
    from octavo.attention import paged
    from octavo.core.scheduler import Scheduler
    from octavo.kernels.fused_ops import FusedOps
    from octavo.kernels.paged_decode import PagedDecodeKernel
    from octavo.model.layers import moe
    from octavo.model.layers.vocab_parallel import ParallelLMHead
    from octavo.quant.base import FusedMoEMethod, LinearMethod
    from octavo.worker import model_runner

    peer = OctavoPeer(args.model, "bfloat16", max_num_seqs=max(args.batch, 256), enable_prefix_caching=False,
                      kv_cache_memory_bytes=2 * 2**30, enforce_eager=True,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    rng = random.Random(0)

    def new_prompts() -> list[list[int]]:
        return [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.batch)]

    prompts = new_prompts()
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if args.prefill:  # warm-up; fresh prompts each step (prefix caching is off anyway)
        batches = [new_prompts() for _ in range(args.steps)]
        peer.llm.generate(prompts, one_token, use_tqdm=False)
    else:
        peer.steady_decode_rate(prompts, 4)

    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    linear_methods = [(cls, "apply", "matmuls in the layers") for cls in _subclasses(LinearMethod)
                      if "apply" in cls.__dict__]
    # A mixture's experts: sorting the (token, expert) pairs, both products and the weighted sum, everything a
    # method's apply runs; its routing (softmax, top-k) apart. The router's product is one of the layers'.
    experts_methods = [(cls, "apply", "MoE experts") for cls in _subclasses(FusedMoEMethod) if "apply" in cls.__dict__]
    parts = [
        (ParallelLMHead, "forward", "lm_head"), *linear_methods, *experts_methods,
        (moe, "select_experts", "MoE routing"),
        (PagedDecodeKernel, "__call__", "decode attention"), (paged, "attend_prefills", "prefill attention"),
        (FusedOps, "rms_norm", "RMSNorm (+ residual)"),
        (FusedOps, "silu_mul", "SiLU x up"), (FusedOps, "rotary_write_kv", "rotary + K/V write"),
        (model_runner.ModelRunner, "_sample", "sampler"), (model_runner, "prepare_inputs", "input preparation"),
        (Scheduler, "schedule", "scheduling"), (Scheduler, "update_from_output", "scheduler update"),
    ]
    ids = [] if args.prefill else peer.start_decoding(prompts, args.steps)
    active: list[str] = []
    undo = [_timed(owner, name, part, totals, calls, active, clock) for owner, name, part in parts]
    load_start = load_avg()
    try:
        start = clock()
        for i in range(args.steps):
            if args.prefill:
                peer.llm.generate(batches[i], one_token, use_tqdm=False)  # one step: the prompts fit its budget
            else:
                peer.llm.engine.step()
        elapsed = clock() - start
    finally:
        for u in undo:
            u()
    if ids:
        peer.stop_decoding(ids)
    step_ms = elapsed / args.steps * 1e3
    tokens = args.batch * (args.prompt_len if args.prefill else 1)
    kind = (f"prompt step of {args.model.name}: {args.batch} prompts of {args.prompt_len} tokens" if args.prefill
            else f"decode step of {args.model.name} at batch {args.batch} (contexts {args.prompt_len}-"
                 f"{args.prompt_len + args.steps})")
    rows = [{"part": part, "ms_per_step": totals[part] / args.steps * 1e3, "share": totals[part] / elapsed,
             "calls_per_step": calls[part] / args.steps} for part in dict.fromkeys(p for _, _, p in parts)]
    rest = elapsed - sum(totals.values())
    rows.append({"part": "the rest", "ms_per_step": rest / args.steps * 1e3, "share": rest / elapsed,
                 "calls_per_step": ""})
    print_table(rows, ["part", "ms_per_step", "share", "calls_per_step"],
                title=f"{kind}: {step_ms:.1f} ms, {tokens / step_ms * 1e3:.0f} tok/s ({args.threads} threads, "
                      f"{args.steps} steps, eager, wrappers on{', CPU time' if args.cpu_time else ''})")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "step_breakdown", "args": vars(args),
                           "step_ms": step_ms, "parts": rows})


if __name__ == "__main__":
    main()
