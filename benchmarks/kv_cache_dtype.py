"""The long-context decode step with a bf16, int8 and fp8 KV cache.

    python -m benchmarks.kv_cache_dtype --model benchmarks/models/llama-100m --batch 32 --context 2048

A ModelRunner per cache dtype (bf16 weights), each holding ``batch``
sequences of ``context`` tokens: their caches are filled with random K/V
(written through the same quantizing path a prefill takes) and the sequences
join as prefix-cache hits, so no long prefill is timed or waited for. Then
every runner takes ``steps`` decode steps (one token per sequence: the model,
attention over the whole context, the sampler), the runners in turn so that
load on the shared machine falls on all of them alike. Reported: the median
step, tokens/s, the K/V bytes a step reads (scales included) and the
attention alone (the native kernel over every layer, same caches and tables,
also taken in turn), each as a ratio to bf16.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.options import DEFAULT_MODEL
from benchmarks.report import load_avg, print_table, write_json

KV_DTYPES = ("auto", "int8", "fp8")


class DecodeRun:
    """One runner with ``batch`` sequences at ``context`` tokens, stepped one token at a time."""

    def __init__(self, model: Path, kv: str, batch: int, context: int, steps: int, block_size: int) -> None:
        from octavo.attention.kv_quant import write_kv
        from octavo.config import CacheConfig, ModelConfig, SchedulerConfig
        from octavo.core.request import Request
        from octavo.core.step_state import SentRequests
        from octavo.sampling_params import SamplingParams
        from octavo.worker.model_runner import ModelRunner

        per_seq = -(-(context + steps + 2) // block_size)
        self.runner = ModelRunner(
            ModelConfig(model=str(model), dtype="bfloat16", attention_backend="native"),
            CacheConfig(block_size=block_size, num_blocks=batch * per_seq, kv_cache_dtype=kv),
            SchedulerConfig(max_num_seqs=batch),
        )
        ids = list(range(batch * per_seq))
        random.Random(0).shuffle(ids)  # blocks at scattered places, as in an engine that has run a while
        self.tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        gen = torch.Generator().manual_seed(0)
        shape = self.runner.kv_caches[0].data.shape
        slots = torch.arange(shape[1] * shape[2])
        for cache in self.runner.kv_caches:
            for part in slots.split(8192):
                k, v = (torch.randn(len(part), shape[3], shape[4], generator=gen).bfloat16() for _ in range(2))
                write_kv(cache, k, v, part)
        vocab = self.runner.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        self.requests = [
            Request(f"r{i}", [random.Random(i).randrange(vocab) for _ in range(context)], params) for i in range(batch)
        ]
        self.sent = SentRequests(block_size)
        self.step_times: list[float] = []
        # The first step: each sequence's context is a prefix-cache hit but its last token.
        self._step([self.sent.delta(r, context - 1, 1, [t], True) for r, t in zip(self.requests, self.tables)])

    def _step(self, scheduled: list) -> None:
        from octavo.core.outputs import SchedulerOutput

        start = time.perf_counter()
        out = self.runner.execute(SchedulerOutput(scheduled=scheduled, block_copies=[]))
        self.step_times.append(time.perf_counter() - start)
        for r in self.requests:
            r.append_output_token(out.sampled_token_ids[r.request_id][0])

    def decode_step(self) -> None:
        self._step([self.sent.delta(r, r.num_tokens - 1, 1, [t], True) for r, t in zip(self.requests, self.tables)])

    def attention_alone(self) -> Callable[[], None]:
        """The native decode kernel over every layer, these caches and tables."""
        kernel = self.runner.backends.attention.kernel
        lens = torch.tensor([r.num_tokens for r in self.requests], dtype=torch.int64)
        width = max(-(-int(n) // self.runner.block_size) for n in lens)
        tables = torch.tensor([t[:width] for t in self.tables], dtype=torch.int64)
        heads = self.runner.model.local_layers[0].self_attn.num_heads
        q = torch.randn(len(self.requests), heads, self.runner.arch.head_dim).bfloat16()
        scale = self.runner.arch.head_dim**-0.5

        def run() -> None:
            for c in self.runner.kv_caches:
                scales = c.scales
                kernel(q, c.data[0], c.data[1], tables, lens, None, scale,
                       None if scales is None else scales[0], None if scales is None else scales[1])

        return run

    def tokens_per_gib(self) -> int:
        """Tokens a 1 GiB pool holds in this dtype (the sizing the engine does)."""
        from octavo.worker.kv_cache import bytes_per_block

        specs = self.runner.kv_cache_specs
        return 2**30 // bytes_per_block(specs) * specs[0].block_size

    def kv_bytes_per_step(self) -> int:
        """K/V (and scale) bytes the attention of one step reads: every context position, every layer."""
        cache = self.runner.kv_caches[0]
        per_position = 2 * cache.data.shape[3] * cache.data.shape[4] * cache.data.element_size()
        if cache.scales is not None:
            per_position += 2 * cache.data.shape[3] * cache.scales.element_size()
        return per_position * len(self.runner.kv_caches) * sum(r.num_tokens for r in self.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per dtype (after one warm step)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    load_start = load_avg()
    runs = {kv: DecodeRun(args.model, kv, args.batch, args.context, args.steps + 1, args.block_size)
            for kv in KV_DTYPES}
    for _ in range(args.steps + 1):  # in turn: the machine's load falls on every dtype alike
        for run in runs.values():
            run.decode_step()
    kernels = {kv: run.attention_alone() for kv, run in runs.items()}
    kernel_times: dict[str, list[float]] = {kv: [] for kv in runs}
    for _ in range(args.steps + 1):
        for kv, kernel in kernels.items():
            start = time.perf_counter()
            kernel()
            kernel_times[kv].append(time.perf_counter() - start)
    attention = {kv: statistics.median(times[1:]) for kv, times in kernel_times.items()}
    rows = []
    for kv, run in runs.items():
        step_s = statistics.median(run.step_times[2:])  # the first two: the join, and a warm-up step
        rows.append({"kv_cache_dtype": "bf16" if kv == "auto" else kv, "tokens_per_gib": run.tokens_per_gib(),
                     "step_ms": step_s * 1e3, "tok_s": args.batch / step_s,
                     "kv_mb_per_step": run.kv_bytes_per_step() / 1e6, "attention_ms": attention[kv] * 1e3})
    base = rows[0]
    for row in rows:
        row["step_speedup"] = base["step_ms"] / row["step_ms"]
        row["attention_speedup"] = base["attention_ms"] / row["attention_ms"]
        row["kv_bytes_ratio"] = row["kv_mb_per_step"] / base["kv_mb_per_step"]
    print_table(rows, ["kv_cache_dtype", "tokens_per_gib", "step_ms", "tok_s", "step_speedup", "attention_ms", "attention_speedup",
                       "kv_mb_per_step", "kv_bytes_ratio"],
                title=f"decode step, {args.model.name} bf16, batch {args.batch}, context {args.context}, "
                      f"{args.threads} threads, median of {args.steps} steps")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "kv_cache_dtype", "args": vars(args), "results": rows})
    del runs
    gc.collect()


if __name__ == "__main__":
    main()
