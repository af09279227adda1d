"""Reactive vs predictive autoscaling, in the capacity simulator: a diurnal
trace (three compressed days) with a burst on the last day's peak.

    python -m benchmarks.simulator_autoscaling --cost-model benchmarks/results/simulator/cost.json

1. Capacity: one replica, Poisson arrivals at rising rates; the highest rate
   whose SLO attainment is >= --capacity-attainment is the per-replica
   capacity the predictive policy divides its forecast by.
2. The same trace under: a fixed fleet sized for the peak, the reactive
   policy (HPA on in-flight requests per replica), and reactive + predictive
   (Holt-Winters over the compressed days, horizon = the cold start).
Every run is an `octavo simulate run` command line (printed), so each row
can be reproduced, and plotted, on its own.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
from pathlib import Path

from octavo.entrypoints.cli import build_parser
from octavo.simulate.cli import run

RESULTS = Path(__file__).resolve().parent / "results" / "simulator"


def simulate(argv: list[str], out: Path) -> dict:
    argv = ["simulate", "run", *argv, "--summary", str(out.with_suffix(".json")), "--plot", str(out.with_suffix(".png"))]
    print("octavo " + shlex.join(argv), flush=True)
    return run(build_parser().parse_args(argv))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", type=Path, required=True)
    p.add_argument("--period", type=float, default=600.0, help="seconds in one compressed day")
    p.add_argument("--days", type=int, default=3)
    p.add_argument("--peak-replicas", type=float, default=4.0, help="the diurnal peak, in replicas' capacity")
    p.add_argument("--cold-start", type=float, default=60.0)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.2)
    p.add_argument("--capacity-attainment", type=float, default=0.95)
    p.add_argument("--lengths", default="--prompt-len lognormal:200:0.8:16:1024 --output-len lognormal:64:0.5:8:256")
    p.add_argument("--out-dir", type=Path, default=RESULTS / "autoscaling")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    common = ["--cost-model", str(args.cost_model), *shlex.split(args.lengths),
              "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot), "--seed", "0"]

    capacity = 0.0
    rate = 0.25
    while True:
        s = simulate([*common, "--trace", "poisson", "--rate", str(rate), "--duration", "300"],
                     args.out_dir / f"capacity-{round(rate * 100)}")
        print(f"  {rate:g} req/s on one replica: SLO attainment {s['slo']['attainment']:.3f}", flush=True)
        if s["slo"]["attainment"] < args.capacity_attainment:
            break
        capacity, rate = rate, rate + 0.25
    if capacity == 0:
        raise SystemExit("one replica cannot meet the SLO even at 0.25 req/s: loosen --slo-ttft/--slo-tpot")

    amplitude = 0.8
    mean = args.peak_replicas * capacity / (1 + amplitude)
    last_peak = (args.days - 1) * args.period + args.period / 2
    trace = ["--trace", "diurnal", "--rate", f"{mean:.4g}", "--amplitude", str(amplitude),
             "--period", str(args.period), "--duration", str(args.days * args.period),
             "--burst-at", str(last_peak - args.period / 20), "--burst-s", str(args.period / 10),
             "--burst-factor", "1.5", "--slo-from", str((args.days - 1) * args.period)]
    fleet = ["--cold-start", str(args.cold_start), "--interval", "15"]
    peak = math.ceil(args.peak_replicas * 1.5)
    scaling = ["--min-replicas", "1", "--max-replicas", str(peak + 2), "--scale-on", "in_flight=8",
               "--scale-down-window", str(args.period / 6)]
    runs = {
        "fixed at the burst peak": [*fleet, "--replicas", str(peak)],
        "reactive": [*fleet, "--autoscale", "reactive", *scaling],
        "reactive + predictive": [*fleet, "--autoscale", "predictive", *scaling,
                                  "--capacity-per-replica", str(capacity), "--forecast-bucket", "30"],
    }
    rows = {}
    for name, extra in runs.items():
        s = simulate([*common, *trace, *extra], args.out_dir / name.replace(" + ", "-and-").replace(" ", "-"))
        rows[name] = s
    print(f"\ncapacity per replica: {capacity:g} req/s (SLO TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s)")
    print("| policy | requests | SLO attainment, 3 days | last day (burst) | TTFT p50 / p99 (s) | replica-hours "
          "| max replicas | scale events |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in rows.items():
        r = s["replicas"]
        print(f"| {name} | {s['requests']} | {s['slo']['attainment']:.3f} | {s['slo_from']['attainment']:.3f} "
              f"| {s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} | {r['replica_hours']:.2f} "
              f"| {r['max_live']} | {r['scale_events']} |")
    (args.out_dir / "table.json").write_text(json.dumps({"capacity": capacity, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
