"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), in Octavo and its peers: speed and quality, one run.

    python -m benchmarks.default_model                  # ~8 min on 2 quiet cores (26 min at load 3)
    python -m benchmarks.default_model --quick          # ~1.5 min: shorter outputs, 8 requests, 2 windows
    python -m benchmarks.default_model --rounds 5 --out benchmarks/results/default_model.json

Engines, 2 threads each (``--threads``):
- octavo-q4_1: Octavo on the GGUF as stored: Q4_1 layers on its int4 kernels, bf16 activations (token_embd,
  Q8_0 in the file, is dequantized at load and is also the tied lm_head).
- octavo-bf16: Octavo on the dequantized model in bf16. The dequantized model is transformers' dequantization
  of the same GGUF, saved once as a plain folder (benchmarks/models/smollm2-135m-dequantized, float32).
- llama.cpp: llama-cpp-python on the same GGUF, plain CPU buffers (use_extra_bufts off: its repacked layouts
  die of an illegal instruction on AMX CPUs), greedy. Offline it runs two ways: one request after another
  (what its ``Llama`` API does) and batched, every request a sequence of one context (n_seq_max = requests):
  prompts prefilled together in n_batch chunks, then one llama_decode per step for all sequences, greedy
  argmax of the logits in numpy.
- transformers: the dequantized model in ``--hf-dtype`` (bf16 by default), ``generate``, static left-padded
  batches.

Speed, in turns: every engine warmed once, then ``--rounds`` rounds in each of which every engine runs once,
one after the other, so a machine that speeds up or slows down (it is shared) hits them alike. Each ratio is
taken within a round (Octavo's rate / the peer's, runs minutes apart at most) and reported as the median and
the min-max over rounds; the load average is sampled around each section.
- batch-1 decode: one prompt of ``--prompt-len`` random ordinary tokens, ``--new-tokens`` new tokens, greedy,
  ignore_eos. Decode tok/s = (N - 1) / (t(N tokens) - t(1 token)), both timed in the same round (prefill
  subtracted); the end-to-end rate N / t(N) is kept in the JSON. Every run starts from an empty cache
  (Octavo's prefix caching off, llama.cpp's ``Llama`` reset, which would otherwise reuse the prompt's KV).
- offline: ``--num-requests`` requests, prompts uniform in [64, 256] random ordinary tokens, ``--output-len``
  tokens each (ignore_eos), seed 0; output tok/s = requested tokens / wall time of the whole set. Octavo
  and llama.cpp batched run all of them; the slow peers (llama.cpp one request after another, transformers
  in one static batch) run the first ``--subset`` and are compared with Octavo on those same requests.

Quality: perplexity of the held-out English text octavo/assets/heldout_english.txt (prose of the Python
documentation, PSF licence), tokenized once, in non-overlapping windows of ``--window`` tokens (the tail
shorter than a window is left out); every window is scored from its second token on, no BOS added, the same
token ids for every engine. Octavo prefills each window in chunks of ``--ppl-chunk`` tokens, so that from the
second chunk on attention reads K/V back from the cache as decode does (a window's first chunk attends its
own fresh K/V, which would hide a quantized KV cache's error). Configurations: Octavo on the dequantized
model in float32 (the reference: the Q4_1 weights' values exactly, so the reference carries Q4_1's rounding)
and bf16; that model quantized by Octavo to int8 at load (bf16 activations); Octavo on the GGUF with bf16
and float32 activations, and with bf16 plus an int8 or fp8 KV cache; Octavo on the GGUF prefilling in chunks
of QDOT_ROWS (4) tokens, so every product takes the few-row path decode takes, with its default int8
activations (rows rounded as llama.cpp's Q8_0) and with float ones; llama.cpp on the GGUF (whose products
round the activations alike at every row count), its logits for
every token of the window (a second context on the same model, what ``logits_all`` gives) log-softmaxed
here in float32; transformers float32 on the dequantized model (a check on the reference). mean_abs_dlogp /
max_abs_dlogp: the mean / largest absolute difference of the scored tokens' log-probabilities from the
reference's.
"""
from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from benchmarks.peers.hf import HFPeer
from benchmarks.peers.llamacpp import LlamaCppPeer
from benchmarks.peers.llamacpp_batch import LlamaCppContext
from benchmarks.peers.octavo_peer import OctavoPeer
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.turns import batch1_decode, fmt_spread, in_rounds, ratios, spread
from benchmarks.workload import Workload, ordinary_token_ids

DEQUANTIZED = Path(__file__).resolve().parent / "models" / "smollm2-135m-dequantized"
HELDOUT = Path(__file__).resolve().parents[1] / "octavo" / "assets" / "heldout_english.txt"
KV_BYTES = 512 * 2**20  # each Octavo engine's KV cache: several engines live side by side in this process


# ----------------------------------------------------------------------------- models and data

def dequantized_folder(gguf: Path, folder: Path = DEQUANTIZED) -> Path:
    """transformers' dequantization of ``gguf`` saved as a plain float32 folder (once; kept afterwards)."""
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"dequantizing {gguf.name} with transformers into {folder} (once)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Loaded from a GGUF, the model still names its GGUF quantizer, which refuses to save: the weights
    # are already plain float32 tensors, so the quantizer and its config entry are dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = folder.with_name(folder.name + ".part")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)
    del model
    gc.collect()
    return folder


def heldout_text(path: Path = HELDOUT) -> str:
    """The text without its leading ``#`` lines (source and licence)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


def heldout_windows(folder: Path, window: int, max_windows: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(heldout_text(), add_special_tokens=False).ids
    n = min(len(ids) // window, max_windows) if max_windows else len(ids) // window
    return [ids[i * window:(i + 1) * window] for i in range(n)]


def offline_workload(token_ids: Sequence[int], num: int, low: int, high: int, output_len: int,
                     seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.choice(token_ids) for _ in range(rng.randint(low, high))] for _ in range(num)]
    return Workload("default-model-offline", prompts, [output_len] * num,
                    f"{num} requests, prompts uniform in [{low}, {high}] random ordinary tokens, "
                    f"{output_len} output tokens each (ignore_eos), seed {seed}")


# ----------------------------------------------------------------------------- the three parts

def octavo_greedy(llm: Any, prompts: Sequence[list[int]], n: int) -> None:
    from octavo import SamplingParams

    outs = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    if any(len(o.outputs[0].token_ids) != n for o in outs):
        raise RuntimeError("Octavo generated a different number of tokens than requested")


def octavo_logprobs(llm: Any, windows: Sequence[list[int]]) -> np.ndarray:
    from octavo import SamplingParams

    outs = llm.generate(list(windows), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return np.concatenate([np.array([e.logprob for e in o.prompt_logprobs[1:]], dtype=np.float64) for o in outs])


@torch.inference_mode()
def hf_logprobs(model: Any, windows: Sequence[list[int]]) -> np.ndarray:
    out = []
    for w in windows:
        logits = model(torch.tensor([w])).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(w[1:])[:, None])[:, 0].double().numpy())
    return np.concatenate(out)


def perplexity_rows(scores: dict[str, np.ndarray], reference: str) -> list[dict[str, Any]]:
    ref = scores[reference]
    ref_ppl = math.exp(-ref.mean())
    rows = []
    for name, lp in scores.items():
        ppl = math.exp(-lp.mean())
        rows.append({"config": name, "ppl": round(ppl, 4), "vs_reference": round(ppl / ref_ppl, 5),
                     "mean_abs_dlogp": round(float(np.abs(lp - ref).mean()), 5),
                     "max_abs_dlogp": round(float(np.abs(lp - ref).max()), 4), "tokens": len(lp)})
    return rows


# ----------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the speed runs, every engine once in each")
    parser.add_argument("--quick", action="store_true",
                        help="~1.5 min: 32 new tokens, 8 requests of 32 output tokens, 2 perplexity windows")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    parser.add_argument("--prompt-len", type=int, default=64, help="batch-1 prompt tokens")
    parser.add_argument("--new-tokens", type=int, help="batch-1 new tokens (default 128; --quick 32)")
    parser.add_argument("--num-requests", type=int, help="offline requests (default 32; --quick 8)")
    parser.add_argument("--output-len", type=int, help="offline output tokens per request (default 128; --quick 32)")
    parser.add_argument("--subset", type=int, default=8,
                        help="the slow offline peers (llama.cpp one request after another, transformers) run the "
                             "first K requests, compared with Octavo on the same K (0: all)")
    parser.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--hf-batch-size", type=int, help="transformers' static batch (default: its K requests)")
    parser.add_argument("--window", type=int, default=512, help="perplexity window, tokens")
    parser.add_argument("--ppl-chunk", type=int, default=32,
                        help="Octavo's max_num_batched_tokens while scoring: windows are prefilled in chunks of "
                             "this many tokens, so that attention reads earlier chunks' K/V back from the cache")
    parser.add_argument("--max-windows", type=int, help="perplexity windows (default all: 9; --quick 2)")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: decode,offline,perplexity")
    parser.add_argument("--out", "--json", dest="out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)
    args.num_requests = args.num_requests or (8 if args.quick else 32)
    args.output_len = args.output_len or (32 if args.quick else 128)
    args.max_windows = args.max_windows if args.max_windows is not None else (2 if args.quick else 0)
    skip = {s for s in args.skip.split(",") if s}
    torch.set_num_threads(args.threads)

    from octavo import LLM
    from octavo.assets.default_model import fetch
    from octavo.quant.qweights import QDOT_ROWS

    started = time.perf_counter()
    gguf = fetch()
    folder = dequantized_folder(gguf)
    token_ids = ordinary_token_ids(folder)
    results: dict[str, Any] = {"benchmark": "default_model", "args": vars(args), "model": gguf.name,
                               "load": {"start": load_avg()}}
    print(f"{gguf.name}; dequantized copy {folder.name}; load {load_avg()}", flush=True)

    engine_args = {"kv_cache_memory_bytes": KV_BYTES, "enable_prefix_caching": False}
    q4 = OctavoPeer(gguf, "bfloat16", **engine_args)
    bf16 = OctavoPeer(folder, "bfloat16", **engine_args)
    workload = offline_workload(token_ids, args.num_requests, 64, 256, args.output_len)
    max_len = max(workload.max_seq_len, args.prompt_len + args.new_tokens) + 16
    lc = LlamaCppPeer(gguf, n_ctx=max_len, threads=args.threads, gguf=gguf, extra_bufts=False)
    hf = HFPeer(folder, args.hf_dtype)
    hf_name = f"transformers-{'bf16' if args.hf_dtype == 'bfloat16' else 'fp32'}"
    results["load"]["after_loading"] = load_avg()

    if "decode" not in skip:
        prompt = random.Random(1).choices(token_ids, k=args.prompt_len)
        engines = {
            "octavo-q4_1": lambda p, n: octavo_greedy(q4.llm, [p], n),
            "octavo-bf16": lambda p, n: octavo_greedy(bf16.llm, [p], n),
            "llama.cpp": lambda p, n: lc.generate_each([p], n),
            hf_name: lambda p, n: hf._run_batch([p], n),
        }
        before = load_avg()
        rates = batch1_decode(engines, prompt, args.new_tokens, args.rounds)
        results["decode"] = {"rates": rates, "load": f"{before} -> {load_avg()}",
                             "ratios": ratios(rates, "decode_tok_s", ["octavo-q4_1", "octavo-bf16"],
                                              ["llama.cpp", hf_name])
                             + ratios(rates, "decode_tok_s", ["octavo-q4_1"], ["octavo-bf16"])}
        rows = [{"engine": n, "decode tok/s": fmt_spread(spread(r["decode_tok_s"]), 1),
                 "end-to-end tok/s": fmt_spread(spread(r["end_to_end_tok_s"]), 1),
                 "CPU ms/token": 1000 * statistics.median(r["cpu_s_per_token"])} for n, r in rates.items()]
        print_table(rows, ["engine", "decode tok/s", "end-to-end tok/s", "CPU ms/token"],
                    title=f"batch-1 decode, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, "
                          f"median (min-max) of {args.rounds} rounds; load {results['decode']['load']}")
        for r in results["decode"]["ratios"]:
            print(f"  {r['octavo']} / {r['peer']}: {fmt_spread(r['ratio'])}x")

    if "offline" not in skip:
        k = min(args.subset or args.num_requests, args.num_requests)
        head = workload.head(k)
        first = f" (first {k})" if k < args.num_requests else ""
        n_ctx = args.num_requests * 256 * math.ceil(workload.max_seq_len / 256)  # a multiple of n_seq_max
        lc_batch = LlamaCppContext(lc.llm, n_ctx=n_ctx, n_batch=2048, n_seq=args.num_requests)
        hf_bs = args.hf_batch_size or k
        seq_name, hf_run = f"llama.cpp one request after another{first}", f"{hf_name} batch {hf_bs}{first}"
        engines = {  # name -> (run, requests it serves)
            "octavo-q4_1": (lambda: q4.generate(workload), workload),
            "octavo-bf16": (lambda: bf16.generate(workload), workload),
            "llama.cpp batched": (lambda: lc_batch.generate(workload.prompts, args.output_len), workload),
        }
        if first:
            engines[f"octavo-q4_1{first}"] = (lambda: q4.generate(head), head)
            engines[f"octavo-bf16{first}"] = (lambda: bf16.generate(head), head)
        engines[seq_name] = (lambda: lc.generate_each(head.prompts, args.output_len), head)
        engines[hf_run] = (lambda: hf.run(head, hf_bs), head)
        # Warm-up: each engine on 4 requests of 8 tokens (a whole pass would cost as much as a round).
        small = Workload("warm-up", workload.prompts[:4], [8] * 4, "warm-up")
        warmups = {
            "octavo-q4_1": lambda: q4.generate(small), "octavo-bf16": lambda: bf16.generate(small),
            "llama.cpp batched": lambda: lc_batch.generate(small.prompts, 8),
            f"octavo-q4_1{first}": lambda: None, f"octavo-bf16{first}": lambda: None,  # the same engines
            seq_name: lambda: lc.generate_each(small.prompts[:1], 8),
            hf_run: lambda: hf.run(small, hf_bs),
        }
        before = load_avg()
        times = in_rounds({name: run for name, (run, _) in engines.items()}, args.rounds, warmups)
        lc_batch.close()
        rates = {name: {"requests": len(served.prompts),
                        "output_tok_s": [served.num_output_tokens / t[0] for t in times[name]],
                        "wall_s": [t[0] for t in times[name]], "cpu_s": [t[1] for t in times[name]]}
                 for name, (_, served) in engines.items()}
        # Like with like: every peer against Octavo on the same requests.
        ratio_rows = ratios(rates, "output_tok_s", ["octavo-q4_1", "octavo-bf16"], ["llama.cpp batched"])
        ratio_rows += ratios(rates, "output_tok_s", [f"octavo-q4_1{first}", f"octavo-bf16{first}"],
                             [seq_name, hf_run])
        results["offline"] = {"workload": workload.summary(), "subset": k, "rates": rates, "ratios": ratio_rows,
                              "load": f"{before} -> {load_avg()}"}
        rows = [{"engine": n, "requests": r["requests"], "output tok/s": fmt_spread(spread(r["output_tok_s"]), 1),
                 "wall s": statistics.median(r["wall_s"])} for n, r in rates.items()]
        print_table(rows, ["engine", "requests", "output tok/s", "wall s"],
                    title=f"offline, {workload.description}; median (min-max) of {args.rounds} rounds; "
                          f"load {results['offline']['load']}")
        for r in ratio_rows:
            print(f"  {r['octavo']} / {r['peer']}: {fmt_spread(r['ratio'])}x")

    q4.llm.shutdown()
    bf16.llm.shutdown()
    del hf, bf16, q4
    gc.collect()
    if "perplexity" not in skip:
        windows = heldout_windows(folder, args.window, args.max_windows)
        before = load_avg()
        scores: dict[str, np.ndarray] = {}
        timings: dict[str, float] = {}

        def score(name: str, fn: Callable[[], np.ndarray]) -> None:
            start = time.perf_counter()
            scores[name] = fn()
            timings[name] = time.perf_counter() - start
            print(f"  {name}: ppl {math.exp(-scores[name].mean()):.4f} ({timings[name]:.0f} s)", flush=True)

        def octavo_config(model: Path, dtype: str, chunk: int = args.ppl_chunk, **extra: Any
                          ) -> Callable[[], np.ndarray]:
            def run() -> np.ndarray:
                llm = LLM(str(model), dtype=dtype, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=chunk,
                          **extra)
                try:
                    return octavo_logprobs(llm, windows)
                finally:
                    llm.shutdown()
                    del llm
                    gc.collect()
            return run

        reference = "octavo dequantized fp32 (reference)"
        score(reference, octavo_config(folder, "float32"))
        score("octavo dequantized bf16", octavo_config(folder, "bfloat16"))
        score("octavo dequantized + int8 weights (bf16)", octavo_config(folder, "bfloat16", quantization="int8"))
        score("octavo q4_1 fp32", octavo_config(gguf, "float32"))
        score("octavo q4_1 bf16", octavo_config(gguf, "bfloat16"))
        score("octavo q4_1 bf16 + int8 KV", octavo_config(gguf, "bfloat16", kv_cache_dtype="int8"))
        score("octavo q4_1 bf16 + fp8 KV", octavo_config(gguf, "bfloat16", kv_cache_dtype="fp8"))
        for dtype in ("float32", "bfloat16"):
            for rows in ("int8", "float"):
                score(f"octavo q4_1 {dtype.replace('bfloat16', 'bf16').replace('float32', 'fp32')}, {rows} "
                      f"activations at {QDOT_ROWS} rows", octavo_config(gguf, dtype, QDOT_ROWS, quantized_activations=rows))
        ppl_ctx = LlamaCppContext(lc.llm, n_ctx=args.window, n_batch=args.window, n_seq=1)
        score("llama.cpp q4_1", lambda: np.concatenate([ppl_ctx.token_logprobs(w) for w in windows]).astype(np.float64))
        ppl_ctx.close()

        def hf_fp32() -> np.ndarray:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            return hf_logprobs(model, windows)

        score("transformers dequantized fp32", hf_fp32)
        rows = perplexity_rows(scores, reference)
        for r in rows:
            r["seconds"] = timings[r["config"]]
        results["perplexity"] = {"windows": len(windows), "window": args.window,
                                 "scored_tokens": len(scores[reference]), "rows": rows,
                                 "load": f"{before} -> {load_avg()}"}
        print_table([{**r, "ppl": f"{r['ppl']:.3f}", "vs_reference": f"{r['vs_reference']:.4f}",
                      "mean_abs_dlogp": f"{r['mean_abs_dlogp']:.4f}", "max_abs_dlogp": f"{r['max_abs_dlogp']:.3f}"}
                     for r in rows],
                    ["config", "ppl", "vs_reference", "mean_abs_dlogp", "max_abs_dlogp", "tokens", "seconds"],
                    title=f"perplexity, {HELDOUT.name}: {len(windows)} non-overlapping windows of {args.window} "
                          f"tokens; load {results['perplexity']['load']}")

    lc.llm.close()
    results["load"]["end"] = load_avg()
    results["total_s"] = time.perf_counter() - started
    print(f"total {results['total_s']:.0f} s; load {results['load']['start']} -> {results['load']['end']}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
