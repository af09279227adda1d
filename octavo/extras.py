"""Optional dependencies, checked where a command starts rather than where they are first imported.

A path that only some users take (a plot, a fitted cost model, Ray, Kubernetes) imports its package
late, so the base install stays small. Checked up front, a missing one is a one-line error naming
the extra that brings it, before the command has spent time on anything else.
"""
from __future__ import annotations

import importlib.util


def require(module: str, extra: str, purpose: str) -> None:
    """ValueError naming ``extra`` when ``module`` is not importable (``purpose``: what needs it)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ValueError(f"{purpose} needs the '{module.split('.')[0]}' package: "
                         f"pip install -e '.[{extra}]' (in the Octavo checkout)")
