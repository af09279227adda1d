"""Shared by the monitoring tests: what docs/METRICS.md lists, metric names in PromQL, promtool."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
METRICS_DOC = REPO / "docs" / "METRICS.md"

_ROW = re.compile(r"^\| `([^`]+)` \|")
# Metric names as PromQL writes them: Octavo's (with a colon), and the process/HTTP/python ones.
_NAME = re.compile(r"\b(octavo[\w:]*|process_\w+|python_\w+|http_\w+|up)\b")
_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def documented() -> dict[str, set[str]]:
    """Section ("serve", "gateway") -> the metric names its tables list."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in METRICS_DOC.read_text().splitlines():
        if line.startswith("## "):
            current = {"## `octavo serve`": "serve", "## `octavo gateway`": "gateway"}.get(line.strip())
        elif current is not None and (m := _ROW.match(line)):
            sections.setdefault(current, set()).add(m.group(1))
    return sections


def documented_buckets() -> dict[str, tuple[float, ...]]:
    """Histogram name -> the upper bounds its row's bucket set lists (sets with fixed bounds only)."""
    text = METRICS_DOC.read_text()
    sets = {}
    for m in re.finditer(r"^\| ([A-Z_]+) \| ([0-9., ]+)(?: s| tokens)? \|$", text, re.M):
        sets[m.group(1)] = tuple(float(v) for v in m.group(2).split(","))
    buckets = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 5 and cells[1] == "histogram" and cells[4] in sets:
            buckets[cells[0].strip("`")] = sets[cells[4]]
    return buckets


def names_in(promql: str) -> set[str]:
    """Metric names a query reads, with histogram series mapped to their metric."""
    # Label values and matchers in quotes are not names.
    unquoted = re.sub(r'"[^"]*"', '""', promql)
    names = set()
    for name in _NAME.findall(unquoted):
        for suffix in _SERIES_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def require_binary(name: str) -> str:
    """The binary's path; on CI (which installs it) its absence fails, elsewhere it skips, naming it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found (Debian package prometheus; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path
