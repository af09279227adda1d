"""`octavo serve` on a hostile model file (tests/checkpoint/hostile_files.py)
exits with one `octavo: error:` line naming the file, the field and the
value: a GGUF file's metadata, a config.json value and a tokenizer.model
length, each read at a different point of the start."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.hostile_files import CASES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["gguf-context-length-2^62", "config-rope-factor-nan", "spm-length-2^31"])
def test_serve_refuses_a_hostile_file_in_one_line(name, valid, tmp_path):
    case = next(c for c in CASES if c.name == name)
    path = case.build(tmp_path, valid)
    result = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli", "serve", str(path), "--port", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert errors[0].startswith("octavo: error: ") and str(path) in errors[0]
    assert all(word in errors[0] for word in case.words), errors[0]
