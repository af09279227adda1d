"""bf16 linear layers alone: every weight matrix of a model, applied in a loop
to ``rows`` activations, by each linear backend Octavo has.

    python -m benchmarks.linear_kernels --model benchmarks/models/llama-100m --rows 1,4,32,256,2048

Backends: ``onednn`` (torch's oneDNN with prepacked weights), ``native``
(Octavo's AMX kernel reading those same prepacked bytes), ``torch`` (F.linear
on the plain weight), ``fp32_tiles`` / ``fp32_copy`` (float32 products on
tile-by-tile converted bf16 weights / on a float32 copy), the many-row GEMM
bf16_gemm.c for the process's target (``gemm_<isa>``, float32 products, and
``gemm_dot_<isa>``, AVX-512 BF16 dot products, where the target has them),
and with ``--targets`` the few-row kernel bf16_linear.c and the GEMM built
for each named CPU target (``rows_<isa>``, ``gemm_<isa>``, ``gemm_dot_<isa>``). Run under ``OCTAVO_CPU_TARGET=avx512_bf16`` (which also caps
oneDNN, see octavo/kernels/cpu_features.py) to see a CPU without AMX.
``--gemm-baseline`` also builds another source of bf16_gemm.c for the
process's target (e.g. ``git show main:octavo/kernels/bf16_gemm.c``, with
its common.h beside it) as ``gemm_baseline``; the two GEMMs are then timed in
turns, so that the machine's drifting speed (a shared VM) hits both alike.
``--amx-baseline`` does the same for amx_linear.c (its amx_tiles.h and
common.h beside it): ``native_baseline``, on the same packed weights.
``--backends`` keeps only the named ones; ``--cpu-time`` (with ``--threads
1``) times each pass by the thread's CPU time, which other jobs on a loaded
machine inflate far less than wall time. Reported: ms per pass over all matrices, GB/s of weights read
(what bounds few rows) and GFLOP/s (what bounds many), next to a plain
full-buffer sum of the same byte count (the read-bandwidth yardstick that
benchmarks/roofline.py uses).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch.nn import functional as F

from benchmarks.options import DEFAULT_MODEL, int_list
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.turns import in_turns, median_time

if TYPE_CHECKING:
    from octavo.kernels.bf16_linear import Bf16LinearKernel


def model_matrices(model: Path) -> list[tuple[int, int]]:
    """[out, in] of each matmul of one forward, q/k/v and gate/up fused as Octavo runs them."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def build_gemm_baseline(source: Path) -> Bf16LinearKernel:
    """``source`` (a bf16_gemm.c) compiled as build.py compiles the kernel for the process's target."""
    from octavo.kernels.bf16_linear import Bf16LinearKernel
    from octavo.kernels.build import load_other_source

    return Bf16LinearKernel(load_other_source(source), "bf16_gemm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rows", type=int_list, default=[1, 4, 32, 256, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    parser.add_argument("--fastest", action="store_true",
                        help="report the fastest of --repeats runs, not the median (a machine shared with other jobs)")
    parser.add_argument("--gemm-baseline", type=Path, help="another bf16_gemm.c, timed in turns with the current one")
    parser.add_argument("--amx-baseline", type=Path, help="another amx_linear.c, timed as native_baseline")
    parser.add_argument("--backends", type=lambda s: [b for b in s.split(",") if b],
                        help="only these backends (e.g. onednn,native,native_baseline)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the thread's CPU time (needs --threads 1): a machine shared with other jobs")
    parser.add_argument("--targets", type=lambda s: [t for t in s.split(",") if t], default=[],
                        help="also the few-row kernel (bf16_linear.c) and the GEMM (bf16_gemm.c) built for "
                             "these CPU targets, e.g. avx512_bf16,avx512,avx2")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time times one thread: use --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter

    from octavo.kernels.amx_linear import AmxLinearKernel, amx_linear_kernel
    from octavo.kernels.build import load_other_source
    from octavo.kernels.bf16_linear import bf16_gemm_kernel, bf16_linear_kernel
    from octavo.kernels.cpu_features import BY_NAME, cpu_target
    from octavo.quant.linear_table import fp32_tiles

    torch.manual_seed(0)
    shapes = model_matrices(args.model)
    weights = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    nbytes = sum(w.numel() * 2 for w in weights)
    amx = amx_linear_kernel()
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
    forms: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "torch": [lambda x, w=w: F.linear(x, w) for w in weights],
        "onednn": [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],
    }
    shared = [amx.share_onednn(p, w) for p, w in zip(packed, weights)] if amx is not None else []
    if shared and all(shared):
        forms["native"] = shared
        if args.amx_baseline is not None:
            baseline_amx = AmxLinearKernel(load_other_source(args.amx_baseline))
            forms["native_baseline"] = [baseline_amx.share_onednn(p, w) for p, w in zip(packed, weights)]
    # The many-row ways octavo/quant/linear_table.py chooses between without AMX.
    forms["fp32_tiles"] = [lambda x, w=w: fp32_tiles(w, x, None) for w in weights]
    copies = [w.float() for w in weights]
    forms["fp32_copy"] = [lambda x, w=w: F.linear(x.float(), w).to(torch.bfloat16) for w in copies]
    for target in args.targets:
        kernel = bf16_linear_kernel(BY_NAME[target], required=True)
        forms[f"rows_{kernel.isa}"] = [lambda x, w=w, kernel=kernel: kernel(x, w) for w in weights]
    for target in dict.fromkeys([cpu_target().name, *args.targets]):
        for kernel in (bf16_gemm_kernel(BY_NAME[target]), bf16_gemm_kernel(BY_NAME[target], dot=True)):
            if kernel is not None:
                name = f"gemm{'_dot' if kernel.name.endswith('_dot') else ''}_{kernel.isa}"
                forms[name] = [lambda x, w=w, kernel=kernel: kernel(x, w) for w in weights]
    if args.gemm_baseline is not None:
        baseline = build_gemm_baseline(args.gemm_baseline)
        forms["gemm_baseline"] = [lambda x, w=w: baseline(x, w) for w in weights]
    if args.backends:
        forms = {name: fns for name, fns in forms.items() if name in args.backends}
    flat = torch.ones(nbytes // 4)
    sum_s = median_time(flat.sum, args.repeats, fastest=args.fastest, clock=clock)
    load_start = load_avg()
    rows_out = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {s[1] for s in shapes}}
        def run(fns: list[Callable[[torch.Tensor], torch.Tensor]]) -> None:
            for (_, k), fn in zip(shapes, fns):
                fn(inputs[k])

        current = bf16_gemm_kernel()
        paired = [f"gemm_{current.isa}", "gemm_baseline"] if args.gemm_baseline is not None and current else []
        times = in_turns({name: (lambda fns=forms[name]: run(fns)) for name in paired}, args.repeats, args.fastest)
        for name, fns in forms.items():
            t = times[name] if name in times else median_time(lambda: run(fns), args.repeats, fastest=args.fastest,
                                                                      clock=clock)
            rows_out.append({"rows": m, "backend": name, "ms": t * 1e3, "weight_gbs": nbytes / t / 1e9,
                             "gflops": m * nbytes / t / 1e9, "of_sum_rate": sum_s / t})
    print_table(rows_out, ["rows", "backend", "ms", "weight_gbs", "gflops", "of_sum_rate"],
                title=f"{len(shapes)} matrices of {args.model.name}, {nbytes / 1e6:.0f} MB bf16; "
                      f"full-buffer sum of as many bytes: {nbytes / sum_s / 1e9:.1f} GB/s "
                      f"({args.threads} threads, {'fastest' if args.fastest else 'median'} of {args.repeats}"
                      f"{', CPU time' if args.cpu_time else ''})")
    print(f"load {load_start} -> {load_avg()}")
    write_json(args.json, {"benchmark": "linear_kernels", "args": vars(args), "sum_gbs": nbytes / sum_s / 1e9,
                           "results": rows_out})


if __name__ == "__main__":
    main()
