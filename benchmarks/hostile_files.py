"""What refusing a hostile model file costs: each file of
tests/checkpoint/hostile_files.py is started as an engine (``LLM(path)``) in a
process of its own, which reports its peak memory (RSS) and the error it
got; the valid tiny model they are made from is started the same way first,
as the baseline, and again declaring the longest context accepted. The
target: every hostile file's peak below the valid model's plus 0.5 GiB.
Then each parser's fuzzer (tests/checkpoint/fuzz_parsers.py) runs for a few
seconds, and its executions are reported.

    python -m benchmarks.hostile_files [--fuzz-seconds 5] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from octavo.checkpoint.bounds import MAX_CONTEXT
from tests.checkpoint.fuzz_seeds import PARSERS, seeds
from tests.checkpoint.hostile_files import CASES, valid_model

REPO = Path(__file__).resolve().parents[1]
MARGIN_MIB = 512

# Run in the child: start an engine on the path (one rank: the engine runs in this process) and report
# the process's peak RSS: VmHWM, the high-water mark of this process image alone (ru_maxrss would also
# count the benchmark's own peak, which Linux carries across fork and exec), children not included.
_CHILD = """
import json, re, sys
from octavo import LLM
error = None
try:
    LLM(sys.argv[1], num_blocks=64).shutdown()
except ValueError as exc:
    error = str(exc)
with open("/proc/self/status") as f:
    peak_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1))
print(json.dumps({"peak_mib": peak_kib / 1024, "error": error}))
"""

def start(path: Path) -> dict:
    """Peak RSS (MiB) and error of an engine started on ``path`` in a fresh process."""
    result = subprocess.run([sys.executable, "-c", _CHILD, str(path)], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    if result.returncode:
        return {"peak_mib": float("nan"), "error": f"exit {result.returncode}: {result.stderr.strip()[-300:]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _with_context(folder: Path, copy: Path, positions: int) -> Path:
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return copy


def fuzz(target: str, seconds: int, root: Path) -> tuple[int, float, int]:
    """(executions, seconds, exit status) of ``target``'s fuzzer run for ``seconds``."""
    corpus = root / f"corpus-{target}"
    corpus.mkdir()
    for i, seed in enumerate(seeds()[target]):
        (corpus / f"seed-{i}").write_bytes(seed)
    result = subprocess.run([sys.executable, "-m", "tests.checkpoint.fuzz_parsers", target,
                             f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=1024",
                             f"-artifact_prefix={root}/", str(corpus)],
                            cwd=REPO, capture_output=True, text=True, timeout=seconds + 120)
    done = result.stderr.rsplit("Done ", 1)[-1]
    runs, took = (done.split(" runs in ", 1) + ["0"])[:2] if "Done " in result.stderr else ("0", "0")
    return int(runs), float(took.split()[0]), result.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fuzz-seconds", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="hostile cases to run (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        valid = valid_model(root / "valid")
        baseline = start(valid.folder)
        limit = baseline["peak_mib"] + MARGIN_MIB
        print(f"valid tiny model: peak {baseline['peak_mib']:.0f} MiB ({baseline['error'] or 'started'}); "
              f"target for each hostile file: below {limit:.0f} MiB")
        longest = start(_with_context(valid.folder, root / "longest", MAX_CONTEXT))
        print(f"the same declaring a context of {MAX_CONTEXT} (the bound, accepted): peak "
              f"{longest['peak_mib']:.0f} MiB ({longest['error'] or 'started'})")
        print(f"{'file':40s} {'peak MiB':>9s}  {'ok':3s} error")
        worst = 0.0
        for i, case in enumerate(c for c in CASES if not args.only or c.name in args.only):
            folder = root / f"case-{i}"
            folder.mkdir()
            got = start(case.build(folder, valid))
            worst = max(worst, got["peak_mib"])
            ok = "yes" if got["peak_mib"] < limit and got["error"] else "NO"
            error = (got["error"] or "started").replace(f"{folder}/", "")
            print(f"{case.name:40s} {got['peak_mib']:9.0f}  {ok:3s} {error[:110]}")
        print(f"worst hostile peak: {worst:.0f} MiB (baseline {baseline['peak_mib']:.0f} MiB)")
        print(f"{'fuzzer':14s} {'runs':>9s} {'seconds':>8s} {'runs/s':>8s} status")
        for target in PARSERS:
            runs, took, status = fuzz(target, args.fuzz_seconds, root)
            print(f"{target:14s} {runs:9d} {took:8.0f} {runs / max(took, 1):8.0f} "
                  f"{'clean' if status == 0 else f'CRASH (exit {status})'}")


if __name__ == "__main__":
    main()
