"""The checkpoint parsers (GGUF, safetensors header, tokenizer.model),
fuzzed with coverage guidance for 100,000 inputs in one process
(tests/checkpoint/fuzz_parsers.py): every input parses or raises
ValueError, none takes more than 30 s (the slowest bounded input, the most
pieces of the longest length, takes ~7 s on a busy core: the bound leaves
room for a machine running other work), and the process stays below 1 GiB
of memory (libFuzzer's -rss_limit_mb; it starts at about 100 MiB), so no
input makes a parser allocate what it declares."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.checkpoint.fuzz_seeds import seeds

REPO = Path(__file__).resolve().parents[2]


def test_every_input_parses_or_is_a_value_error(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, seed in enumerate(seeds()["all"]):
        (corpus / f"seed-{i}").write_bytes(seed)
    result = subprocess.run(
        # Through a shell that forks it: Linux hands a child its parent's peak RSS across exec, and libFuzzer's
        # -rss_limit_mb reads that peak, so started from a test process that has grown past 1 GiB (a test
        # worker late in the suite) the fuzzer would stop at its first check. The shell's child starts at its size.
        ["sh", "-c", '"$@"; exit $?', "sh",
         # A number of runs (~4 s on a quiet core) rather than a time: a loaded machine runs fewer in a second.
         sys.executable, "-m", "tests.checkpoint.fuzz_parsers", "all", "-runs=100000", "-max_total_time=90",
         "-timeout=30",
         "-rss_limit_mb=1024", f"-artifact_prefix={tmp_path}/", str(corpus)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = int(result.stderr.rsplit("Done ", 1)[1].split(" runs", 1)[0])
    assert runs > 1000, result.stderr[-2000:]  # it did fuzz
