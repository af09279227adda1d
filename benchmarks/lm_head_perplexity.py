"""What the LM head's format costs under int4: perplexity of real text with the head in bf16, int8 and int4.

    python -m benchmarks.lm_head_perplexity --models smollm2-135m --max-windows 3 --chunk 128   # 42 min at load 6-17
    python -m benchmarks.lm_head_perplexity --models octavo-mini --group-size 128                # 2.4 min at load 5-6

Models: the default model, SmolLM2-135M-Instruct, as transformers dequantizes its Q4_1 GGUF (a plain float32
folder, benchmarks/models/smollm2-135m-dequantized, made once: benchmarks/default_model.py), and the shipped
octavo-mini. Text: octavo/assets/heldout_english.txt in non-overlapping windows of ``--window`` tokens, scored
from each window's second token (benchmarks/default_model.py's windows and scoring). Configurations, all bf16:
the unquantized model, then the linear layers quantized to int4 on the fly (groups of ``--group-size``) with the
LM head in bf16 (``--lm-head-quantization none``), int8 (per output channel) and int4. Each quantized one twice:
prefilled in chunks of ``--chunk`` tokens (products of many rows: activations in bf16) and in chunks of
QDOT_ROWS tokens, so that every product takes the path decode takes (activations rounded to int8 per block of
32, integer dot products). vs_bf16: perplexity over the unquantized bf16 model's; vs_bf16_head: over the same
path with a bf16 head (what the head's own rounding costs).
"""
from __future__ import annotations

import argparse
import gc
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.default_model import KV_BYTES, dequantized_folder, heldout_windows, octavo_logprobs
from benchmarks.report import load_avg, print_table, write_json

MINI = Path(__file__).resolve().parents[1] / "octavo" / "assets" / "octavo-mini"
HEADS = ("none", "int8", "int4")


def model_folder(name: str) -> Path:
    if name == "octavo-mini":
        return MINI
    if name == "smollm2-135m":
        from octavo.assets.default_model import default_model

        gguf = default_model()
        if gguf is None:
            raise SystemExit("the default model could not be fetched (offline?): run with --models octavo-mini")
        return dequantized_folder(gguf)
    return Path(name)


def score(folder: Path, windows: list[list[int]], chunk: int, **options: Any) -> tuple[np.ndarray, float]:
    """Each scored token's log-probability, and the seconds it took."""
    from octavo import LLM

    start = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=chunk,
              enable_prefix_caching=False, **options)
    try:
        return octavo_logprobs(llm, windows), time.perf_counter() - start
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def bench_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from octavo.quant.qweights import QDOT_ROWS

    folder = model_folder(name)
    windows = heldout_windows(folder, args.window, args.max_windows)
    load = load_avg()
    base, seconds = score(folder, windows, args.chunk)
    base_ppl = math.exp(-base.mean())
    rows = [{"model": name, "config": "bf16", "ppl": round(base_ppl, 4), "vs_bf16": 1.0, "vs_bf16_head": "",
             "tokens": len(base), "seconds": round(seconds)}]
    for path, chunk in (("prefill rows", args.chunk), (f"{QDOT_ROWS}-row decode path", QDOT_ROWS)):
        head_ppl = {}
        for head in HEADS:
            lp, seconds = score(folder, windows, chunk, quantization="int4",
                                quantization_group_size=args.group_size, lm_head_quantization=head)
            head_ppl[head] = math.exp(-lp.mean())
            label = {"none": "bf16"}.get(head, head)
            rows.append({"model": name, "config": f"int4, {label} head, {path}", "ppl": round(head_ppl[head], 4),
                         "vs_bf16": round(head_ppl[head] / base_ppl, 5),
                         "vs_bf16_head": round(head_ppl[head] / head_ppl["none"], 5),
                         "tokens": len(lp), "seconds": round(seconds)})
            print(rows[-1], flush=True)
    for row in rows:
        row["load"] = f"{load} -> {load_avg()}"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,octavo-mini",
                        help="comma-separated: smollm2-135m, octavo-mini or checkpoint folders")
    parser.add_argument("--window", type=int, default=480, help="tokens a window (octavo-mini holds 512)")
    parser.add_argument("--max-windows", type=int, default=0, help="windows a model (default: all)")
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk of the many-row runs, tokens")
    parser.add_argument("--group-size", type=int, default=64,
                        help="int4 group size (SmolLM2's 576 in-features take 32 or 64, octavo-mini's 128 too)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_head_perplexity.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [row for name in args.models.split(",") for row in bench_model(name, args)]
    shown = [{**r, "ppl": f"{r['ppl']:.3f}", "vs_bf16": f"{r['vs_bf16']:.4f}",
              "vs_bf16_head": r["vs_bf16_head"] and f"{r['vs_bf16_head']:.4f}"} for r in rows]
    print_table(shown, ["model", "config", "ppl", "vs_bf16", "vs_bf16_head", "tokens", "seconds", "load"],
                title=f"perplexity of {Path('octavo/assets/heldout_english.txt')}, windows of {args.window} tokens")
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(args.out, {"rows": rows, "window": args.window, "group_size": args.group_size})


if __name__ == "__main__":
    main()
