"""Check PromQL expressions with promtool, the parser Prometheus itself uses."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import yaml

from tests.deploy.monitoring import require_binary


def check_expressions(expressions: Sequence[str]) -> None:
    """Fail with promtool's message unless every expression parses (each is wrapped as a recording rule)."""
    rules = [{"record": f"octavo_check:expr_{i}", "expr": expr} for i, expr in enumerate(expressions)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rules.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
        result = subprocess.run([require_binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
