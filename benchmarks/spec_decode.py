"""Speculative decoding: TPOT and throughput with and without proposals, same run.

    python -m benchmarks.spec_decode                       # octavo-mini (+ its draft), batches 1, 8, 32
    python -m benchmarks.spec_decode --batches 1 --ks 2,3 --repeats 5
    python -m benchmarks.spec_decode --llamacpp-server $LLAMA_SERVER --llamacpp-src $LLAMA_CPP_SRC
    python -m benchmarks.spec_decode --batches 1 --ks 2 --draft-vocabs 0,1024 --skip-ngram   # whole vs cut draft head

``--draft-vocabs``: the draft configurations run once per LM head size (speculative_draft_vocab; 0, the
default: the whole vocabulary, not the size octavo-mini-draft's ranking names).

Workloads (greedy, ignore_eos, fixed output length):
- ``heldout``: the start of each held-out Python file of octavo-mini's
  training split (``octavo/assets/heldout_sample.txt``, never trained on),
  continued: the draft model's workload.
- ``edit``: input-grounded: a held-out file, then a marker asking for the same
  file again, and the file's first line; the continuation can copy from the
  prompt: the n-gram proposer's workload.

Each configuration has its own engine, loaded before any clock starts and
warmed up (the adaptive governor learns there too); configurations run
interleaved, ``--repeats`` times, and the median is kept, so load spikes on a
shared machine hit every configuration alike. TPOT is per request, the mean of
(last token time - first token time) / (tokens - 1), the time of a token being
when ``LLMEngine.step`` returned it.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from benchmarks.report import load_avg, print_table
from octavo import LLM, SamplingParams
from octavo.assets import MINI_DRAFT_MODEL_PATH, MINI_MODEL_PATH, HELDOUT_SAMPLE_PATH
from octavo.sampling_params import RequestOutputKind

EDIT_MARKER = "\n\n# The same module once more, unchanged:\n"


@dataclass
class Result:
    workload: str
    config: str
    batch: int
    tpot_ms: float
    tok_s: float
    cpu_tpot_ms: float  # the same from this process's CPU time: steadier on a loaded machine
    cpu_tok_s: float
    acceptance_len: Optional[float]  # tokens per verification (1 + accepted proposals)
    spec_share: Optional[float]  # share of request-steps that carried proposals
    runs: list[float] = field(default_factory=list)


def heldout_files() -> list[str]:
    text = HELDOUT_SAMPLE_PATH.read_text()
    return [f for f in text.split("<|endoftext|>") if f.strip()]


def workloads(tokenizer, prompt_len: int) -> dict[str, list[list[int]]]:
    files = heldout_files()
    heldout = [tokenizer.encode(f)[:prompt_len] for f in files]
    edit = []
    for f in files:
        body = tokenizer.decode(tokenizer.encode(f)[1 : 1 + 2 * prompt_len])
        edit.append(tokenizer.encode(body + EDIT_MARKER + body.splitlines()[0] + "\n"))
    return {"heldout": heldout, "edit": edit}


def engines(args: argparse.Namespace) -> dict[str, LLM]:
    common = dict(dtype=args.dtype, max_num_seqs=max(args.batches), kv_cache_memory_bytes=256 * 2**20)
    made = {"none": LLM(str(args.model), **common)}
    k = args.adaptive_k
    for size in args.draft_vocabs:
        # 0: the draft's whole LM head; N: cut to its N most used tokens (speculative_draft_vocab).
        head, name = {"speculative_draft_vocab": size}, f"draft head {size}" if size else "draft"
        for k_fixed in args.ks:
            made[f"{name} k={k_fixed}"] = LLM(str(args.model), speculative_model=str(args.draft),
                                              num_speculative_tokens=k_fixed, speculative_adaptive=False, **head,
                                              **common)
        made[f"{name} k={k} adaptive"] = LLM(str(args.model), speculative_model=str(args.draft),
                                             num_speculative_tokens=k, **head, **common)
    if args.skip_ngram:
        return made
    for k_fixed in args.ks:
        made[f"ngram k={k_fixed}"] = LLM(str(args.model), speculative_method="ngram", num_speculative_tokens=k_fixed,
                                         speculative_adaptive=False, **common)
    made[f"ngram k={k} adaptive"] = LLM(str(args.model), speculative_method="ngram", num_speculative_tokens=k,
                                        **common)
    return made


def timed(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, ...]:
    """(mean TPOT s, output tok/s, the same two from CPU time, acceptance length,
    share of request-steps verified) of one batch."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    stats = engine.scheduler.spec_stats
    drafts0, accepted0 = stats.num_drafts, stats.num_accepted_tokens
    times: dict[str, list[tuple[float, float]]] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}-{start}", prompt, params)
        times[f"b{i}-{start}"] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = (time.perf_counter(), time.process_time())
        for out in outs:
            new = sum(len(c.token_ids) for c in out.outputs)
            times[out.request_id] += [now] * new
    elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
    tpots = [(t[-1][0] - t[0][0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    cpu_tpots = [(t[-1][1] - t[0][1]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    drafts = stats.num_drafts - drafts0
    accepted = stats.num_accepted_tokens - accepted0
    decode_steps = len(prompts) * (output_len - 1)  # request-steps if one token each
    acceptance = 1 + accepted / drafts if drafts else 1.0
    share = drafts / max(decode_steps - accepted, 1)
    tokens = len(prompts) * output_len
    return (statistics.mean(tpots), tokens / elapsed, statistics.mean(cpu_tpots), tokens / cpu_elapsed,
            acceptance, share)


def batch_of(prompts: list[list[int]], n: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(n)]


def measure(llm: LLM, prompts: list[list[int]], batch: int, output_len: int, solo: int) -> tuple[float, ...]:
    """Batch 1 runs ``solo`` prompts one after another (acceptance varies from
    prompt to prompt) and averages; a larger batch runs the first ``batch``
    prompts (cycled) together."""
    if batch > 1:
        return timed(llm, batch_of(prompts, batch), output_len)
    runs = [timed(llm, [p], output_len) for p in prompts[:solo]]
    return tuple(statistics.mean(r[i] for r in runs) for i in range(len(runs[0])))


def run(args: argparse.Namespace) -> tuple[list[Result], dict[str, list[list[int]]]]:
    made = engines(args)
    tokenizer = made["none"].get_tokenizer()
    loads = workloads(tokenizer, args.prompt_len)
    plan = []  # (workload, config, batch)
    for batch in args.batches:
        for name in made:
            if batch >= 32 and "adaptive" not in name and name != "none" and not name.endswith(f"k={args.adaptive_k}"):
                continue  # batch 32 shows adaptivity: no sweep of k there
            for workload in ("heldout", "edit"):
                plan.append((workload, name, batch))
    for workload, name, batch in plan:  # warm-up: kernels, caches and the governors' first measurements
        measure(made[name], loads[workload], batch, min(args.output_len, 64), args.solo)
    samples: dict[tuple[str, str, int], list[tuple[float, ...]]] = {p: [] for p in plan}
    for rep in range(args.repeats):
        for key in plan:
            workload, name, batch = key
            samples[key].append(measure(made[name], loads[workload], batch, args.output_len, args.solo))
        print(f"repeat {rep + 1}/{args.repeats} done, load {load_avg()}", flush=True)
    results = []
    for (workload, name, batch), runs in samples.items():
        med = [statistics.median(r[i] for r in runs) for i in range(6)]
        spec = name != "none"
        results.append(Result(
            workload, name, batch, med[0] * 1000, med[1], med[2] * 1000, med[3],
            med[4] if spec else None, med[5] if spec else None, [r[0] * 1000 for r in runs],
        ))
    return results, loads


def with_ratios(results: list[Result]) -> list[dict]:
    base = {(r.workload, r.batch): r for r in results if r.config == "none"}
    rows = []
    for r in sorted(results, key=lambda r: (r.batch, r.workload, r.config)):
        b = base[(r.workload, r.batch)]
        rows.append({
            "batch": r.batch, "workload": r.workload, "config": r.config, "TPOT ms": r.tpot_ms,
            "tok/s": r.tok_s, "TPOT speed-up": b.tpot_ms / r.tpot_ms, "tok/s ratio": r.tok_s / b.tok_s,
            "CPU TPOT ms": r.cpu_tpot_ms, "CPU TPOT speed-up": b.cpu_tpot_ms / r.cpu_tpot_ms,
            "CPU tok/s ratio": r.cpu_tok_s / b.cpu_tok_s,
            "accept len": r.acceptance_len, "spec share": r.spec_share,
        })
    return rows


def llamacpp_speculative(args: argparse.Namespace, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """llama.cpp's llama-server with and without ``--model-draft``, batch 1, same prompts."""
    from benchmarks.peers.llamacpp_spec import run_llama_server_pair

    return run_llama_server_pair(args, prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MINI_MODEL_PATH)
    parser.add_argument("--draft", type=Path, default=MINI_DRAFT_MODEL_PATH)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 4])
    parser.add_argument("--adaptive-k", type=int, default=3, help="k of the adaptive configurations")
    parser.add_argument("--draft-vocabs", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                        help="draft LM head sizes to run (speculative_draft_vocab; 0: the whole vocabulary)")
    parser.add_argument("--skip-ngram", action="store_true", help="draft-model configurations only")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--solo", type=int, default=4, help="prompts run one by one for batch 1")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the tiny models gain nothing from more, and CPU time stays meaningful)")
    parser.add_argument("--llamacpp-server", type=Path, help="llama-server binary: its speculative mode runs too")
    parser.add_argument("--llamacpp-src", type=Path, help="llama.cpp source (its GGUF converter)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, threads {args.threads}, "
          f"load {load_avg()}", flush=True)
    results, loads = run(args)
    rows = with_ratios(results)
    print_table(rows, list(rows[0]), "speculative decoding (ratios against 'none', same workload and batch)")
    extra: list[dict] = []
    if args.llamacpp_server:
        extra = llamacpp_speculative(args, {w: p[: args.solo] for w, p in loads.items()})
        print_table(extra, list(extra[0]), "llama.cpp llama-server, batch 1")
    if args.json:
        args.json.write_text(json.dumps({"octavo": rows, "llamacpp": extra}, indent=2))


if __name__ == "__main__":
    main()
