"""Two commits of Octavo against each other, in turns in one run: batch-1 decode, prefill and offline throughput
on the default model (a refactor's "within noise" check).

Each commit is checked out into a temporary worktree; every round runs each commit once in a fresh process (the
order alternating between rounds), and each process loads the model, warms up, then times the three workloads.

    python -m benchmarks.commit_ab --base HEAD~5 --head HEAD [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from octavo.assets.default_model import SMOLLM2, fetch

REPO = Path(__file__).resolve().parent.parent
MEASURES = ("decode tok/s (batch 1)", "prefill tok/s (1024-token prompt)", "offline output tok/s (32 x 64)")


def _child(model: str, threads: int) -> None:
    """Runs inside the checkout under test (PYTHONPATH): one JSON line of the three figures."""
    import torch

    from octavo import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, max_num_seqs=32)
    greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompt = [[1] + list(range(100, 115))]
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up

    def timed(prompts: list[list[int]], params: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    decode = 128 / timed(prompt, greedy)
    long_prompt = [[1] + [100 + i % 4000 for i in range(1023)]]
    prefill = 1024 / timed(long_prompt, SamplingParams(max_tokens=1))
    batch = [[1] + [200 + 37 * r + i for i in range(63)] for r in range(32)]
    offline = 32 * 64 / timed(batch, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    print(json.dumps(dict(zip(MEASURES, (decode, prefill, offline)))))


def _run(checkout: Path, model: str, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OCTAVO_LOG_LEVEL": "warning"}
    out = subprocess.run([sys.executable, "-c", f"from benchmarks.commit_ab import _child; _child({model!r}, {threads})"],
                         cwd=checkout, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = str(fetch(SMOLLM2))
    results: dict[str, list[dict[str, float]]] = {args.base: [], args.head: []}
    with tempfile.TemporaryDirectory() as scratch:
        checkouts = {}
        for rev in (args.base, args.head):
            path = Path(scratch) / rev.replace("/", "_").replace("~", "-")
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
            # The child imports this module from the checkout under test: give older commits the current copy.
            (path / "benchmarks" / "commit_ab.py").write_text(Path(__file__).read_text())
            checkouts[rev] = path
        try:
            for round_ in range(args.rounds):
                order = [args.base, args.head] if round_ % 2 == 0 else [args.head, args.base]
                for rev in order:
                    results[rev].append(_run(checkouts[rev], model, args.threads))
                    print(f"round {round_ + 1} {rev}: " + ", ".join(f"{v:.1f}" for v in results[rev][-1].values()),
                          flush=True)
        finally:
            for path in checkouts.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)
    print(f"\n{args.head} / {args.base}, {args.rounds} rounds in turns, {args.threads} threads, {SMOLLM2.name}:")
    for measure in MEASURES:
        base = [r[measure] for r in results[args.base]]
        head = [r[measure] for r in results[args.head]]
        print(f"  {measure}: {statistics.median(head) / statistics.median(base):.3f}x "
              f"(head {statistics.median(head):.1f} [{min(head):.1f}-{max(head):.1f}], "
              f"base {statistics.median(base):.1f} [{min(base):.1f}-{max(base):.1f}])")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
