"""Mixtures of experts on CPU: Octavo (bf16 and int4 on the fly) against transformers and, when its
source is given, llama.cpp (bf16 and Q4_0), on random checkpoints of two real shapes with their
layers trimmed to fit the machine.

    python -m benchmarks.moe                                    # both shapes, 1 layer each (~10 GiB for Mixtral)
    python -m benchmarks.moe --shapes qwen3-30b-a3b --layers 2 --llamacpp-src $LLAMA_CPP_SRC --json out.json
    python -m benchmarks.moe --shrink 8 --decode-tokens 8 --num-prompts 4 --repeats 1   # a smoke run

Shapes: Qwen3-30B-A3B's layers (hidden 2048, 128 experts of 768, top-8, 32 query / 4 KV heads) and
Mixtral-8x7B's (hidden 4096, 8 experts of 14336, top-2, 32 / 8 heads), vocabulary 32000; ``--shrink N``
divides the widths and head counts by N. Every peer is loaded at once and timed in turns
(``roofline.in_turns``), so a machine drifting in speed hits them alike:

- batch-1 decode tokens/s, the prefill subtracted (a ``--decode-tokens`` generation minus a 1-token one),
  and its fraction of the read-rate limit: read bandwidth (a sum over a buffer) over the bytes one token
  must read, counting only the active experts (``top_k / num_experts`` of each layer's expert bytes as
  the kernels hold them), plus attention, router and output layer whole (K/V of a short context left out);
- offline output tokens/s: ``--num-prompts`` prompts through each peer's offline path (Octavo's
  continuous batching; transformers' static batch; llama.cpp one sequence at a time).

llama.cpp needs ``benchmarks/setup_peers.sh`` (its source for the GGUF converter, and llama-cpp-python);
its Q4_0 bytes per token are counted as 4.5 bits per weight.
"""
from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.peers.hf import HFPeer
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.roofline import bandwidth_gbs, in_turns
from benchmarks.workload import Workload
from octavo import LLM, SamplingParams
from octavo.model.layers.moe import FusedMoE
from octavo.quant.base import LinearWeightHolder
from tools.make_bench_models import BenchModel, convert_to_gguf, make_model

VOCAB = 32000
SHAPES = {
    "qwen3-30b-a3b": BenchModel("qwen3-30b-a3b", "Qwen3Moe", {
        "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
        "norm_topk_prob": True, "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }),
    "mixtral-8x7b": BenchModel("mixtral-8x7b", "Mixtral", {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "intermediate_size": 14336, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }),
}
_WIDTHS = ("hidden_size", "moe_intermediate_size", "intermediate_size", "num_attention_heads")
Q4_0_BITS = 4.5  # 32 four-bit weights and one fp16 scale per block


def trimmed(spec: BenchModel, layers: int, shrink: int) -> BenchModel:
    config = {**spec.config, "num_hidden_layers": layers}
    for key in _WIDTHS:
        if key in config:
            config[key] //= shrink
    config["num_key_value_heads"] = max(1, config["num_key_value_heads"] // shrink)
    if "head_dim" not in config:  # Mixtral's heads keep their width as hidden and heads shrink together
        config["head_dim"] = spec.config["hidden_size"] // spec.config["num_attention_heads"]
    name = f"{spec.name}-{layers}l" + (f"-shrink{shrink}" if shrink > 1 else "")
    return replace(spec, name=name, config=config)


def active_bytes(llm: LLM) -> float:
    """Weight bytes one batch-1 token reads: every linear layer whole, each expert layer's top-k share."""
    model = llm.engine.executor.worker.runner.model
    top_k = llm.engine.executor.worker.runner.arch.experts.top_k
    total = 0.0
    for module in model.modules():
        if isinstance(module, FusedMoE):
            total += module.weight_method.weight_bytes(module) * top_k / module.num_experts
        elif isinstance(module, LinearWeightHolder):
            total += module.weight_method.weight_bytes(module)
    return total


def octavo_runs(llm: LLM) -> Callable[[Workload], Any]:
    def generate(workload: Workload) -> None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        llm.generate(workload.prompts, params, use_tqdm=False)
    return generate


def llamacpp_peers(folder: Path, src: Path, threads: int, n_ctx: int) -> dict[str, tuple[Callable, float]]:
    """llama.cpp on the bf16 GGUF and its Q4_0 quantization: generate function, bytes per weight."""
    from benchmarks.peers.llamacpp import LlamaCppPeer, quantized_gguf

    bf16 = convert_to_gguf(folder, src)
    q4 = quantized_gguf(bf16, "Q4_0", folder, threads)
    return {f"llama.cpp {name}": (LlamaCppPeer(folder, n_ctx, threads, gguf=path).generate, per_weight)
            for name, path, per_weight in (("bf16", bf16, 2.0), ("Q4_0", q4, Q4_0_BITS / 8))}


def bench_shape(spec: BenchModel, args: argparse.Namespace, root: Path, read_gbs: float) -> list[dict[str, Any]]:
    folder = make_model(spec, root)
    rng = random.Random(0)
    decode_prompt = [[rng.randrange(VOCAB - 8) for _ in range(32)]]
    full = Workload("decode", decode_prompt, [args.decode_tokens], "batch-1 decode")
    first = replace(full, output_lens=[1])
    offline = Workload("offline", [[rng.randrange(VOCAB - 8) for _ in range(64)] for _ in range(args.num_prompts)],
                       [args.output_len] * args.num_prompts, "offline")
    engine = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=256 * 2**20)
    bf16 = LLM(str(folder), **engine)
    int4 = LLM(str(folder), quantization="int4", quantization_group_size=args.group_size, **engine)
    bf16_bytes = active_bytes(bf16)
    # Each peer: its generate function and the bytes a token reads.
    peers: dict[str, tuple[Callable[[Workload], Any], float]] = {
        "octavo bf16": (octavo_runs(bf16), bf16_bytes),
        "octavo int4": (octavo_runs(int4), active_bytes(int4)),
    }
    hf = HFPeer(folder, "bfloat16")
    peers["transformers bf16"] = (lambda w: hf._run_batch(w.prompts, max(w.output_lens)), bf16_bytes)
    if args.llamacpp_src is not None:
        for name, (generate, per_weight) in llamacpp_peers(folder, args.llamacpp_src, args.threads, 512).items():
            peers[name] = (generate, bf16_bytes * per_weight / 2.0)
    runs: dict[str, Callable[[], Any]] = {}
    for name, (generate, _) in peers.items():
        for label, workload in (("full", full), ("first", first), ("offline", offline)):
            runs[f"{name}|{label}"] = lambda g=generate, w=workload: g(w)
    times = in_turns(runs, args.repeats)
    rows = []
    for name, (_, nbytes) in peers.items():
        decode = (args.decode_tokens - 1) / (times[f"{name}|full"] - times[f"{name}|first"])
        rows.append({"shape": spec.name, "peer": name, "batch-1 tok/s": decode,
                     "MiB/token": nbytes / 2**20, "of read limit": decode * nbytes / (read_gbs * 1e9),
                     "offline out tok/s": offline.num_output_tokens / times[f"{name}|offline"]})
    for llm in (bf16, int4):
        llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=1, help="decoder layers kept (the real models: 48 and 32)")
    parser.add_argument("--shrink", type=int, default=1, help="divide widths and head counts by this (smoke runs)")
    parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128), help="int4 group size")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=16, help="offline: prompts of 64 tokens")
    parser.add_argument("--output-len", type=int, default=32, help="offline: tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed turns (median)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama.cpp threads")
    parser.add_argument("--llamacpp-src", type=Path, default=None,
                        help="llama.cpp source (benchmarks/setup_peers.sh's LLAMA_CPP_SRC): adds llama.cpp rows")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where the random checkpoints are written and kept (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    read_gbs = bandwidth_gbs(512 * 2**20, 5)["sum_read_gbs"]
    root = args.models_dir or Path(tempfile.mkdtemp(prefix="octavo-moe-"))
    rows: list[dict[str, Any]] = []
    try:
        for shape in args.shapes:
            rows += bench_shape(trimmed(SHAPES[shape], args.layers, args.shrink), args, root, read_gbs)
    finally:
        if args.models_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(rows, ["shape", "peer", "batch-1 tok/s", "MiB/token", "of read limit", "offline out tok/s"],
                f"read bandwidth {read_gbs:.1f} GB/s; load {load_avg()}")
    write_json(args.json, {"read_gbs": read_gbs, "rows": rows})


if __name__ == "__main__":
    main()
