"""One PNG of a run over time: load (arrivals/s, queue), replicas (ready,
starting, target) and latency (TTFT p50/p99 of the requests that arrived in
each interval, with the SLO). matplotlib is the optional extra
``octavo[simulate]``; only this module imports it."""
from __future__ import annotations

from pathlib import Path

from octavo.simulate.report import SLO, percentile
from octavo.simulate.simulator import SimResult


def plot_timeline(result: SimResult, slo: SLO, path: str | Path, title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plot: matplotlib is needed for plots: pip install 'octavo[simulate]'") from None
    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    samples, step = result.samples, result.interval_s
    t = [s.time / 60 for s in samples]
    fig, (load, fleet, lat) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    load.plot(t, [s.arrivals / step for s in samples], label="arrivals/s")
    load.plot(t, [s.waiting for s in samples], label="waiting requests")
    load.plot(t, [s.running for s in samples], label="running requests", alpha=0.7)
    load.set_ylabel("load")
    load.legend(loc="upper left")
    fleet.step(t, [s.ready for s in samples], where="post", label="ready replicas")
    fleet.step(t, [s.ready + s.starting for s in samples], where="post", label="ready + starting", linestyle="--")
    fleet.set_ylabel("replicas")
    fleet.legend(loc="upper left")
    bins: dict[int, list[float]] = {}
    for r in result.records:
        if r.ttft is not None:
            bins.setdefault(int(r.arrival_s // step), []).append(r.ttft)
    keys = sorted(bins)
    lat.plot([(k + 1) * step / 60 for k in keys], [percentile(bins[k], 50) for k in keys], label="TTFT p50")
    lat.plot([(k + 1) * step / 60 for k in keys], [percentile(bins[k], 99) for k in keys], label="TTFT p99")
    lat.axhline(slo.ttft_s, color="red", linestyle=":", label="TTFT SLO")
    lat.set_yscale("log")
    lat.set_ylabel("seconds (by arrival)")
    lat.set_xlabel("simulated minutes")
    lat.legend(loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
