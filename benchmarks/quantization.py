"""Quantized weights: Octavo bf16 vs int8 vs int4 vs w8a8, and llama.cpp Q8_0 / Q4_0
of the same checkpoints, in one run.

    python -m benchmarks.quantization --models benchmarks/models/llama-100m,benchmarks/models/qwen2.5-0.5b
    python -m benchmarks.quantization --kernels-only     # the per-layer kernel table alone

Per model and weight format:
- batch-1 decode tokens/s (prefill subtracted: roofline.decode_rate) and its
  fraction of the bandwidth limit: the bytes a step actually reads (every
  matrix once in its stored form, scales and zero points included; the tied
  embedding read whole as the lm_head; plus the K/V) per second, over one
  read rate for every format of the run (``read_GBs``: sums over a buffer
  the size of the most bytes any format reads a token, three before and
  three after the batch-1 rounds; the median, and its spread);
- offline throughput: a ShareGPT-like workload through ``LLM.generate``
  (Octavo: continuous batching) and llama.cpp batched (one sequence per
  request in one context, benchmarks/peers/llamacpp_batch.py);
- every format and file loaded at once, each in a process of its own
  (benchmarks/peer_process.py), and timed in turns (benchmarks/turns.py):
  ratios within each round, median (min-max);
  llama.cpp files: Q8_0, Q4_0 (llama.cpp keeps the output layer in Q6_K)
  and Q4_0 pure (every matrix Q4_0), each paired with the Octavo format
  that treats its lm_head the same way (PAIRS);
- ``--kernels``: one decoder layer's four products at ``--kernel-rows``
  rows: bf16 (the unquantized method: oneDNN prepack, the AMX kernel or
  Octavo's bf16 kernels), Octavo's int8/int4 kernels (at up to 4 rows the
  rows rounded to int8 per block of 32, qdot_linear.c; "float rows": the
  same weights with --quantized-activations float, W8A16/W4A16), W8A8
  (rows rounded to int8 per token, w8a8_linear.c: VNNI where the CPU has
  it), torch's own CPU ops (``_weight_int8pack_mm``,
  ``_weight_int4pack_mm_for_cpu``) and torch float32 (``F.linear`` on a
  float32 weight, the rows' conversion included). W8A8 against the others
  on CPUs without AMX:

    OCTAVO_CPU_TARGET=avx512_bf16 python -m benchmarks.quantization --kernels-only \
        --models benchmarks/models/llama-100m --kernel-rows 1,4,32,256
- ``--read-rate`` (alone): every matrix of one forward, quantized (int8 per
  output channel, int4 in groups of ``--group-size``), through the FMA path
  of quant_linear.c built for each of ``--targets`` (default: the process's
  CPU target), at ``--rows``, next to dequantize + F.linear (what CPUs
  without the kernel ran) and a sum over as many bytes as the kernel reads
  (integers, scales, mins): the weight read rate few-row decode gets.

    python -m benchmarks.quantization --read-rate --models benchmarks/models/llama-100m \
        --targets avx512_bf16,avx512,avx2,portable --threads 1

llama.cpp's files: ``model-bf16.gguf`` beside each checkpoint (or in
``--gguf-dir``; tools/make_bench_models.py --gguf writes it), quantized by
llama.cpp's own quantizer (``llama_model_quantize``, what ``llama-quantize``
runs) on first use. Bytes read per llama.cpp token: the GGUF's size (both
models tie the embedding, which serves as the output layer).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.peer_process import PeerProcess
from benchmarks.report import load_avg, machine_info, print_table, write_json
from benchmarks.roofline import bandwidth_gbs
from benchmarks.turns import batch1_decode, fmt_spread, ratios, self_timed_rounds, spread
from benchmarks.workload import SHAREGPT_INPUT, SHAREGPT_OUTPUT, Workload, ordinary_token_ids, sharegpt_like

MIB = 2**20
# (label, --quantization, --lm-head-quantization): Octavo's int8 and int4 make
# the lm_head int8 by default, its w8a8 keeps it bf16; llama.cpp's Q8_0/Q4_0
# pure quantize the tied embedding that serves as its output layer, so the
# "+head" row reads what Q4_0 pure reads.
FORMATS = (("bf16", None, "none"), ("int8", "int8", "int8"), ("int4", "int4", "int8"),
           ("int8 bf16-head", "int8", "none"), ("int4 bf16-head", "int4", "none"), ("w8a8", "w8a8", "none"),
           ("int4+head", "int4", "int4"))
# The same weights with --quantized-activations float (W8A16/W4A16 at every row count): what the default int8
# activations at decode gain over.
FLOAT_ROWS = ("int8", "int4+head")
ROWS = (1, 4, 16, 64, 256)


@dataclasses.dataclass
class Shape:
    """What a decode step multiplies, from config.json."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: Path) -> Shape:
        c = json.loads((model / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"],
                   c["num_attention_heads"], c["num_key_value_heads"], head_dim)

    def layer_products(self) -> list[tuple[str, int, int]]:
        """(name, out features N, in features K) of one decoder layer."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return [("qkv", qkv, self.hidden), ("o", self.hidden, self.heads * self.head_dim),
                ("gate_up", 2 * self.intermediate, self.hidden), ("down", self.hidden, self.intermediate)]

    def bytes_per_token(self, quant: Optional[str], head: str, group: int, context: int) -> float:
        """Octavo's read per batch-1 step: the matrices as stored (int8: a
        float32 scale per row; w8a8: and an int32 sum of q per row; int4: a
        float32 scale and min per group), the lm_head in ``head`` (int8,
        int4, none: bf16), the bf16 K/V."""
        def matrix(n: int, k: int, fmt: Optional[str]) -> float:
            if fmt == "int8":
                return n * k + 4 * n
            if fmt == "w8a8":
                return n * k + 8 * n
            if fmt == "int4":
                return n * k / 2 + 8 * n * k / group
            return 2 * n * k

        layer = sum(matrix(n, k, quant) for _, n, k in self.layer_products())
        kv = 2 * self.kv_heads * self.head_dim * context * 2
        return self.layers * (layer + kv) + matrix(self.vocab, self.hidden, None if head == "none" else head)


def _octavo(name: str, model: Path, quant: Optional[str], head: str, args: argparse.Namespace, offline: Workload,
            activations: str = "int8") -> PeerProcess:
    """One Octavo configuration in a process of its own (benchmarks/peer_process.py)."""
    from benchmarks.process_peers import OctavoEngine

    options: dict[str, Any] = {"dtype": "bfloat16", "max_num_seqs": args.max_num_seqs, "kv_cache_memory_bytes": 2**30,
                               "enable_prefix_caching": False}
    if quant is not None:
        options |= {"quantization": quant, "quantization_group_size": args.group_size,
                    "lm_head_quantization": head, "quantized_activations": activations}
    return PeerProcess(name, OctavoEngine, model, options, offline, threads=args.threads)


def _llamacpp(name: str, model: Path, ftype: str, pure: bool, args: argparse.Namespace, offline: Workload
              ) -> tuple[PeerProcess, Path]:
    """llama.cpp on ``model`` quantized to ``ftype`` in a process of its own: one sequence for batch 1, and the
    offline workload as one batch of a sequence per request."""
    from benchmarks.peers.llamacpp import gguf_path, quantized_gguf
    from benchmarks.process_peers import LlamaCppEngine

    source = (args.gguf_dir / model.name / "model-bf16.gguf") if args.gguf_dir else gguf_path(model)
    gguf = quantized_gguf(source, ftype, source.parent, args.threads, pure=pure)
    n_ctx = 256 * math.ceil((max(args.prompt_len + args.new_tokens, offline.max_seq_len) + 16) / 256)
    # The repacked layouts (use_extra_bufts) crash in decode with this build on
    # this machine (segfault in llama_decode, Q8_0 and Q4_0 alike): plain buffers.
    peer = PeerProcess(name, LlamaCppEngine, model, gguf, n_ctx, args.threads, args.llamacpp_repack,
                       offline, threads=args.threads)
    return peer, gguf


# (Octavo weights, llama.cpp file). llama.cpp's Q8_0 quantizes the output layer (the tied embedding) to Q8_0, so it
# pairs with Octavo's int8, whose head is int8 by default (and with int8 bf16-head, the finer head); its default Q4_0
# keeps the output layer in Q6_K (pairs with Octavo's int4, default against default: an int8 head, 8 bits a weight to
# Q6_K's 6.6, and with int4 bf16-head, both keeping a finer head), and the "pure" Q4_0 file quantizes every matrix to
# Q4_0 (pairs with int4+head).
PAIRS = (("octavo int8", "llama.cpp Q8_0"), ("octavo int8 bf16-head", "llama.cpp Q8_0"),
         ("octavo int4", "llama.cpp Q4_0"), ("octavo int4 bf16-head", "llama.cpp Q4_0"),
         ("octavo int4+head", "llama.cpp Q4_0 pure"),
         ("octavo int8 float rows", "llama.cpp Q8_0"), ("octavo int4+head float rows", "llama.cpp Q4_0 pure"))
LLAMACPP_FILES = (("Q8_0", False), ("Q4_0", False), ("Q4_0", True))


def bench_model(model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every format of ``model`` loaded at once, each in a process of its own (benchmarks/peer_process.py:
    loaded side by side in one process, llama.cpp's runtime cost Octavo a third of its bf16 batch-1 rate on a
    2-core Zen 4 VM), then timed in turns (benchmarks/turns.py): batch-1 decode in ``--repeats`` rounds,
    offline in ``--offline-repeats`` rounds; ratios within each round."""
    shape = Shape.of(model)
    ids = ordinary_token_ids(model)
    workload = sharegpt_like(args.num_prompts, ids, seed=0,
                             inputs=dataclasses.replace(SHAREGPT_INPUT, high=args.max_input_len),
                             outputs=dataclasses.replace(SHAREGPT_OUTPUT, high=args.max_output_len))
    context = args.prompt_len + args.new_tokens // 2
    kv_bytes = shape.layers * 2 * shape.kv_heads * shape.head_dim * context * 2
    peers: dict[str, PeerProcess] = {}
    per_token: dict[str, float] = {}
    formats = [(label, quant, head, "int8") for label, quant, head in FORMATS]
    formats += [(f"{label} float rows", quant, head, "float") for label, quant, head in FORMATS if label in FLOAT_ROWS]
    try:
        for label, quant, head, activations in formats:
            name = f"octavo {label}"
            peers[name] = _octavo(name, model, quant, head, args, workload, activations)
            per_token[name] = shape.bytes_per_token(quant, head, args.group_size, context)
        if not args.no_llamacpp:
            for ftype, pure in LLAMACPP_FILES:
                name = f"llama.cpp {ftype}{' pure' if pure else ''}"
                # Offline, llama.cpp batches too: one sequence per request in one context.
                peers[name], gguf = _llamacpp(name, model, ftype, pure, args, workload)
                per_token[name] = gguf.stat().st_size + kv_bytes
        # One read rate for every format, over as many bytes as the largest reads a token, taken before and
        # after the batch-1 rounds: a rate per format, each from its own five sums, came out 25.6 GB/s for one
        # and 45.2 for the next in one run on a 2-core VM, which made their fractions incomparable.
        read_bytes = int(max(*per_token.values(), 64 * MIB))
        read_rates = _read_rates(read_bytes)
        load = load_avg()
        prompt = random.Random(1).choices(ids, k=args.prompt_len)
        decode = {name: lambda p, n, peer=peer: peer.timed("decode", p, n) for name, peer in peers.items()}
        b1 = batch1_decode(decode, prompt, args.new_tokens, args.repeats, self_timed=True)
        read_rates += _read_rates(read_bytes)
        read_gbs = statistics.median(read_rates)
        offline_times = self_timed_rounds({name: lambda peer=peer: peer.timed("offline")
                                           for name, peer in peers.items()}, args.offline_repeats)
        names = list(peers)
        for name in names:
            peers.pop(name).close()
    finally:
        for peer in peers.values():  # those left by an error
            peer.kill()
    rates = {name: {"b1": b1[name]["decode_tok_s"],
                    "offline": [workload.num_output_tokens / wall for wall, _ in offline_times[name]]}
             for name in names}
    rows = []
    for name in names:
        b1_median = statistics.median(rates[name]["b1"])
        row: dict[str, Any] = {
            "model": model.name, "weights": name, "b1_tok_s": fmt_spread(spread(rates[name]["b1"]), 1),
            "MB_per_token": per_token[name] / 1e6, "read_GBs": fmt_spread(spread(read_rates), 1),
            "read_MB": read_bytes / 1e6, "bw_fraction": b1_median * per_token[name] / (read_gbs * 1e9),
            "offline_out_tok_s": fmt_spread(spread(rates[name]["offline"]), 1),
        }
        if name != "octavo bf16":
            (r,) = ratios(rates, "b1", [name], ["octavo bf16"])
            row["b1_vs_octavo_bf16"] = fmt_spread(r["ratio"])
        peer = dict(PAIRS).get(name)
        if peer in rates:
            row["llamacpp_file"] = peer
            row["b1_vs_llamacpp"] = fmt_spread(ratios(rates, "b1", [name], [peer])[0]["ratio"])
            row["offline_vs_llamacpp"] = fmt_spread(ratios(rates, "offline", [name], [peer])[0]["ratio"])
        row["load"] = f"{load} -> {load_avg()}"
        rows.append(row)
    return rows


def _read_rates(nbytes: int, times: int = 3) -> list[float]:
    """GB/s of ``times`` full-buffer sums of ``nbytes`` (each the median of 5)."""
    return [bandwidth_gbs(nbytes, 5)["sum_read_gbs"] for _ in range(times)]


def _best_time(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    """The fastest of several short batches of calls: the least disturbed by
    the other jobs on a shared machine."""
    fn()
    best = float("inf")
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or best == float("inf"):
        start, n = time.perf_counter(), 0
        while n < 3 or time.perf_counter() - start < budget_s / 6:
            fn()
            n += 1
        best = min(best, (time.perf_counter() - start) / n)
    return best


def _layer_kernels(shape: Shape, group: int) -> dict[str, list[Callable[[torch.Tensor], object]]]:
    """One decoder layer's four products per implementation, random weights."""
    from octavo.model.layers.linear import RowParallelLinear
    from octavo.model.loader import default_dtype
    from octavo.quant.onthefly import quantize_int4, quantize_int8, quantize_w8a8
    from octavo.quant.qweights import quantized_activations
    from octavo.quant.unquantized import UnquantizedLinearMethod

    ops = torch.ops.aten
    kernels: dict[str, list[Callable[[torch.Tensor], object]]] = {
        k: [] for k in ("bf16", "int8", "int4", "int8 float rows", "int4 float rows", "w8a8", "torch int8",
                        "torch int4", "torch fp32")}
    for _, n, k in shape.layer_products():
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        method = UnquantizedLinearMethod.for_backend("auto", torch.device("cpu"), torch.bfloat16)
        with default_dtype(torch.bfloat16):
            layer = RowParallelLinear(k, n, False, method)
        layer.weight.data.copy_(w)
        layer.finish_loading()
        q8, q4 = quantize_int8(w), quantize_int4(w, group)
        ints8, scales8, _ = q8.unpack()
        ints4, scales4, mins4 = q4.unpack()
        # torch's int4 format: w = (q - 8) * scale + zero, scales and zeros [K/g, N, 2].
        zero = mins4 + 8 * scales4
        packed4 = ops._convert_weight_to_int4pack_for_cpu(ints4.to(torch.int32), 1)
        sz = torch.stack([scales4, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        s8 = scales8[:, 0].to(torch.bfloat16)
        kernels["bf16"].append(layer)
        kernels["int8"].append(q8)
        kernels["int4"].append(q4)
        with quantized_activations("float"):
            kernels["int8 float rows"].append(quantize_int8(w))
            kernels["int4 float rows"].append(quantize_int4(w, group))
        kernels["w8a8"].append(quantize_w8a8(w))
        kernels["torch fp32"].append(lambda x, w32=w.float(): torch.nn.functional.linear(x.float(), w32))
        kernels["torch int8"].append(lambda x, q=ints8.contiguous(), s=s8: ops._weight_int8pack_mm(x, q, s))
        kernels["torch int4"].append(lambda x, p=packed4, s=sz: ops._weight_int4pack_mm_for_cpu(x, p, group, s))
    return kernels


def bench_kernels(model: Path, group: int, row_counts: tuple[int, ...] = ROWS) -> list[dict[str, Any]]:
    shape = Shape.of(model)
    kernels = _layer_kernels(shape, group)
    rows = []
    for m in row_counts:
        x = {k: torch.randn(m, k, dtype=torch.bfloat16) for _, _, k in shape.layer_products()}
        xs = [x[k] for _, _, k in shape.layer_products()]
        times = {name: _best_time(lambda fns=fns: [f(a) for f, a in zip(fns, xs)]) for name, fns in kernels.items()}
        row: dict[str, Any] = {"model": model.name, "rows": m}
        for name, t in times.items():
            row[f"{name} us"] = t * 1e6
        for name in ("int8", "int4", "w8a8", "torch int8", "torch int4", "torch fp32"):
            row[f"{name} x"] = times["bf16"] / times[name]
        row["w8a8 vs int8 x"] = times["int8"] / times["w8a8"]
        for bits in ("int8", "int4"):
            row[f"{bits} vs float rows x"] = times[f"{bits} float rows"] / times[bits]
        rows.append(row)
    return rows


def bench_read_rate(model: Path, group: int, targets: list[str], rows: list[int]) -> list[dict[str, Any]]:
    from torch.nn import functional as F

    from benchmarks.linear_kernels import model_matrices
    from octavo.kernels.cpu_features import BY_NAME, cpu_target
    from octavo.kernels.quant_linear import quant_linear_kernel
    from octavo.quant.onthefly import quantize_int4, quantize_int8

    shapes = model_matrices(model)
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
    ways: dict[str, Callable[..., torch.Tensor]] = {
        "dequantize + F.linear": lambda x, q: F.linear(x, q.dequantize().to(x.dtype))}
    for target in [BY_NAME[t] for t in targets] or [cpu_target()]:
        kernel = quant_linear_kernel(target, required=True)
        ways[f"fma {kernel.isa}"] = lambda x, q, kernel=kernel: kernel(x, q.bits, q.group_size, q.packed, q.scales,
                                                                         q.mins, None, q.out_features, False)
    table = []
    for kind in ("int8", "int4"):
        qs = [quantize_int8(w) if kind == "int8" else quantize_int4(w, group) for w in weights]
        if any(q.kernel is None for q in qs):
            raise SystemExit(f"{model.name}: a matrix the kernel cannot take (out features not a multiple of 16)")
        nbytes = sum(q.nbytes for q in qs)
        sum_s = _best_time(torch.ones(nbytes // 4).sum)
        for m in rows:
            xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {k for _, k in shapes}}
            for name, way in ways.items():
                load = load_avg()
                t = _best_time(lambda way=way: [way(xs[k], q) for q, (_, k) in zip(qs, shapes)])
                table.append({"model": model.name, "weights": kind, "rows": m, "kernel": name, "ms": t * 1e3,
                              "MB": nbytes / 1e6, "GB_s": nbytes / t / 1e9, "sum_GB_s": nbytes / sum_s / 1e9,
                              "of_sum_rate": sum_s / t, "load": f"{load} -> {load_avg()}"})
                print_table(table[-1:], list(table[-1]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_models = ",".join(str(Path(__file__).resolve().parent / "models" / m) for m in
                              ("llama-100m", "qwen2.5-0.5b"))
    parser.add_argument("--models", default=default_models, help="comma-separated checkpoint folders")
    parser.add_argument("--gguf-dir", type=Path, help="folder holding <model name>/model-bf16.gguf "
                        "(default: each checkpoint's folder); the quantized GGUFs are written beside it")
    parser.add_argument("--group-size", type=int, default=128, help="Octavo int4 group size")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 rounds, every format once in each")
    parser.add_argument("--offline-repeats", type=int, default=2, help="offline rounds, every format once in each")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64, help="batch-1 decode length")
    parser.add_argument("--num-prompts", type=int, default=32, help="offline workload requests")
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--llamacpp-repack", action="store_true",
                        help="let llama.cpp repack quantized weights for this CPU (crashes with the peers' build here)")
    parser.add_argument("--kernels", action="store_true", help="also time one layer's products per kernel")
    parser.add_argument("--kernels-only", action="store_true")
    parser.add_argument("--kernel-rows", default=",".join(map(str, ROWS)), help="--kernels: rows per product")
    parser.add_argument("--read-rate", action="store_true",
                        help="only the weight read rate of the quantized kernels over every matrix of each model")
    parser.add_argument("--targets", default="", help="--read-rate: CPU targets to build the kernel for, "
                        "e.g. avx512_bf16,avx512,avx2,portable (default: the process's)")
    parser.add_argument("--rows", default="1,4,16,64", help="--read-rate: rows per product")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = [Path(m) for m in args.models.split(",") if m]
    result: dict[str, Any] = {"benchmark": "quantization", "machine": machine_info(),
                              "args": {k: str(v) for k, v in vars(args).items()}}
    if args.read_rate:
        targets = [t for t in args.targets.split(",") if t]
        table = [r for m in models
                 for r in bench_read_rate(m, args.group_size, targets, [int(r) for r in args.rows.split(",")])]
        print_table(table, list(table[0]), title=f"weight read rate, best of short batches, {args.threads} threads")
        result["read_rate"] = table
    elif args.kernels or args.kernels_only:
        kernel_rows = tuple(int(r) for r in args.kernel_rows.split(","))
        table = [r for m in models for r in bench_kernels(m, args.group_size, kernel_rows)]
        print_table(table, list(table[0]), title="one decoder layer's products, best of short batches (us; "
                                                 "x = speed-up over bf16)")
        result["kernels"] = table
    if not (args.kernels_only or args.read_rate):
        table = [r for m in models for r in bench_model(m, args)]
        cols = ["model", "weights", "b1_tok_s", "b1_vs_octavo_bf16", "llamacpp_file", "b1_vs_llamacpp",
                "bw_fraction", "MB_per_token", "read_GBs", "offline_out_tok_s", "offline_vs_llamacpp", "load"]
        print_table(table, cols, title=f"batch-1 decode and offline throughput, median (min-max) of rounds in "
                                       f"turns ({args.repeats} batch-1, {args.offline_repeats} offline)")
        result["decode"] = table
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
