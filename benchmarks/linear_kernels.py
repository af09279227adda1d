"""bf16 linear layers alone: every weight matrix of a model, applied in a loop
to ``rows`` activations, by each linear backend Octavo has.

    python -m benchmarks.linear_kernels --model benchmarks/models/llama-100m --rows 1,4,32,256,2048

Backends: ``onednn`` (torch's oneDNN with prepacked weights), ``native``
(Octavo's AMX kernel reading those same prepacked bytes), ``torch`` (F.linear
on the plain weight), ``fp32_tiles`` / ``fp32_copy`` (float32 products on
tile-by-tile converted bf16 weights / on a float32 copy), and with
``--targets`` the few-row kernel bf16_linear.c built for each named CPU target
(``rows_<isa>``). Run under ``OCTAVO_CPU_TARGET=avx512_bf16`` (which also caps
oneDNN, see octavo/kernels/cpu_features.py) to see a CPU without AMX. Reported: ms per pass over all matrices, GB/s of weights read
(what bounds few rows) and GFLOP/s (what bounds many), next to a plain
full-buffer sum of the same byte count (the read-bandwidth yardstick that
benchmarks/roofline.py uses).

``--quant int8,int4`` adds the same matrices quantized as Octavo does on the
fly (int8 per output channel, int4 in groups of ``--group-size``) through the
FMA path of quant_linear.c built for each of ``--targets`` (default: the
process's target), as ``int8_<isa>`` / ``int4_<isa>``, next to
``int8_dequantize`` / ``int4_dequantize`` (dequantize per call + F.linear,
what CPUs without the kernel ran before); their GB/s and
``of_sum_rate`` count the bytes they read (integers, scales, mins), compared
with a sum over as many bytes. ``--no-bf16`` leaves out the bf16 backends:

    python -m benchmarks.linear_kernels --rows 1,4,16,64 --quant int8,int4 --no-bf16 \
        --targets avx512_bf16,avx512,avx2 --threads 1 --fastest
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from benchmarks.options import DEFAULT_MODEL, int_list
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.roofline import median_time
from octavo.kernels.cpu_features import BY_NAME, CpuTarget, cpu_target


def model_matrices(model: Path) -> list[tuple[int, int]]:
    """[out, in] of each matmul of one forward, q/k/v and gate/up fused as Octavo runs them."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def quant_forms(weights: list[torch.Tensor], kind: str, group: int,
                targets: list[CpuTarget]) -> dict[str, tuple[list[Callable[[torch.Tensor], torch.Tensor]], int]]:
    """``kind``-quantized copies of ``weights`` through quant_linear.c's FMA
    path built for each target, and the bytes a pass reads."""
    from octavo.kernels.quant_linear import quant_linear_kernel
    from octavo.quant.onthefly import quantize_int4, quantize_int8

    qs = [quantize_int8(w) if kind == "int8" else quantize_int4(w, group) for w in weights]
    if any(q.kernel is None for q in qs):
        raise SystemExit(f"{kind}: a weight the kernel cannot take (out features not a multiple of 16?)")
    # What a CPU without the kernel did before: dequantize per call, then F.linear.
    forms = {f"{kind}_dequantize": ([lambda x, q=q: F.linear(x, q.dequantize().to(x.dtype)) for q in qs],
                                    sum(q.nbytes for q in qs))}
    for target in targets:
        kernel = quant_linear_kernel(target, required=True)
        forms[f"{kind}_{kernel.isa}"] = [
            lambda x, q=q, kernel=kernel: kernel(x, q.bits, q.group_size, q.packed, q.scales, q.mins, None,
                                                 q.out_features, False) for q in qs], sum(q.nbytes for q in qs)
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rows", type=int_list, default=[1, 4, 32, 256, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    parser.add_argument("--fastest", action="store_true",
                        help="report the fastest of --repeats runs, not the median (a machine shared with other jobs)")
    parser.add_argument("--targets", type=lambda s: [t for t in s.split(",") if t], default=[],
                        help="also the few-row kernel (bf16_linear.c) built for these CPU targets, "
                             "e.g. avx512_bf16,avx512,avx2")
    parser.add_argument("--quant", type=lambda s: [q for q in s.split(",") if q], default=[],
                        help="also the quantized kernel (quant_linear.c) on int8 and/or int4 copies of the weights")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size")
    parser.add_argument("--no-bf16", action="store_true", help="only the quantized kernels")
    args = parser.parse_args()
    if set(args.quant) - {"int8", "int4"}:
        parser.error(f"--quant takes int8 and/or int4; got {','.join(args.quant)}")
    torch.set_num_threads(args.threads)

    from octavo.kernels.amx_linear import amx_linear_kernel
    from octavo.kernels.bf16_linear import bf16_linear_kernel
    from octavo.kernels.cpu_linear import fp32_tiles

    torch.manual_seed(0)
    shapes = model_matrices(args.model)
    weights = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    nbytes = sum(w.numel() * 2 for w in weights)
    forms: dict[str, tuple[list[Callable[[torch.Tensor], torch.Tensor]], int]] = {}
    if not args.no_bf16:
        amx = amx_linear_kernel()
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
        forms["torch"] = [lambda x, w=w: F.linear(x, w) for w in weights], nbytes
        forms["onednn"] = [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                           for p in packed], nbytes
        shared = [amx.share_onednn(p, w) for p, w in zip(packed, weights)] if amx is not None else []
        if shared and all(shared):
            forms["native"] = shared, nbytes
        # The many-row ways cpu_linear.py chooses between without AMX.
        forms["fp32_tiles"] = [lambda x, w=w: fp32_tiles(w, x, None) for w in weights], nbytes
        copies = [w.float() for w in weights]
        forms["fp32_copy"] = [lambda x, w=w: F.linear(x.float(), w).to(torch.bfloat16) for w in copies], nbytes
        for target in args.targets:
            kernel = bf16_linear_kernel(BY_NAME[target], required=True)
            forms[f"rows_{kernel.isa}"] = [lambda x, w=w, kernel=kernel: kernel(x, w) for w in weights], nbytes
    targets = [BY_NAME[t] for t in args.targets] or [cpu_target()]
    for kind in args.quant:
        forms.update(quant_forms(weights, kind, args.group_size, targets))
    sum_s = {b: median_time(torch.ones(b // 4).sum, args.repeats, fastest=args.fastest)
             for b in {b for _, b in forms.values()}}
    load_start = load_avg()
    rows_out = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {s[1] for s in shapes}}
        for name, (fns, read) in forms.items():
            def run() -> None:
                for (_, k), fn in zip(shapes, fns):
                    fn(inputs[k])

            t = median_time(run, args.repeats, fastest=args.fastest)
            # GFLOP/s: 2 flops per weight element and row (nbytes / 2 bf16 elements).
            rows_out.append({"rows": m, "backend": name, "ms": t * 1e3, "MB": read / 1e6, "weight_gbs": read / t / 1e9,
                             "gflops": m * nbytes / t / 1e9, "sum_gbs": read / sum_s[read] / 1e9,
                             "of_sum_rate": sum_s[read] / t})
    print_table(rows_out, ["rows", "backend", "ms", "MB", "weight_gbs", "gflops", "sum_gbs", "of_sum_rate"],
                title=f"{len(shapes)} matrices of {args.model.name}, {nbytes / 1e6:.0f} MB bf16; sum_gbs: a "
                      f"full-buffer sum of as many bytes as the backend reads "
                      f"({args.threads} threads, {'fastest' if args.fastest else 'median'} of {args.repeats})")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "linear_kernels", "args": {k: str(v) for k, v in vars(args).items()},
                           "sum_gbs": {str(b): b / t / 1e9 for b, t in sum_s.items()}, "results": rows_out})


if __name__ == "__main__":
    main()
