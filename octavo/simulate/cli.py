"""``octavo simulate run``: options, and one run from them to a JSON summary
(and a PNG). ``octavo simulate calibrate`` runs the real engine, so it lives
in octavo/entrypoints/calibrate.py; this side stays torch-free."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from octavo.autoscale.policy import Autoscaler, AutoscalerConfig, PredictiveConfig, ReactiveConfig
from octavo.config import CacheConfig, SchedulerConfig
from octavo.simulate.autoscaling import PolicyScaler
from octavo.simulate.cost_model import CostModel
from octavo.simulate.replica import ReplicaShape
from octavo.simulate.report import SLO, headline, summarize
from octavo.simulate.simulator import ROUTING_POLICIES, FleetConfig, Simulator
from octavo.simulate.traces import TRACE_KINDS, LengthDist, TraceRequest, TraceSpec, generate, load_jsonl


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost-model", required=True, help="JSON written by `octavo simulate calibrate`")
    t = p.add_argument_group("trace")
    t.add_argument("--trace", default="poisson", help=f"one of {', '.join(TRACE_KINDS)}, or a recorded .jsonl file")
    t.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals (generated traces)")
    t.add_argument("--rate", type=float, default=1.0, help="requests/s (bursty: off rate; diurnal: mean)")
    t.add_argument("--burst-rate", type=float, default=0.0, help="bursty: requests/s while on")
    t.add_argument("--on-s", type=float, default=10.0, help="bursty: mean seconds on")
    t.add_argument("--off-s", type=float, default=50.0, help="bursty: mean seconds off")
    t.add_argument("--amplitude", type=float, default=0.8, help="diurnal: peak is rate * (1 + amplitude)")
    t.add_argument("--period", type=float, default=3600.0, help="diurnal: seconds in one (compressed) day")
    t.add_argument("--burst-at", type=float, default=None, help="diurnal: start of an extra burst (s)")
    t.add_argument("--burst-s", type=float, default=0.0, help="diurnal: the burst's length (s)")
    t.add_argument("--burst-factor", type=float, default=1.0, help="diurnal: rate multiplier in the burst")
    t.add_argument("--prompt-len", default="lognormal:200:0.8", help="fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA")
    t.add_argument("--output-len", default="lognormal:100:0.6", help="same forms as --prompt-len")
    t.add_argument("--seed", type=int, default=0)
    f = p.add_argument_group("fleet")
    f.add_argument("--replicas", type=int, default=1, help="replicas at the start")
    f.add_argument("--routing", choices=sorted(ROUTING_POLICIES), default="least-load")
    f.add_argument("--cold-start", type=float, default=60.0, help="seconds from scale-up to a ready replica")
    f.add_argument("--interval", type=float, default=10.0, help="seconds between fleet samples / scaler decisions")
    f.add_argument("--request-overhead", type=float, default=0.0,
                   help="seconds each request spends outside engine steps (HTTP, tokenizing)")
    f.add_argument("--step-overhead", type=float, default=0.0,
                   help="seconds a served step costs beyond the calibrated engine step (streaming, the HTTP front)")
    a = p.add_argument_group("autoscaling (octavo/autoscale's policy on the simulated clock)")
    a.add_argument("--autoscale", choices=("none", "reactive", "predictive"), default="none",
                   help="predictive: max(reactive, Holt-Winters forecast / --capacity-per-replica)")
    a.add_argument("--min-replicas", type=int, default=1)
    a.add_argument("--max-replicas", type=int, default=8)
    a.add_argument("--scale-on", action="append", default=None, metavar="SIGNAL=TARGET",
                   help="reactive signal and its per-replica target, repeatable (default: in_flight=8)")
    a.add_argument("--scale-down-window", type=float, default=300.0, help="seconds (HPA's stabilisation)")
    a.add_argument("--capacity-per-replica", type=float, default=None,
                   help="predictive: requests/s one replica serves within the SLO")
    a.add_argument("--forecast-bucket", type=float, default=60.0, help="predictive: seconds per forecast point")
    a.add_argument("--headroom", type=float, default=1.2, help="predictive: forecast multiplier")
    e = p.add_argument_group("each replica (default: the calibrated engine's)")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks per replica")
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    o.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    o.add_argument("--slo-from", type=float, default=None,
                   help="also report the SLO attainment of the requests arriving from this second on")
    o.add_argument("--summary", type=Path, default=None, help="write the JSON summary here (default: stdout)")
    o.add_argument("--plot", type=Path, default=None, help="write a PNG of load, replicas and latency over time")


def build_trace(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace.endswith(".jsonl"):
        return load_jsonl(args.trace)
    spec = TraceSpec(
        kind=args.trace, duration_s=args.duration, rate=args.rate,
        prompt=LengthDist.parse(args.prompt_len, "prompt_len"), output=LengthDist.parse(args.output_len, "output_len"),
        burst_rate=args.burst_rate, on_s=args.on_s, off_s=args.off_s, amplitude=args.amplitude,
        period_s=args.period, burst_at_s=args.burst_at, burst_s=args.burst_s, burst_factor=args.burst_factor,
    )
    return generate(spec, args.seed)


def replica_shape(cost_model: CostModel, args: argparse.Namespace) -> ReplicaShape:
    """The calibrated engine's limits, with the options given on top."""
    base = cost_model.engine

    def pick(name: str, fallback: object) -> object:
        value = getattr(args, name, None)
        if value is not None:
            return value
        if base is None:
            raise ValueError(f"--{name.replace('_', '-')}: the cost model names no engine limits, give it")
        return fallback

    num_blocks = pick("num_blocks", base and base.num_kv_blocks)
    block_size = pick("block_size", base and base.block_size)
    return ReplicaShape(
        scheduler=SchedulerConfig(
            max_num_seqs=pick("max_num_seqs", base and base.max_num_seqs),
            max_num_batched_tokens=pick("max_num_batched_tokens", base and base.max_num_batched_tokens),
            enable_chunked_prefill=pick("enable_chunked_prefill", base and base.enable_chunked_prefill),
        ),
        cache=CacheConfig(block_size=block_size),
        num_blocks=num_blocks,
        max_model_len=pick("max_model_len", base and base.max_model_len),
    )


def autoscaler_config(args: argparse.Namespace) -> AutoscalerConfig:
    targets = {}
    for item in args.scale_on or ["in_flight=8"]:
        signal, _, value = item.partition("=")
        try:
            targets[signal] = float(value)
        except ValueError:
            raise ValueError(f"--scale-on: expected SIGNAL=NUMBER, got {item!r}") from None
    predictive = args.autoscale == "predictive"
    return AutoscalerConfig(
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        scale_down_window_s=args.scale_down_window,
        reactive=ReactiveConfig(targets=targets),
        predictive=PredictiveConfig(
            enabled=predictive, capacity_per_replica=args.capacity_per_replica,
            horizon_s=max(args.cold_start, args.interval), headroom=args.headroom, bucket_s=args.forecast_bucket,
            # The trace's (compressed) day is the season; history enough for a few of them.
            seasonal_periods_s=(args.period,), history_s=10 * args.period,
            refit_interval_s=max(args.interval, args.forecast_bucket),
        ),
    )


def run(args: argparse.Namespace) -> dict:
    cost_model = CostModel.load(args.cost_model)
    shape = replica_shape(cost_model, args)
    fleet = FleetConfig(routing=args.routing, initial_replicas=args.replicas, cold_start_s=args.cold_start,
                        interval_s=args.interval, request_overhead_s=args.request_overhead,
                        step_overhead_s=args.step_overhead)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    trace = build_trace(args)
    scaler = None
    if args.autoscale != "none":
        scaler = PolicyScaler(Autoscaler(autoscaler_config(args)), args.interval)
    result = Simulator(cost_model, shape, fleet, scaler, seed=args.seed).run(trace)
    summary = summarize(result, slo, args.slo_from)
    if scaler is not None:
        summary["scale_decisions"] = [{"time_s": t, "from": a, "to": b, "reason": d.reason}
                                      for (t, a, b), d in zip(result.scale_events, scaler.decisions)]
    summary["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                         if k not in ("func",)}
    summary["machine"] = vars(cost_model.machine)
    text = json.dumps(summary, indent=2)
    if args.summary is not None:
        args.summary.write_text(text + "\n")
        print(headline(summary, result.records))
        print(f"summary: {args.summary}")
    else:
        print(text)
        print(headline(summary, result.records), file=sys.stderr)
    if args.plot is not None:
        from octavo.simulate.plots import plot_timeline

        plot_timeline(result, slo, args.plot, title=f"{args.trace}, {len(trace)} requests")
    return summary
