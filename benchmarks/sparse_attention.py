"""Quest sparse decode attention against dense: needle retrieval and decode speed at a long context.

    python -m benchmarks.sparse_attention --context 4096 --top-pages 16,64

One engine per mode (dense, then Quest at each ``--top-pages``), the default model unless ``--model``. Each
reads the same prompt: ``--context`` tokens of held-out English text with a needle sentence ("The pass key is
NNNNN.") at ``--depth`` of it, ending in the question, and decodes ``--new-tokens`` greedily. Reported per mode:

- whether the greedy answer is the pass key, and the log-probability of the answer's tokens after its first
  (the first comes from the prompt's last row, which prefill computes densely in every mode; the others are
  decode steps, where Quest chooses pages) while the answer is followed, and its change from dense;
- decode tokens/s: the tokens after the first ``WARMUP_STEPS`` decoded over the time of the engine's decode steps
  that made them, taken in turns with the other modes' engines; also over the process's CPU time in those steps (with one thread, the work a step
  took whatever share of a loaded machine it got);
- for a model that cannot retrieve the needle (random weights: benchmarks/long_context.py), how many of the
  generated tokens agree with dense from the start, and the largest change of a decoded token's logprob among
  them.

The functions (``needle_prompt``, ``measure``, ``comparison``) are for other benchmarks to call (a long-context
report).
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


@dataclass
class Needle:
    prompt: list[int]
    answer: list[int]  # the pass key's tokens as the model would write them after the question


def needle_prompt(tokenizer: Any, context: int, depth: float, seed: int = 0) -> Needle:
    """``context`` tokens: held-out text (repeated as needed) with the needle at ``depth`` (0: the start,
    1: the end), then the question."""
    key = str(random.Random(seed).randrange(10000, 100000))
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. The pass key is {key}. ", add_special_tokens=False)
    question = tokenizer.encode(" What is the pass key? The pass key is", add_special_tokens=False)
    answer = tokenizer.encode(f" {key}", add_special_tokens=False)
    text = tokenizer.encode(HAYSTACK.read_text(), add_special_tokens=False)
    room = context - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"context must exceed the needle and question's {len(needle) + len(question)} tokens")
    filler = (text * (room // len(text) + 1))[:room]
    at = int(room * depth)
    return Needle(filler[:at] + needle + filler[at:] + question, answer)


@dataclass
class Measure:
    mode: str
    found: bool  # the greedy answer is the pass key
    answer_logprob: Optional[float]  # of the answer's tokens after its first, None when not followed
    decode_tok_s: float
    decode_cpu_tok_s: float  # over the process's CPU time in the decode steps
    tokens: list[int]  # generated
    logprobs: list[float]  # of each generated token


def mode_name(sparse: Optional[tuple[int, int]]) -> str:
    return "dense" if sparse is None else f"quest K={sparse[0]} R={sparse[1]}"


def measure(model: str, needle: Needle, new_tokens: int, modes: list[Optional[tuple[int, int]]],
            **engine: Any) -> list[Measure]:
    """One engine per mode (``(top pages, recent pages)``, None: dense), each decoding the needle prompt
    greedily; after every engine's prefill the decode steps are taken in turns, one step of each engine
    after another, so that the shared machine's load falls on every mode alike."""
    from octavo import LLM, SamplingParams

    if new_tokens <= WARMUP_STEPS + 1:
        raise ValueError(f"new_tokens must exceed {WARMUP_STEPS + 1}: the first token and {WARMUP_STEPS} warm-up steps "
                         f"are not timed; got {new_tokens}")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    engines = []
    for sparse in modes:
        options = {} if sparse is None else {"sparse_attention": "quest", "sparse_top_pages": sparse[0],
                                              "sparse_recent_pages": sparse[1]}
        llm = LLM(model, max_model_len=len(needle.prompt) + new_tokens, max_num_seqs=1, **options, **engine)
        llm.engine.add_request("needle", needle.prompt, params)
        while not llm.engine.step():  # the prompt's steps, up to its first token
            pass
        engines.append(llm.engine)
    seconds = [0.0] * len(engines)
    cpu = [0.0] * len(engines)
    steps = [0] * len(engines)
    final: list[Any] = [None] * len(engines)
    while any(out is None for out in final):
        for i, engine_i in enumerate(engines):
            if final[i] is not None:
                continue
            start, start_cpu = time.perf_counter(), time.process_time()
            outs = engine_i.step()
            steps[i] += 1
            if steps[i] > WARMUP_STEPS:
                seconds[i] += time.perf_counter() - start
                cpu[i] += time.process_time() - start_cpu
            final[i] = next((o for o in outs if o.finished), None)
    n = len(needle.answer)
    results = []
    for sparse, out, took, took_cpu in zip(modes, final, seconds, cpu):
        completion = out.outputs[0]
        found = completion.token_ids[:n] == needle.answer
        logprob = sum(lp.logprob for lp in completion.logprobs[1:n]) if found else None
        decoded = len(completion.token_ids) - 1 - WARMUP_STEPS
        results.append(Measure(mode_name(sparse), found, logprob, decoded / took, decoded / took_cpu,
                               list(completion.token_ids), [lp.logprob for lp in completion.logprobs]))
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
    """Each mode's row, its answer logprob and speed also against the first (dense) mode's."""
    dense = results[0]
    rows = []
    for r in results:
        change = (None if r.answer_logprob is None or dense.answer_logprob is None
                  else r.answer_logprob - dense.answer_logprob)
        agree = next((i for i, (a, b) in enumerate(zip(r.tokens, dense.tokens)) if a != b), len(r.tokens))
        # Decoded tokens only (the first comes from the densely computed prompt), while both modes agree.
        drift = max((abs(a - b) for a, b in zip(r.logprobs[1:agree], dense.logprobs[1:agree])), default=None)
        rows.append({"mode": r.mode, "found": r.found, "answer_logprob": r.answer_logprob, "logprob_change": change,
                     "agree": f"{agree}/{len(r.tokens)}", "token_logprob_change": drift,
                     "decode_tok_s": r.decode_tok_s, "speedup": r.decode_tok_s / dense.decode_tok_s,
                     "decode_cpu_tok_s": r.decode_cpu_tok_s,
                     "cpu_speedup": r.decode_cpu_tok_s / dense.decode_cpu_tok_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or GGUF file (default: the default model)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (the default model reads 8192)")
    parser.add_argument("--depth", type=float, default=0.3, help="where the needle sits in the prompt, 0..1")
    parser.add_argument("--new-tokens", type=int, default=32, help=f"more than {WARMUP_STEPS + 1}")
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
    rows = comparison(measure(model, needle, args.new_tokens, modes, dtype=args.dtype,
                              threads_per_worker=args.threads))
    print_table(rows, ["mode", "found", "answer_logprob", "logprob_change", "agree", "token_logprob_change",
                       "decode_tok_s", "speedup", "decode_cpu_tok_s", "cpu_speedup"],
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
