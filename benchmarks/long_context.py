"""Long contexts on Qwen2.5-0.5B's shape (random bf16 weights, its documented 128k set-up: YaRN factor 4
over the 32k it was trained on): prefill time, batch-1 decode tok/s, KV bytes per token and peak resident
memory at each prompt length, Octavo against llama.cpp on the same weights.

    python -m benchmarks.long_context                          # 8k, Octavo and llama.cpp
    python -m benchmarks.long_context --lengths 8192,32768
    python -m benchmarks.long_context --with-128k              # adds 128k (131072 with the new tokens): hours
    python -m benchmarks.long_context --layers 2 --lengths 8192,32768 --with-128k   # the per-layer memory, sooner
    python -m benchmarks.long_context --layers 4 --lengths 32768 --rounds 7        # 32k decode, prefill affordable

The checkpoint (``qwen2.5-0.5b-yarn128k``, or ``-<N>l`` with ``--layers``) is written into benchmarks/models by
tools/make_bench_models.py's code on first use, with its bf16 GGUF when ``--llama-cpp-src`` names llama.cpp's
source (convert_hf_to_gguf.py; benchmarks/setup_peers.sh fetches it).

Each engine runs each length in a process of its own (benchmarks/peer_process.py: its OpenMP threads wait
passively, and it times its own calls), which holds its context until the length is done; its
resident memory is read once loaded, and its peak (VmHWM) is reset then, so the peak reported is the request's alone
(loading's is reported apart). At each length the engines prefill one greedy request of ``--length`` random
ordinary tokens one after another (prefill time = time to the first token), then decode it in turns (turns.py):
a warm-up round and ``--rounds`` rounds of ``--new-tokens`` tokens, every engine once a round, so that a shared
machine that speeds up or slows down hits them alike; decode tok/s is the median over rounds (and its range), and
ratios are taken within a round.

- Octavo: ``LLM(max_model_len=131072, enable_chunked_prefill=True, max_num_batched_tokens=--chunk)``,
  prefix caching off, its KV cache sized for the request (``--kv-cache-memory`` what the prompt and the new
  tokens take), stepped by hand to time the first token and each round.
- llama.cpp: llama-cpp-python on the bf16 GGUF, a context of the request's length, f16 KV cache (the bytes
  per token of Octavo's bf16 one), run twice: ``llamacpp`` with flash attention off (its CPU default;
  ``n_batch`` at most 512, since a batch's scores over the whole context are materialized) and
  ``llamacpp-fa`` with it on (``n_batch`` = ``--chunk``). On this build flash attention makes its prefill
  faster and its decode slower (8k: 3.3x slower), so Octavo's ratios are taken against the faster of the
  two in each phase.

With ``--sparse-top-pages K1,K2`` Octavo's decode is also measured dense against Quest sparse attention
(``--sparse-attention quest --sparse-top-pages K``, ``--sparse-recent-pages``) at each length, in a process of
its own: benchmarks/sparse_attention.py's needle prompts of that length and its ``measure`` (one engine per mode,
each prefilling the prompts once, then the engines' decode steps in turns). ``--decode-batch 1,2`` measures one
request decoding, then two together: a second prompt of the length (another pass key, the text started elsewhere)
is prefilled beside the first, which goes on decoding, and the steps with both decoding are timed. Quest saves the
K/V reads only, and a step also reads every weight once: ``--quantization int4`` (the engine's option; the LM head
stays bf16 unless ``--quantize-head``) and more requests per step raise the K/V's share. Reported per batch: ms per
step, decode tok/s over wall and over CPU time (read that one on a loaded machine, with ``--threads 1``) and their
ratios to dense, and how far the logprobs moved (random weights cannot find the needle: per request the tokens
agreeing with dense from the start, and the largest change of a decoded token's logprob among them).

    python -m benchmarks.long_context --lengths 32768 --engines "" --sparse-top-pages 64 --decode-batch 1,2 \
        --quantization int4 --quantize-head --new-tokens 16 --threads 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.options import int_list
from benchmarks.peer_process import PeerError, PeerProcess, rss_mib
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.turns import fmt_spread, self_timed_rounds, spread
from octavo.config import QUANTIZATIONS

MODELS = Path(__file__).resolve().parent / "models"
MAX_MODEL_LEN = 131072
# Qwen2.5's 128k set-up (its model cards' rope_scaling), on the 32k config the shape already has.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1_000_000.0}
RESULT = "long_context result: "


ENGINES = ("octavo", "llamacpp", "llamacpp-fa")


def long_context_model(layers: Optional[int], llama_cpp_src: Optional[Path]) -> Path:
    """The qwen2.5-0.5b shape with YaRN to 128k (``layers`` of them: default 24), made once; its bf16
    GGUF too where ``llama_cpp_src`` is given."""
    from tools.make_bench_models import BENCH_MODELS, convert_to_gguf, make_model

    base = BENCH_MODELS["qwen2.5-0.5b"]
    config = {**base.config, "rope_parameters": YARN}
    name = "qwen2.5-0.5b-yarn128k"
    if layers is not None:
        config["num_hidden_layers"] = layers
        name += f"-{layers}l"
    folder = make_model(dataclasses.replace(base, name=name, config=config), MODELS)
    if llama_cpp_src is not None:
        convert_to_gguf(folder, llama_cpp_src)
    return folder


def kv_bytes_per_token(folder: Path) -> int:
    """bf16 K and V of every layer and KV head."""
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2


def _loaded() -> dict[str, float]:
    """Resident memory once the engine is loaded, and the peak of loading; then the peak is reset, so the
    one read at the end is the request's own (loading reads and converts the weights: its transient peak
    would otherwise hide what the context costs)."""
    memory = {"rss_loaded_mib": rss_mib("VmRSS"), "peak_rss_loading_mib": rss_mib("VmHWM")}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux)
    return memory


def _prompt(folder: Path, length: int) -> list[int]:
    from benchmarks.workload import ordinary_token_ids

    return random.Random(0).choices(ordinary_token_ids(folder), k=length)


class HeldRequest:
    """An engine holding one long request in its own process (``PeerProcess``); ``report`` once it is decoded."""

    memory: dict[str, float]  # ``_loaded``'s, read once the engine was loaded

    def kv_bytes_per_token(self) -> int:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        """KV bytes per token, the memory once loaded and the request's peak resident memory."""
        return {"kv_bytes_per_token": self.kv_bytes_per_token(), **self.memory, "peak_rss_mib": rss_mib("VmHWM")}


class OctavoContext(HeldRequest):
    """Octavo holding one long greedy request of ``budget`` new tokens: prefilled once, then decoded on demand."""

    def __init__(self, folder: Path, length: int, budget: int, chunk: int) -> None:
        from octavo import LLM

        # What the request takes, plus a block for the partly filled last one.
        kv_bytes = (length + budget + 16) * kv_bytes_per_token(folder)
        self.llm = LLM(str(folder), dtype="bfloat16", max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                       max_num_batched_tokens=chunk, max_num_seqs=1, enable_prefix_caching=False,
                       kv_cache_memory_bytes=kv_bytes)
        self.prompt = _prompt(folder, length)
        self.budget = budget
        self.memory = _loaded()

    def prefill(self) -> float:
        """Seconds to the first token."""
        from octavo import SamplingParams

        engine = self.llm.engine
        engine.add_request("long", self.prompt, SamplingParams(temperature=0, max_tokens=self.budget, ignore_eos=True))
        start = time.perf_counter()
        while not any(r.num_output_tokens for r in engine.scheduler.running):
            engine.step()
        return time.perf_counter() - start

    def decode(self, tokens: int) -> float:
        """Seconds to the next ``tokens`` tokens."""
        engine = self.llm.engine
        request = engine.scheduler.get_request("long")
        target = request.num_output_tokens + tokens
        start = time.perf_counter()
        while request.num_output_tokens < target:
            engine.step()
        return time.perf_counter() - start

    def kv_bytes_per_token(self) -> int:
        from octavo.worker.kv_cache import bytes_per_block

        runner = self.llm.engine.executor.worker.runner
        return bytes_per_block(runner.kv_cache_specs) // runner.block_size


LLAMACPP_BATCH_WITHOUT_FLASH = 512  # without flash attention a batch's scores over the context are materialized


class LlamaCppContext(HeldRequest):
    """llama.cpp holding one long greedy request (a context of its length and ``budget`` new tokens)."""

    def __init__(self, folder: Path, length: int, budget: int, chunk: int, threads: int, flash_attn: bool) -> None:
        from benchmarks.peers.llamacpp import LlamaCppPeer

        n_batch = chunk if flash_attn else min(chunk, LLAMACPP_BATCH_WITHOUT_FLASH)
        self.peer = LlamaCppPeer(folder, n_ctx=length + budget + 16, threads=threads, n_batch=n_batch,
                                 flash_attn=flash_attn)
        self.folder = folder
        self.prompt = _prompt(folder, length)
        self.memory = _loaded()

    def prefill(self) -> float:
        start = time.perf_counter()
        self._tokens = self.peer.greedy_tokens(self.prompt)
        next(self._tokens)
        return time.perf_counter() - start

    def decode(self, tokens: int) -> float:
        start = time.perf_counter()
        for _ in range(tokens):
            next(self._tokens)
        return time.perf_counter() - start

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.folder)  # f16 K and V, as the context allocates them


@dataclasses.dataclass
class SparseRun:
    """What ``--sparse-top-pages`` measures at each length: dense against Quest at each of ``top_pages``, for each of
    ``decode_batches`` requests decoding together, with the weights in ``quantization`` (None: bf16)."""

    new_tokens: int
    chunk: int
    threads: int
    top_pages: list[int]
    recent_pages: int
    decode_batches: list[int]
    quantization: Optional[str]
    quantize_head: bool  # the LM head in the weights' format too (int8 for w8a8), else kept bf16

    def engine_options(self) -> dict[str, Any]:
        if self.quantization is None:
            return {}
        head = ("int8" if self.quantization == "w8a8" else self.quantization) if self.quantize_head else "none"
        return {"quantization": self.quantization, "lm_head_quantization": head}

    def weights(self) -> str:
        """How the weights are held, for the report's title."""
        if self.quantization is None:
            return "bf16 weights"
        head = f"{self.quantization} LM head" if self.quantize_head else "bf16 LM head"
        return f"{self.quantization} weights, {head}"

    def flags(self) -> list[str]:
        """The child process's flags for this run."""
        return (["--new-tokens", str(self.new_tokens), "--chunk", str(self.chunk), "--threads", str(self.threads),
                 "--sparse-top-pages", ",".join(map(str, self.top_pages)), "--sparse-recent-pages",
                 str(self.recent_pages), "--decode-batch", ",".join(map(str, self.decode_batches))]
                + (["--quantization", self.quantization] if self.quantization else [])
                + (["--quantize-head"] if self.quantize_head else []))


def run_octavo_sparse(folder: Path, length: int, run: SparseRun) -> list[dict[str, Any]]:
    """Dense and Quest at each of ``run.top_pages`` on needle prompts of ``length`` tokens (a distinct one per
    request), decode steps in turns."""
    from benchmarks.sparse_attention import comparison, decode_budget, measure, needle_prompt
    from octavo.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(folder))
    needles = [needle_prompt(tokenizer, length, depth=0.3, seed=i) for i in range(max(run.decode_batches))]
    # Every request's K/V and, with Quest, each block's key bounds (1/16 more at block size 16), plus a block each.
    tokens = length + decode_budget(length, run.new_tokens, run.decode_batches, run.chunk) + 16
    kv_bytes = len(needles) * tokens * kv_bytes_per_token(folder) * 17 // 16
    modes = [None] + [(k, run.recent_pages) for k in run.top_pages]
    results = measure(str(folder), needles, run.new_tokens, modes, run.decode_batches, dtype="bfloat16",
                      enable_chunked_prefill=True, max_num_batched_tokens=run.chunk, enable_prefix_caching=False,
                      kv_cache_memory_bytes=kv_bytes, threads_per_worker=run.threads, **run.engine_options())
    return comparison(results)


def sparse_report(args: argparse.Namespace, lengths: list[int]) -> list[dict[str, Any]]:
    """``run_octavo_sparse`` at each length, each in a fresh process; its rows, or the error it ended with."""
    run = sparse_run(args)
    rows: list[dict[str, Any]] = []
    for length in lengths:
        command = [sys.executable, "-m", "benchmarks.long_context", "--run-sparse", "--length", str(length),
                   "--model", str(args.model), *run.flags()]
        before = load_avg()
        done = subprocess.run(command, capture_output=True, text=True)
        found = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
        load = f"{before} -> {load_avg()}"
        if done.returncode or not found:
            rows.append({"tokens": length, "error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}",
                         "load": load})
            continue
        rows += [{"tokens": length, **row, "load": load} for row in json.loads(found[-1].removeprefix(RESULT))]
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows, ["tokens", "batch", "mode", "step_ms", "decode_tok_s", "speedup", "decode_cpu_tok_s",
                       "cpu_speedup", "agree", "token_logprob_change", "found", "logprob_change", "load", "error"],
                title=f"dense vs Quest decode (R = {args.sparse_recent_pages}), {args.model.name}, {run.weights()}, "
                      f"{args.new_tokens} steps per batch, {args.threads} threads, one engine per mode, decode "
                      f"steps in turns")
    return rows


def sparse_run(args: argparse.Namespace) -> SparseRun:
    return SparseRun(args.new_tokens, args.chunk, args.threads, args.sparse_top_pages, args.sparse_recent_pages,
                     args.decode_batch, args.quantization, args.quantize_head)


def _budget(args: argparse.Namespace) -> int:
    """New tokens a request may take: the first, a warm-up round and ``--rounds`` rounds."""
    return 1 + (args.rounds + 1) * args.new_tokens


def _start(args: argparse.Namespace, engine: str, length: int) -> PeerProcess:
    """One engine at one length in a process of its own (benchmarks/peer_process.py), its context loaded."""
    if engine == "octavo":
        return PeerProcess(engine, OctavoContext, args.model, length, _budget(args), args.chunk, threads=args.threads)
    return PeerProcess(engine, LlamaCppContext, args.model, length, _budget(args), args.chunk, args.threads,
                       engine == "llamacpp-fa", threads=args.threads)


def _at_length(args: argparse.Namespace, engines: list[str], length: int) -> list[dict[str, Any]]:
    """Every engine prefills in turn in a process of its own and keeps its context; then they decode in
    rounds, one after another. A row per engine, its decode rates per round in ``decode_rounds``."""
    rows, children = {}, {}
    for engine in engines:
        row = rows[engine] = {"engine": engine, "tokens": length, "load": load_avg()}
        child = None
        try:
            child = _start(args, engine, length)
            row["prefill_s"] = child.call("prefill")
            children[engine] = child
        except PeerError as exc:
            row["error"] = str(exc)[-400:]
            if child is not None:
                child.kill()
        print(json.dumps(row), flush=True)
    # Each decode timed in its process, the pipe's messages left out.
    times = self_timed_rounds({e: lambda c=c: c.timed("decode", args.new_tokens) for e, c in children.items()},
                              args.rounds)
    for engine, child in children.items():
        rates = [args.new_tokens / wall for wall, _ in times[engine]]
        rows[engine].update(child.call("report"), decode_tok_s=statistics.median(rates), decode_rounds=rates,
                            decode_range=f"{min(rates):.3g}-{max(rates):.3g}",
                            load=f"{rows[engine]['load']} -> {load_avg()}")
        child.close()
        print(json.dumps(rows[engine]), flush=True)
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int_list, default=[8192], help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--with-128k", action="store_true",
                        help="also the longest prompt a 131072-token context holds (hours on 2 cores)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode tokens per round")
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds, the engines in turns")
    parser.add_argument("--chunk", type=int, default=2048, help="Octavo's max_num_batched_tokens, llama.cpp's n_batch")
    parser.add_argument("--layers", type=int, help="fewer layers of the same shape (default: all 24)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="llamacpp: flash attention off (its default on CPU; n_batch at most 512); "
                             "llamacpp-fa: on (n_batch = --chunk)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-cpp-src", type=Path, default=os.environ.get("LLAMA_CPP_SRC"),
                        help="llama.cpp's source (convert_hf_to_gguf.py), to write the GGUF once")
    parser.add_argument("--sparse-top-pages", type=int_list, default=[],
                        help="comma-separated sparse_top_pages: also Octavo's decode dense vs Quest at each")
    parser.add_argument("--sparse-recent-pages", type=int, default=2)
    parser.add_argument("--decode-batch", type=int_list, default=[1],
                        help="comma-separated counts of long requests decoding together (distinct prompts of the "
                             "length, each prefilled), measured one after another in the same engines")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="the sparse measure's weights (the engine's --quantization; default bf16)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --quantization, the LM head in that format too (else bf16, the engine's default)")
    parser.add_argument("--json", type=Path)
    # Octavo's sparse measure at one length, in the child process the parent starts.
    parser.add_argument("--run-sparse", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quantize_head and args.quantization is None:
        parser.error("--quantize-head needs --quantization")
    if args.run_sparse:
        import torch

        # The in-process engine runs on this process's torch threads (threads_per_worker sets a worker
        # process's): without this a sparse run took every core whatever --threads said.
        torch.set_num_threads(args.threads)
        rows = run_octavo_sparse(args.model, args.length, sparse_run(args))
        print(RESULT + json.dumps(rows), flush=True)
        return

    engines = [e for e in args.engines.split(",") if e]
    # The longest prompt whose new tokens still fit the context.
    lengths = args.lengths + [MAX_MODEL_LEN - _budget(args)] * args.with_128k
    peers = [e for e in engines if e.startswith("llamacpp")]
    args.model = long_context_model(args.layers, args.llama_cpp_src if peers else None)
    if peers and not (args.model / "model-bf16.gguf").is_file():
        print(f"no GGUF in {args.model} (give --llama-cpp-src): Octavo alone", flush=True)
        engines = [e for e in engines if e not in peers]
    rows = [row for length in lengths for row in _at_length(args, engines, length)]
    by_run = {(r["engine"], r["tokens"]): r for r in rows}
    for length in lengths:
        # Against llama.cpp's better setting for each phase (flash attention speeds its prefill, slows its decode).
        ours = by_run.get(("octavo", length))
        peer = [r for e in ENGINES[1:] if (r := by_run.get((e, length))) and "error" not in r]
        if ours and peer and "error" not in ours:
            per_round = [o / max(r["decode_rounds"][i] for r in peer) for i, o in enumerate(ours["decode_rounds"])]
            ours["decode_vs_llamacpp"] = fmt_spread(spread(per_round))
            ours["prefill_vs_llamacpp"] = min(r["prefill_s"] for r in peer) / ours["prefill_s"]
    print_table(rows, ["engine", "tokens", "prefill_s", "decode_tok_s", "decode_range", "kv_bytes_per_token",
                       "peak_rss_loading_mib", "rss_loaded_mib", "peak_rss_mib", "decode_vs_llamacpp",
                       "prefill_vs_llamacpp", "load", "error"],
                title=f"long context, {args.model.name}, chunk {args.chunk}, decode in {args.rounds} rounds of "
                      f"{args.new_tokens} tokens, {args.threads} threads (ratios: Octavo's speed over llama.cpp's "
                      f"at the same length, with or without flash attention, whichever is faster in that phase; "
                      f"decode: median (range) of the rounds' ratios)")
    sparse = sparse_report(args, lengths) if args.sparse_top_pages else []
    write_json(args.json, {"benchmark": "long_context", "args": vars(args), "results": rows, "sparse": sparse})


if __name__ == "__main__":
    main()
