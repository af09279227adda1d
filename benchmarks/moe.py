"""Mixtures of experts on CPU: Octavo (bf16 and int4 on the fly) against transformers and, when its
source is given, llama.cpp (bf16 and Q4_0), on random checkpoints of four real shapes with their
layers trimmed (and Mixtral's widths halved) to fit the machine.

    python -m benchmarks.moe                                    # every shape (load 18-22: ~15 min a shape)
    python -m benchmarks.moe --shapes qwen3-30b-a3b --llamacpp-src $LLAMA_CPP_SRC --json out.json
    python -m benchmarks.moe --shapes qwen3-30b-a3b mixtral-8x7b --shrink 8 --group-size 32 \
        --decode-tokens 8 --num-prompts 4 --output-len 8 --repeats 1                    # a smoke run

Shapes (vocabulary 32000 for all): Qwen3-30B-A3B's layers (hidden 2048, 128 experts of 768, top-8,
32 query / 4 KV heads; 1 layer of 48), Mixtral-8x7B's (hidden 4096, 8 experts of 14336, top-2, 32 / 8
heads; 1 layer of 32, widths and heads halved) and DeepSeek-V2-Lite's (hidden 2048, 64 experts of
1408, top-6, two shared experts, multi-head latent attention with a 512 + 64 latent over 16 heads;
2 layers of 27, the first dense as in the real model) and DeepSeek-V3's (256 experts in 8 groups, top-8
within the best 4 groups by sigmoid scores with a correction bias, one shared expert, latent attention
with a query LoRA; widths and its 128 heads divided by 4, its first dense layer and one expert layer).
``--layers`` and ``--shrink N`` (widths and
head counts divided by N) override them. Every peer of a shape (each Octavo configuration, transformers,
each llama.cpp file) is loaded at once, each in a process of its own with ``--threads`` threads
(benchmarks/peer_process.py: peers sharing one process cost each other up to 2x at batch 1), and timed in
interleaved rounds, one peer running at a time (benchmarks/turns.py: a warm-up, then ``--repeats`` rounds, every
peer once per round; ratios per round, median (min-max)), so a machine drifting in speed hits them alike:

- batch-1 decode tokens/s, the prefill subtracted ((N - 1) / (t(N tokens) - t(1 token)), both in the
  same round), and its fraction of the read-rate limit: read bandwidth (a sum over a 1 GiB buffer)
  over the bytes one token must read, counting only the active experts (``top_k / num_experts`` of
  each layer's expert bytes as the kernels hold them), plus attention, router, shared experts, dense
  layers and output layer whole (K/V of a short context left out);
- offline output tokens/s with ``--num-prompts`` requests in flight at once: Octavo's continuous
  batching, transformers' one static batch, llama.cpp batched (one sequence per request in one
  context, benchmarks/peers/llamacpp_batch.py);
- for latent attention (DeepSeek), the KV cache bytes per token Octavo keeps against the same model
  with full K and V per head (``num_heads`` x (key + value head dims), every head its own KV head).

``--skip-offline`` times batch-1 decode alone; ``--int4-head`` adds like with like for the output layer:
Octavo's int4 with the output layer in int4 too (``lm_head_quantization`` int4) against llama.cpp's
file of every matrix in Q4_0 (``--pure``); ``--eager`` adds Octavo bf16 without kernel tapes.

``--layer`` times one expert layer of each shape instead (``--layer-tokens`` tokens, random routes,
bf16 and int4): one call per expert against the grouped calls (quant/moe.py), CPU and wall ms per
forward, in turns.

llama.cpp needs ``benchmarks/setup_peers.sh`` (its source for the GGUF converter, and llama-cpp-python)
and runs the Qwen3, Mixtral and DeepSeek-V3 shapes (it loads a DeepSeek-V2-Lite only at 27 layers);
its Q4_0 files (llama.cpp's quantizer: the output layer in its default Q6_K, and in bf16 as Octavo's int4
keeps its own, the output layer being most of a trimmed shape's bytes) run without repacking
(``use_extra_bufts`` off: the repacked layouts crash this build); their bytes per token are counted as 4.5
bits per Q4_0 weight and 6.5625 per Q6_K one.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.process_peers import LlamaCppEngine, OctavoEngine, TransformersEngine
from benchmarks.peer_process import PeerProcess
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.roofline import bandwidth_gbs
from benchmarks.turns import batch1_decode, fmt_spread, in_rounds, ratios, self_timed_rounds, spread
from benchmarks.workload import Workload
from octavo.model.config import ExpertsConfig
from octavo.model.layers.moe import FusedMoE
from octavo.model.loader import default_dtype
from octavo.quant.base import QuantizationScheme
from octavo.quant.moe import run_routed
from octavo.quant.onthefly import OnTheFlyScheme
from octavo.quant.unquantized import UniformScheme
from tools.make_bench_models import BenchModel, convert_to_gguf, make_model

VOCAB = 32000
ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


@dataclass(frozen=True)
class Shape:
    model: BenchModel
    layers: int  # decoder layers kept by default
    shrink: int = 1  # widths and head counts divided by this by default
    no_llamacpp: str = ""  # why llama.cpp cannot run the trimmed shape ("": it can)


SHAPES = {
    "qwen3-30b-a3b": Shape(BenchModel("qwen3-30b-a3b", "Qwen3Moe", {
        "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
        "norm_topk_prob": True, "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": ROPE,
    }), layers=1),
    "mixtral-8x7b": Shape(BenchModel("mixtral-8x7b", "Mixtral", {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "intermediate_size": 14336, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_parameters": ROPE,
    }), layers=1, shrink=2),
    "deepseek-v2-lite": Shape(BenchModel("deepseek-v2-lite", "DeepseekV2", {
        "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "intermediate_size": 10944, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }), layers=2, no_llamacpp="llama.cpp tells V2-Lite from V2 by its 27 layers and otherwise requires the query "
                              "LoRA rank V2-Lite has not: a trimmed V2-Lite does not load"),
    # DeepSeek-V3's attention (128 heads, query LoRA) and routing (256 experts in 8 groups, sigmoid scores with a
    # correction bias), widths and heads divided by 4; its first dense layer and one expert layer.
    "deepseek-v3": Shape(BenchModel("deepseek-v3", "DeepseekV3", {
        "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "intermediate_size": 18432, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }), layers=2, shrink=4),
}
_WIDTHS = ("hidden_size", "moe_intermediate_size", "intermediate_size", "num_attention_heads")
Q4_0_BITS = 4.5  # 32 four-bit weights and one fp16 scale per block
Q6_K_BITS = 6.5625  # 256 six-bit weights, 16 eight-bit scales and one fp16 scale per block
# (ours, peer) pairs whose ratios are reported, and the targets they are held to. Octavo's int4 by default makes its
# output layer int8: against llama.cpp's Q4_0 (its output layer Q6_K, its default: 0.82x int8's bytes); int4 with a
# bf16 output layer against Q4_0 with a bf16 output layer (the same bytes; unrepacked as every Q4_0 file here, read
# about as fast per byte as the repacked bf16 file: A21); and the int8 output layer against the bf16 one.
# int4+head (--int4-head): every matrix int4, the output layer too, against llama.cpp's file of every matrix Q4_0.
PAIRS = (("octavo bf16", "llama.cpp bf16"), ("octavo int4", "llama.cpp Q4_0"),
         ("octavo int4 bf16-head", "llama.cpp Q4_0 bf16-head"), ("octavo int4", "octavo int4 bf16-head"),
         ("octavo int4+head", "llama.cpp Q4_0 pure"), ("octavo bf16", "transformers bf16"),
         ("octavo bf16", "octavo bf16 eager"))
TARGETS = {("batch-1", "llama.cpp"): 1.2, ("offline", "llama.cpp"): 3.0, ("offline", "transformers"): 10.0}
READ_LIMIT_TARGET = 0.8
MLA_TARGET = 0.90  # the latent cache at least this much smaller than full K/V
READ_BUFFER = 2**30  # larger than L3: the experts a token picks are rarely cached
ROW_COLUMNS = ["shape", "peer", "batch-1 tok/s", "MiB/token", "of read limit", "offline out tok/s"]
CHECK_COLUMNS = ["shape", "measure", "value", "target", "met"]


def trimmed(shape: Shape, layers: Optional[int], shrink: Optional[int]) -> BenchModel:
    spec, layers, shrink = shape.model, layers or shape.layers, shrink or shape.shrink
    config = {**spec.config, "num_hidden_layers": layers}
    for key in _WIDTHS:
        if key in config:
            config[key] //= shrink
    latent = "kv_lora_rank" in config  # every head its own KV head
    config["num_key_value_heads"] = config["num_attention_heads"] if latent else \
        max(1, config["num_key_value_heads"] // shrink)
    if "head_dim" not in config:  # Mixtral's heads keep their width as hidden and heads shrink together
        config["head_dim"] = spec.config["hidden_size"] // spec.config["num_attention_heads"]
    name = f"{spec.name}-{layers}l" + (f"-shrink{shrink}" if shrink > 1 else "")
    return replace(spec, name=name, config=config)


def check(shape: str, measure: str, value: float, shown: str, target: Optional[float]) -> dict[str, Any]:
    """One figure against its target (None: reported without one)."""
    met = "" if target is None else "yes" if value >= target else "MISSED"
    return {"shape": shape, "measure": measure, "value": shown, "target": "" if target is None else f">= {target}",
            "met": met}


def start_peers(spec: BenchModel, args: argparse.Namespace, folder: Path, offline: Workload, no_llamacpp: str,
                peers: dict[str, PeerProcess]) -> dict[str, float]:
    """Every peer of one shape, each loaded in a process of its own, into ``peers`` (filled as they start, so
    that the caller ends them whatever fails): the bytes a batch-1 token reads, per peer."""
    from benchmarks.peers.llamacpp import quantized_gguf

    n_ctx = 512
    engine = dict(dtype="bfloat16", max_model_len=n_ctx, kv_cache_memory_bytes=256 * 2**20,
                  max_num_seqs=max(args.num_prompts, 1))
    int4 = dict(quantization="int4", quantization_group_size=args.group_size)
    octavo = {"octavo bf16": engine, "octavo int4": {**int4, **engine},
              "octavo int4 bf16-head": {**int4, "lm_head_quantization": "none", **engine}}
    if args.int4_head:
        octavo["octavo int4+head"] = {**int4, "lm_head_quantization": "int4", **engine}
    if args.eager:
        octavo["octavo bf16 eager"] = {"enforce_eager": True, **engine}
    for name, options in octavo.items():
        peers[name] = PeerProcess(name, OctavoEngine, folder, options, offline, threads=args.threads)
    per_token = {name: peers[name].call("active_bytes") for name in octavo}
    bf16_bytes, head_bytes = per_token["octavo bf16"], peers["octavo bf16"].call("head_bytes")
    peers["transformers bf16"] = PeerProcess("transformers bf16", TransformersEngine, folder, offline,
                                             threads=args.threads)
    per_token["transformers bf16"] = bf16_bytes
    if no_llamacpp and args.llamacpp_src is not None:
        print(f"{spec.name}: no llama.cpp rows: {no_llamacpp}")
    if args.llamacpp_src is not None and not no_llamacpp:
        gguf = convert_to_gguf(folder, args.llamacpp_src)
        # Q4_0 as llama.cpp makes it (the output layer in Q6_K), and with the output layer in bf16 as Octavo's
        # int4 bf16-head keeps its lm_head.
        q4_0_bytes = (bf16_bytes - head_bytes) * Q4_0_BITS / 16
        files = [("llama.cpp bf16", gguf, True, bf16_bytes),
                 ("llama.cpp Q4_0", quantized_gguf(gguf, "Q4_0", folder, args.threads), False,
                  q4_0_bytes + head_bytes * Q6_K_BITS / 16),
                 ("llama.cpp Q4_0 bf16-head", quantized_gguf(gguf, "Q4_0", folder, args.threads, output_type="BF16"),
                  False, q4_0_bytes + head_bytes)]
        if args.int4_head:
            files.append(("llama.cpp Q4_0 pure", quantized_gguf(gguf, "Q4_0", folder, args.threads, pure=True), False,
                          bf16_bytes * Q4_0_BITS / 16))
        for name, path, extra_bufts, read_bytes in files:
            peers[name] = PeerProcess(name, LlamaCppEngine, folder, path, n_ctx, args.threads, extra_bufts,
                                      None if args.skip_offline else offline, threads=args.threads)
            per_token[name] = read_bytes
    return per_token


def bench_shape(spec: BenchModel, args: argparse.Namespace, root: Path, read_gbs: float,
                no_llamacpp: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Every peer of one shape loaded at once, each in a process of its own, timed in turns (one peer running at
    a time): (rows per peer, ratio rows, raw rates)."""
    folder = make_model(spec, root)
    rng = random.Random(0)
    decode_prompt = [rng.randrange(VOCAB - 8) for _ in range(32)]
    offline = Workload("offline", [[rng.randrange(VOCAB - 8) for _ in range(64)] for _ in range(args.num_prompts)],
                       [args.output_len] * args.num_prompts, "offline")
    peers: dict[str, PeerProcess] = {}
    try:
        per_token = start_peers(spec, args, folder, offline, no_llamacpp, peers)
        memory = {name: peer.memory() for name, peer in peers.items()}
        decode = {name: lambda p, n, peer=peer: peer.timed("decode", p, n) for name, peer in peers.items()}
        b1 = batch1_decode(decode, decode_prompt, args.decode_tokens, args.repeats, self_timed=True)
        offline_times = {} if args.skip_offline else self_timed_rounds(
            {name: lambda peer=peer: peer.timed("offline") for name, peer in peers.items()}, args.repeats)
        kv = peers["octavo bf16"].call("latent_kv", spec.config)
        for name in list(peers):
            peers.pop(name).close()
    finally:
        for peer in peers.values():
            peer.kill()
    # Loading is one peer at a time: the most held at once is the others loaded and one peer at its loading peak.
    loaded = sum(m["rss_mib"] for m in memory.values())
    peak = max(loaded - m["rss_mib"] + m["peak_rss_mib"] for m in memory.values())
    llamacpp = any(name.startswith("llama.cpp") for name in memory)
    mapped = " (llama.cpp's processes count their mapped files)" if llamacpp else ""
    print(f"{spec.name}: {len(memory)} peer processes, resident once loaded {loaded / 1024:.1f} GiB summed, "
          f"at most {peak / 1024:.1f} GiB while loading{mapped}")
    rates = {name: {"batch-1": b1[name]["decode_tok_s"],
                    "offline": [offline.num_output_tokens / wall for wall, _ in offline_times.get(name, [])]}
             for name in decode}
    rows = []
    for name in decode:
        median = statistics.median(rates[name]["batch-1"])
        rows.append({"shape": spec.name, "peer": name, "batch-1 tok/s": fmt_spread(spread(rates[name]["batch-1"]), 1),
                     "MiB/token": per_token[name] / 2**20,
                     "of read limit": median * per_token[name] / (read_gbs * 1e9),
                     "offline out tok/s": fmt_spread(spread(rates[name]["offline"]), 1) if offline_times else ""})
    checks = []
    for ours, peer in PAIRS:
        for measure in ("batch-1",) if args.skip_offline else ("batch-1", "offline"):
            if ours in rates and peer in rates:
                (r,) = ratios(rates, measure, [ours], [peer])
                checks.append(check(spec.name, f"{measure} {ours} / {peer}", r["ratio"]["median"],
                                    fmt_spread(r["ratio"]), TARGETS.get((measure, peer.split()[0]))))
    for row in rows:
        if row["peer"].startswith("octavo"):
            checks.append(check(spec.name, f"batch-1 {row['peer']} of the active-bytes read limit",
                                row["of read limit"], f"{row['of read limit']:.2f}", READ_LIMIT_TARGET))
    if kv is not None:
        checks.append(check(spec.name, f"MLA KV bytes/token {kv['latent_bytes_per_token']} against full K/V "
                            f"{kv['full_kv_bytes_per_token']}: smaller by", kv["smaller_by"],
                            f"{kv['smaller_by']:.3f}", MLA_TARGET))
    return rows, checks, {"rates": rates, "latent_kv": kv}


def expert_count(config: dict[str, Any]) -> int:
    return next(config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config)


def expert_layer(config: dict[str, Any], scheme: QuantizationScheme) -> FusedMoE:
    """One random bf16 expert layer of a checkpoint config's shape, its experts as ``scheme`` makes them."""
    experts = ExpertsConfig(num_experts=expert_count(config), top_k=config["num_experts_per_tok"], renormalize=True,
                            intermediate_size=config.get("moe_intermediate_size", config["intermediate_size"]))
    names = ("gate_proj", "up_proj", "down_proj")
    with default_dtype(torch.bfloat16):
        layer = FusedMoE(experts, config["hidden_size"], "silu", names,
                         scheme.moe_method("experts", names, experts.num_experts))
    gen = torch.Generator().manual_seed(0)
    for param in (layer.w13_weight, layer.w2_weight):
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    layer.finish_loading()
    return layer


def layer_rows(spec: BenchModel, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One expert layer at ``--layer-tokens`` tokens: one call per expert against the grouped calls, bf16 and
    int4, each run ``--layer-forwards`` forwards over rotating random routes, timed in turns."""
    config = spec.config
    count, top_k, tokens = expert_count(config), config["num_experts_per_tok"], args.layer_tokens
    gen = torch.Generator().manual_seed(1)
    routes = [torch.stack([torch.randperm(count, generator=gen)[:top_k] for _ in range(tokens)]) for _ in range(64)]
    x = torch.randn(tokens, config["hidden_size"], generator=gen).to(torch.bfloat16)
    weights = torch.full((tokens, top_k), 1.0 / top_k)
    runs: dict[str, Callable[[], object]] = {}
    for label, scheme in (("bf16", UniformScheme()), ("int4", OnTheFlyScheme("int4", args.group_size, ()))):
        layer = expert_layer(config, scheme)
        products = layer.method.products(layer)

        def each(layer: FusedMoE = layer, products: Any = products) -> None:
            for ids in routes[:args.layer_forwards]:
                run_routed(layer, x, weights, ids, *products)

        def grouped(layer: FusedMoE = layer) -> None:
            for ids in routes[:args.layer_forwards]:
                layer(x, weights, ids)

        runs[f"{label} one call per expert"], runs[f"{label} grouped"] = each, grouped
    times = in_rounds(runs, args.repeats)
    rows = []
    for name, t in times.items():
        label = name.split()[0]
        rows.append({"shape": spec.name, "tokens": tokens, "experts": name,
                     "cpu ms": fmt_spread(spread([c / args.layer_forwards * 1e3 for _, c in t])),
                     "wall ms": fmt_spread(spread([w / args.layer_forwards * 1e3 for w, _ in t])),
                     "vs one call per expert": fmt_spread(spread(
                         [a[1] / b[1] for a, b in zip(times[f"{label} one call per expert"], t)]))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers kept (default: per shape, 1-2)")
    parser.add_argument("--shrink", type=int, default=None,
                        help="divide widths and head counts by this (default: per shape, Mixtral 2)")
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128),
                        help="int4 group size (64 divides every shape's in-features; DeepSeek's dense 10944 not 128)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32, help="offline: requests in flight, 64 tokens in")
    parser.add_argument("--output-len", type=int, default=32, help="offline: tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every peer in turns")
    parser.add_argument("--skip-offline", action="store_true", help="batch-1 decode only (no offline rows)")
    parser.add_argument("--eager", action="store_true",
                        help="also Octavo bf16 without recorded decode steps (--enforce-eager): what kernel tapes gain")
    parser.add_argument("--int4-head", action="store_true",
                        help="also int4 with the output layer quantized, against llama.cpp's pure Q4_0 file")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch and llama.cpp threads")
    parser.add_argument("--llamacpp-src", type=Path, default=None,
                        help="llama.cpp source (benchmarks/setup_peers.sh's LLAMA_CPP_SRC): adds llama.cpp rows")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where the random checkpoints are written and kept (default: a temporary folder)")
    parser.add_argument("--layer", action="store_true", help="time one expert layer per shape instead (no peers)")
    parser.add_argument("--layer-tokens", type=int, default=1, help="--layer: tokens per forward")
    parser.add_argument("--layer-forwards", type=int, default=32, help="--layer: forwards per timed run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.layer:
        load_start = load_avg()
        specs = [trimmed(SHAPES[name], args.layers, args.shrink) for name in args.shapes]
        rows = [row for spec in specs for row in layer_rows(spec, args)]
        print_table(rows, ["shape", "tokens", "experts", "cpu ms", "wall ms", "vs one call per expert"],
                    f"one expert layer per forward; median (min-max) of {args.repeats} rounds; ratio of CPU times")
        print(f"load {load_start} -> {load_avg()}")
        write_json(args.json, {"benchmark": "moe --layer", "args": {k: str(v) for k, v in vars(args).items()},
                               "rows": rows})
        return
    load_start = load_avg()
    read_gbs = bandwidth_gbs(READ_BUFFER, 5)["sum_read_gbs"]
    root = args.models_dir or Path(tempfile.mkdtemp(prefix="octavo-moe-"))
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    try:
        for name in args.shapes:
            spec = trimmed(SHAPES[name], args.layers, args.shrink)
            shape_rows, shape_checks, raw[spec.name] = bench_shape(spec, args, root, read_gbs,
                                                                   SHAPES[name].no_llamacpp)
            rows += shape_rows
            checks += shape_checks
            # Each shape's figures as soon as they are measured: a long run on a shared machine may be cut short.
            print_table(shape_rows, ROW_COLUMNS, f"{spec.name}, load {load_avg()}")
            print_table(shape_checks, CHECK_COLUMNS)
    finally:
        if args.models_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(rows, ROW_COLUMNS, f"read bandwidth {read_gbs:.1f} GB/s over {READ_BUFFER // 2**20} MiB; "
                f"median (min-max) of {args.repeats} rounds")
    print_table(checks, CHECK_COLUMNS, "targets (ratios per round, median (min-max))")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "moe", "args": {k: str(v) for k, v in vars(args).items()},
                           "read_gbs": read_gbs, "rows": rows, "targets": checks, "rounds": raw})


if __name__ == "__main__":
    main()
