"""Command-line options and run helpers shared by the offline benchmarks."""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Callable

from benchmarks.report import PeerResult, load_avg, median_result
from benchmarks.workload import SHAREGPT_INPUT, SHAREGPT_OUTPUT, Workload, ordinary_token_ids, sharegpt_like
from octavo.config import QUANTIZATIONS

DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "llama-100m"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Options every offline benchmark shares."""
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per peer; the median is reported")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 * 2**30,
                        help="Octavo's KV cache budget (default 2 GiB: the machine is shared)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where Octavo and transformers run (llama.cpp stays a CPU peer)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="Octavo without recorded decode steps (CUDA graphs on a GPU, kernel tapes on CPU)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "native", "triton", "torch"],
                        help="Octavo's decode attention (native CPU kernel, Triton on CUDA, or torch gather + SDPA)")
    parser.add_argument("--linear-backend", default="auto", choices=["auto", "native", "onednn", "torch"],
                        help="Octavo's bf16 matmuls (see octavo serve --help)")
    parser.add_argument("--no-fused-ops", action="store_true", help="Octavo with torch ops instead of its fused kernels")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="Octavo's weights quantized while loading (see octavo serve --help); the peers stay bf16")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="CPU threads for every peer (torch and llama.cpp); 1 is steadier on a loaded machine")
    parser.add_argument("--json", type=Path, help="write the results here")


def apply_threads(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)


def timed_runs(run: Callable[[], PeerResult], repeats: int) -> PeerResult:
    runs = []
    for _ in range(repeats):
        before = load_avg()
        result = run()
        result.extra["load_before_after"] = f"{before} -> {load_avg()}"
        runs.append(result)
    return median_result(runs)


def add_sharegpt_args(parser: argparse.ArgumentParser, num_prompts: int = 256) -> None:
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--max-input-len", type=int, default=SHAREGPT_INPUT.high, help="clip input lengths")
    parser.add_argument("--max-output-len", type=int, default=SHAREGPT_OUTPUT.high, help="clip output lengths")


def sharegpt_from_args(args: argparse.Namespace) -> Workload:
    return sharegpt_like(
        args.num_prompts, ordinary_token_ids(args.model), seed=args.seed,
        inputs=dataclasses.replace(SHAREGPT_INPUT, high=args.max_input_len),
        outputs=dataclasses.replace(SHAREGPT_OUTPUT, high=args.max_output_len),
    )
