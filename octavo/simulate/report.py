"""What a simulation run comes to: latency percentiles, SLO attainment,
throughput and replica-hours, as a JSON-ready summary.

Percentiles are nearest-rank over the requests that have the value (TPOT
needs two output tokens). SLO attainment is the share of all requests of
the trace whose TTFT and TPOT both met their objective; a request never
served (the simulation ended with it queued) counts as missed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from octavo.simulate.replica import RequestRecord
from octavo.simulate.simulator import SimResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"slo: ttft_s and tpot_s must be > 0, got {self.ttft_s}, {self.tpot_s}")


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile ``q`` (0-100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def _stats(values: list[float]) -> dict[str, Optional[float]]:
    out: dict[str, Optional[float]] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def attainment(records: Sequence[RequestRecord], slo: SLO) -> Optional[float]:
    """The share of ``records`` whose TTFT and TPOT met the SLO (unserved ones missed it)."""
    met = sum(1 for r in records if r.finish_s is not None and r.ttft <= slo.ttft_s
              and (r.tpot is None or r.tpot <= slo.tpot_s))
    return met / len(records) if records else None


def summarize(result: SimResult, slo: SLO, slo_from_s: Optional[float] = None) -> dict:
    """``slo_from_s``: also the attainment of the requests arriving from then on
    (e.g. the last day of a diurnal trace, once a forecaster has history)."""
    records = result.records
    done = [r for r in records if r.finish_s is not None]
    ttft = [r.ttft for r in records if r.ttft is not None]
    tpot = [r.tpot for r in records if r.tpot is not None]
    e2e = [r.e2e for r in done]
    first = min((r.arrival_s for r in records), default=0.0)
    # As a benchmark client measures it: first arrival to last completion.
    span = max(max((r.finish_s for r in done), default=first) - first, 1e-9)
    replica_s = sum(r.stopped_s - r.created_s for r in result.replicas)
    busy_s = sum(r.busy_s for r in result.replicas)
    return {
        "requests": len(records),
        "finished": len(done),
        "unfinished": len(records) - len(done),
        "refused": sum(1 for r in records if r.error is not None),
        "preemptions": sum(r.preemptions for r in records),
        "duration_s": span,
        "ttft_s": _stats(ttft),
        "tpot_s": _stats(tpot),
        "e2e_s": _stats(e2e),
        "slo": {**asdict(slo), "attainment": attainment(records, slo)},
        "throughput": {
            "requests_per_s": len(done) / span,
            "output_tokens_per_s": sum(r.tokens_done for r in records) / span,
            "prompt_tokens_per_s": sum(r.prompt_tokens for r in done) / span,
        },
        "replicas": {
            "started": len(result.replicas),
            "max_live": max((s.ready + s.starting for s in result.samples), default=len(result.replicas)),
            "replica_hours": replica_s / 3600,
            "busy_fraction": busy_s / replica_s if replica_s else 0.0,
            "scale_events": len(result.scale_events),
        },
    } | ({} if slo_from_s is None else {"slo_from": {
        "from_s": slo_from_s, "attainment": attainment([r for r in records if r.arrival_s >= slo_from_s], slo)}})


def headline(summary: dict, records: Sequence[RequestRecord]) -> str:
    """A few lines a person reads after a run: what was served and refused (and why), latency, cost."""
    def ms(stats: dict, q: str) -> str:
        return "-" if stats.get(q) is None else f"{stats[q] * 1e3:.0f} ms"

    thr, reps = summary["throughput"], summary["replicas"]
    lines = [f"{summary['finished']} of {summary['requests']} requests finished in {summary['duration_s']:.0f} s "
             f"({thr['requests_per_s']:.2f} req/s, {thr['output_tokens_per_s']:.0f} output tok/s)",
             f"TTFT p50 {ms(summary['ttft_s'], 'p50')}, p99 {ms(summary['ttft_s'], 'p99')}; "
             f"TPOT p50 {ms(summary['tpot_s'], 'p50')}, p99 {ms(summary['tpot_s'], 'p99')}; "
             f"SLO attainment {summary['slo']['attainment'] or 0:.1%}",
             f"replicas: {reps['started']} started, at most {reps['max_live']} at once, "
             f"{reps['replica_hours']:.2f} replica-hours"]
    refused = [r.error for r in records if r.error is not None]
    if refused:
        reasons = sorted(set(refused), key=refused.count, reverse=True)
        lines.append(f"{len(refused)} requests refused ({len(refused) / len(records):.0%}), e.g.: {reasons[0]}")
    return "\n".join(lines)
