"""An optional package that is missing is named with its extra before a command does any work."""
from __future__ import annotations

import importlib.util
import time

import pytest

from octavo.entrypoints.cli import main


@pytest.mark.parametrize("argv, package, extra", [
    (["simulate", "calibrate", "octavo-mini", "-o", "cost.json"], "scipy", "simulate"),
    (["simulate", "run", "--cost-model", "cost.json", "--plot", "x.png"], "matplotlib", "simulate"),
    (["gateway", "--replica", "http://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:9"], "redis", "gateway"),
    (["generate", "octavo-mini", "--prompt", "x", "--distributed-executor-backend", "ray"], "ray", "ray"),
])
def test_a_missing_extra_is_one_line_at_once(monkeypatch, capsys, tmp_path, argv, package, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("octavo: error: ") and f"needs the '{package}' package" in err[0]
    assert f"pip install -e '.[{extra}]'" in err[0]
    assert time.monotonic() - started < 30  # before probes, model loading or serving
