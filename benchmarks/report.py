"""What every benchmark prints and saves: results, the machine, its load, versions."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence


@dataclass
class PeerResult:
    """One engine's run over one workload. ``elapsed_s`` excludes model loading."""

    peer: str
    model: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s)
        return d


def median_result(runs: Sequence[PeerResult]) -> PeerResult:
    """The run with the median elapsed time (a real run, so its extras stay consistent)."""
    if not runs:
        raise ValueError("runs must not be empty")
    ordered = sorted(runs, key=lambda r: r.elapsed_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.extra["elapsed_s_all_runs"] = [round(r.elapsed_s, 3) for r in runs]
    return chosen


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _mem_total_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_gib": round(_mem_total_gib(), 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama_cpp_python"),
        "octavo": _version("octavo"),
    }


def load_avg() -> str:
    """The 1/5/15-minute load, sampled around each measurement: the machine is shared."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str = "") -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    if title:
        print(f"\n{title}")
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-+-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: Optional[Path], payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=str))
    print(f"wrote {path}")
