"""Quest sparse decode attention against dense: needle retrieval and decode speed at a long context.

    python -m benchmarks.sparse_attention --context 4096 --top-pages 16,64

One engine per mode (dense, then Quest at each ``--top-pages``), the default model unless ``--model``. Each
reads the same prompt: ``--context`` tokens of held-out English text with a needle sentence ("The pass key is
NNNNN.") at ``--depth`` of it, ending in the question, and decodes greedily: its first token, then ``--new-tokens``
steps. Reported per mode:

- whether the greedy answer is the pass key, and the log-probability of the answer's tokens after its first
  (the first comes from the prompt's last row, which prefill computes densely in every mode; the others are
  decode steps, where Quest chooses pages) while the answer is followed, and its change from dense;
- decode tokens/s and ms per step: the steps after the first ``WARMUP_STEPS`` over their time, taken in turns with
  the other modes' engines; also over the process's CPU time in those steps (with one thread, the work a step
  took whatever share of a loaded machine it got);
- for a model that cannot retrieve the needle (random weights: benchmarks/long_context.py), how many of the
  generated tokens agree with dense from the start, and the largest change of a decoded token's logprob among
  them.

The default model misses this needle from 2,048 tokens on, even densely: Quest's accuracy is measured on a pass
key it retrieves, by benchmarks/needle.py.

The functions (``needle_prompt``, ``measure``, ``comparison``) are for other benchmarks to call (a long-context
report, several long requests decoding together).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.report import load_avg, print_table, write_json

HAYSTACK = Path(__file__).resolve().parents[1] / "octavo" / "assets" / "heldout_english.txt"
# Decode steps of each engine left out of its timing: the first runs eagerly and the second records the step's
# kernel tape (octavo/worker/kernel_tape.py), together ~1 s, which would weigh most on the fastest mode.
WARMUP_STEPS = 2
# Tokens of held-out text between the starts of two seeds' prompts.
HAYSTACK_SHIFT = 1009


@dataclass
class Needle:
    prompt: list[int]
    answer: list[int]  # the pass key's tokens as the model would write them after the question


def needle_prompt(tokenizer: Any, context: int, depth: float, seed: int = 0) -> Needle:
    """``context`` tokens: held-out text (repeated as needed) with the needle at ``depth`` (0: the start,
    1: the end), then the question. Another ``seed`` draws another pass key and starts the text elsewhere, so
    that requests decoding together hold contexts that differ from their first token on."""
    key = str(random.Random(seed).randrange(10000, 100000))
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. The pass key is {key}. ", add_special_tokens=False)
    question = tokenizer.encode(" What is the pass key? The pass key is", add_special_tokens=False)
    answer = tokenizer.encode(f" {key}", add_special_tokens=False)
    text = tokenizer.encode(HAYSTACK.read_text(), add_special_tokens=False)
    shift = seed * HAYSTACK_SHIFT % len(text)
    text = text[shift:] + text[:shift]
    room = context - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"context must exceed the needle and question's {len(needle) + len(question)} tokens")
    filler = (text * (room // len(text) + 1))[:room]
    at = int(room * depth)
    return Needle(filler[:at] + needle + filler[at:] + question, answer)


@dataclass
class Speed:
    """Decode steps of one engine with ``batch`` requests decoding together."""

    batch: int
    steps: int  # timed
    seconds: float  # wall, over the timed steps
    cpu_seconds: float  # the process's CPU time over them

    @property
    def tok_s(self) -> float:
        return self.batch * self.steps / self.seconds

    @property
    def cpu_tok_s(self) -> float:
        return self.batch * self.steps / self.cpu_seconds

    @property
    def step_ms(self) -> float:
        return self.seconds / self.steps * 1e3


@dataclass
class Measure:
    mode: str
    found: bool  # every request's greedy answer is its pass key
    answer_logprob: Optional[float]  # summed over the requests' answers' tokens after their first; None if one missed
    speeds: list[Speed]  # one per batch size
    tokens: list[list[int]]  # generated, per request
    logprobs: list[list[float]]  # of each generated token, per request


def mode_name(sparse: Optional[tuple[int, int]]) -> str:
    return "dense" if sparse is None else f"quest K={sparse[0]} R={sparse[1]}"


def _decoding(engine: Any, ids: list[str]) -> bool:
    """Every one of ``ids`` is past its prompt (its first token sampled) and still running."""
    requests = [engine.scheduler.get_request(i) for i in ids]
    return all(r is not None and not r.is_finished and r.num_output_tokens for r in requests)


def decode_budget(prompt: int, new_tokens: int, batches: list[int], chunk: int) -> int:
    """Tokens a request of ``measure`` may generate: the first, ``new_tokens`` steps per batch size, and a token per
    step that prefills a later prompt (in chunks of ``chunk`` tokens, less a token per request decoding beside
    it), so that none ends while measured."""
    prefill_steps = -(-prompt // (chunk - max(batches))) + 1
    return 1 + len(batches) * new_tokens + (max(batches) - 1) * prefill_steps


def measure(model: str, needles: list[Needle], new_tokens: int, modes: list[Optional[tuple[int, int]]],
            batches: Optional[list[int]] = None, **engine: Any) -> list[Measure]:
    """One engine per mode (``(top pages, recent pages)``, None: dense), each decoding the needle prompts greedily.
    For each of ``batches`` (ascending; default: all the needles at once) every engine first prefills the prompts
    that batch adds to those already decoding, then takes ``new_tokens`` steps with that many requests decoding
    together, the engines in turns, one step of each after another, so that the shared machine's load falls on
    every mode alike; the first ``WARMUP_STEPS`` of each batch are not timed (a new batch size records a new kernel
    tape). Steps that also carry a prompt's chunk are never timed."""
    from octavo import LLM, SamplingParams
    from octavo.config import SchedulerConfig

    batches = sorted(batches or [len(needles)])
    if new_tokens <= WARMUP_STEPS:
        raise ValueError(f"new_tokens must exceed {WARMUP_STEPS}: the first {WARMUP_STEPS} steps of each batch are "
                         f"warm-up, not timed; got {new_tokens}")
    if batches[0] < 1 or batches[-1] > len(needles):
        raise ValueError(f"batches must lie in 1..{len(needles)} (the needle prompts); got {batches}")
    longest = max(len(n.prompt) for n in needles)
    budget = decode_budget(longest, new_tokens, batches,
                           engine.get("max_num_batched_tokens", SchedulerConfig.max_num_batched_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True, logprobs=1)
    engines = [LLM(model, max_model_len=longest + budget, max_num_seqs=batches[-1],
                   **({} if sparse is None else {"sparse_attention": "quest", "sparse_top_pages": sparse[0],
                                                 "sparse_recent_pages": sparse[1]}), **engine).engine
               for sparse in modes]
    last: list[dict[str, Any]] = [{} for _ in engines]  # each request's latest (cumulative) output
    speeds: list[list[Speed]] = [[] for _ in engines]
    for batch in batches:
        ids = [f"needle-{i}" for i in range(batch)]
        for engine_i, outputs in zip(engines, last):
            for i in range(len(outputs), batch):
                engine_i.add_request(ids[i], needles[i].prompt, params)
                outputs[ids[i]] = None
            while not _decoding(engine_i, ids):  # the new prompts' steps, up to their first tokens
                outputs.update((o.request_id, o) for o in engine_i.step())
        timed = [Speed(batch, 0, 0.0, 0.0) for _ in engines]
        for step in range(new_tokens):
            for engine_i, outputs, speed in zip(engines, last, timed):
                start, start_cpu = time.perf_counter(), time.process_time()
                outputs.update((o.request_id, o) for o in engine_i.step())
                if step >= WARMUP_STEPS:
                    speed.steps += 1
                    speed.seconds += time.perf_counter() - start
                    speed.cpu_seconds += time.process_time() - start_cpu
        for speed, engine_speeds in zip(timed, speeds):
            engine_speeds.append(speed)
    results = []
    for sparse, engine_i, outputs, engine_speeds in zip(modes, engines, last, speeds):
        engine_i.abort_request(list(outputs))
        completions = [outputs[f"needle-{i}"].outputs[0] for i in range(batches[-1])]
        found = all(c.token_ids[:len(n.answer)] == n.answer for c, n in zip(completions, needles))
        logprob = (sum(lp.logprob for c, n in zip(completions, needles) for lp in c.logprobs[1:len(n.answer)])
                   if found else None)
        results.append(Measure(mode_name(sparse), found, logprob, engine_speeds,
                               [list(c.token_ids) for c in completions],
                               [[lp.logprob for lp in c.logprobs] for c in completions]))
    return results


def attention_times(context: int, batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                    modes: list[Optional[tuple[int, int]]], steps: int) -> dict[str, float]:
    """Median seconds of one layer's decode attention for ``batch`` rows at ``context`` tokens each (bf16, random
    K/V in blocks at scattered places), per mode: the native kernel alone, or Quest around it (the new key's
    bounds, the page choice, the kernel on the cut tables). The modes are timed in turns."""
    from octavo.attention.base import StepLayout
    from octavo.attention.kv_quant import allocate_layer_cache, write_kv
    from octavo.attention.native_cpu import NativeCpuBackend
    from octavo.attention.quest import QuestBackend, record_key_bounds

    cpu = torch.device("cpu")
    pages = -(-context // block_size)
    cache = allocate_layer_cache(batch * pages, block_size, kv_heads, head_dim, torch.bfloat16, cpu, key_bounds=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(batch * pages, generator=gen)
    for part in (ids.view(-1, 1) * block_size + torch.arange(block_size)).view(-1).split(8192):
        k, v = (torch.randn(len(part), kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
        write_kv(cache, k, v, part)
        record_key_bounds(cache, part)
    table = ids.view(batch, pages)
    last = table[:, (context - 1) // block_size] * block_size + (context - 1) % block_size
    layout = StepLayout(block_size=block_size, num_decodes=batch, query_starts=list(range(batch)),
                        query_lens=[1] * batch, context_lens=[context] * batch, blocks_needed=[pages] * batch,
                        block_table=table, slot_mapping=last, device=cpu)
    inner = NativeCpuBackend.create({None}, required=True)
    backends = {mode_name(m): inner if m is None else QuestBackend(inner, *m) for m in modes}
    metas = {name: backend.build_metadata(layout) for name, backend in backends.items()}
    q = torch.randn(batch, heads, head_dim, generator=gen).bfloat16()
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(steps + 1):
        for name, backend in backends.items():
            start = time.perf_counter()
            backend.forward(q, q[:, :kv_heads], q[:, :kv_heads], cache, metas[name], None)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def comparison(results: list[Measure]) -> list[dict[str, Any]]:
    """A row per mode and batch size: the mode's answer logprob and speed also against the first (dense) mode's
    (at the same batch size), and how far its requests' tokens follow dense's."""
    dense = results[0]
    rows = []
    for r in results:
        change = (None if r.answer_logprob is None or dense.answer_logprob is None
                  else r.answer_logprob - dense.answer_logprob)
        agree, drift = [], []
        for tokens, logprobs, dense_tokens, dense_logprobs in zip(r.tokens, r.logprobs, dense.tokens, dense.logprobs):
            n = next((i for i, (a, b) in enumerate(zip(tokens, dense_tokens)) if a != b), len(tokens))
            agree.append(f"{n}/{len(tokens)}")
            # Decoded tokens only (the first comes from the densely computed prompt), while both modes agree.
            drift += [abs(a - b) for a, b in zip(logprobs[1:n], dense_logprobs[1:n])]
        for speed, dense_speed in zip(r.speeds, dense.speeds):
            rows.append({"batch": speed.batch, "mode": r.mode, "found": r.found, "answer_logprob": r.answer_logprob,
                         "logprob_change": change, "agree": ", ".join(agree),
                         "token_logprob_change": max(drift, default=None), "step_ms": speed.step_ms,
                         "decode_tok_s": speed.tok_s, "speedup": speed.tok_s / dense_speed.tok_s,
                         "decode_cpu_tok_s": speed.cpu_tok_s, "cpu_speedup": speed.cpu_tok_s / dense_speed.cpu_tok_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or GGUF file (default: the default model)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (the default model reads 8192)")
    parser.add_argument("--depth", type=float, default=0.3, help="where the needle sits in the prompt, 0..1")
    parser.add_argument("--new-tokens", type=int, default=32, help=f"decode steps timed after {WARMUP_STEPS} warm-up ones")
    parser.add_argument("--top-pages", default="16,64", help="comma-separated sparse_top_pages to measure")
    parser.add_argument("--recent-pages", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each engine")
    parser.add_argument("--attention-contexts", default="8192,32768",
                        help="comma-separated contexts of the attention-alone measure (empty: skip it)")
    parser.add_argument("--attention-steps", type=int, default=100, help="timed steps of the attention-alone measure")
    parser.add_argument("--attention-batch", type=int, default=1)
    parser.add_argument("--shape", default="9,3,64,30",
                        help="heads, KV heads, head_dim, layers of the attention-alone measure (the default model's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from octavo.entrypoints.engine_args import resolve_model_path
    from octavo.tokenizer import Tokenizer

    model = resolve_model_path(args.model)
    needle = needle_prompt(Tokenizer(model), args.context, args.depth)
    load_start = load_avg()
    modes = [None] + [(int(k), args.recent_pages) for k in args.top_pages.split(",") if k]
    rows = comparison(measure(model, [needle], args.new_tokens, modes, dtype=args.dtype,
                              threads_per_worker=args.threads))
    print_table(rows, ["mode", "found", "answer_logprob", "logprob_change", "agree", "token_logprob_change",
                       "step_ms", "decode_tok_s", "speedup", "decode_cpu_tok_s", "cpu_speedup"],
                title=f"needle at depth {args.depth} of {len(needle.prompt)} tokens, {Path(model).name} {args.dtype}, "
                      f"{args.new_tokens} tokens greedy, {args.threads} thread(s), decode steps in turns")
    attention = []
    heads, kv_heads, head_dim, layers = (int(x) for x in args.shape.split(","))
    for context in (int(c) for c in args.attention_contexts.split(",") if c):
        seconds = attention_times(context, args.attention_batch, heads, kv_heads, head_dim, 16, modes,
                                  args.attention_steps)
        attention += [{"context": context, "mode": name, "layer_us": t * 1e6, "step_ms": t * layers * 1e3,
                       "speedup": seconds["dense"] / t} for name, t in seconds.items()]
    if attention:
        print_table(attention, ["context", "mode", "layer_us", "step_ms", "speedup"],
                    title=f"decode attention alone, batch {args.attention_batch}, {heads}/{kv_heads} heads of "
                          f"{head_dim} x {layers} layers, bf16, block 16, median of {args.attention_steps} in turns")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "sparse_attention", "args": vars(args), "results": rows,
                           "attention": attention})


if __name__ == "__main__":
    main()
