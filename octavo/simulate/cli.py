"""``octavo simulate run``: its options (a dataclass, as every command's), and one run from them to a JSON summary
(and a PNG). ``octavo simulate calibrate`` runs the real engine, so it lives
in octavo/entrypoints/calibrate.py; this side stays torch-free."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from octavo.autoscale.policy import Autoscaler, AutoscalerConfig, PredictiveConfig, ReactiveConfig
from octavo.config import CacheConfig, SchedulerConfig, option
from octavo.simulate.autoscaling import PolicyScaler
from octavo.simulate.cost_model import CostModel
from octavo.simulate.replica import ReplicaShape
from octavo.simulate.report import SLO, headline, summarize
from octavo.simulate.simulator import ROUTING_POLICIES, STALL_MODELS, FleetConfig, Simulator
from octavo.simulate.traces import TRACE_KINDS, LengthDist, TraceRequest, TraceSpec, generate, load_jsonl


def _opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    return option(default, help, group=group, **extra)


_TRACE, _FLEET = "trace", "fleet"
_SCALING = "autoscaling (octavo/autoscale's policy on the simulated clock)"
_REPLICA, _OUTPUT = "each replica (default: the calibrated engine's)", "output"


@dataclass
class SimulateRunConfig:
    """``octavo simulate run``'s options, by group."""

    cost_model: str = field(metadata={"help": "JSON written by `octavo simulate calibrate`"})
    trace: str = _opt("poisson", f"one of {', '.join(TRACE_KINDS)}, or a recorded .jsonl file", _TRACE)
    duration: float = _opt(600.0, "seconds of arrivals (generated traces)", _TRACE, unit="seconds")
    rate: float = _opt(1.0, "requests/s (bursty: off rate; diurnal: mean)", _TRACE)
    burst_rate: float = _opt(0.0, "bursty: requests/s while on", _TRACE)
    on_s: float = _opt(10.0, "bursty: mean seconds on", _TRACE, unit="seconds")
    off_s: float = _opt(50.0, "bursty: mean seconds off", _TRACE, unit="seconds")
    amplitude: float = _opt(0.8, "diurnal: peak is rate * (1 + amplitude)", _TRACE)
    period: float = _opt(3600.0, "diurnal: seconds in one (compressed) day", _TRACE, unit="seconds")
    burst_at: Optional[float] = _opt(None, "diurnal: start of an extra burst (s)", _TRACE, unit="seconds")
    burst_s: float = _opt(0.0, "diurnal: the burst's length (s)", _TRACE, unit="seconds")
    burst_factor: float = _opt(1.0, "diurnal: rate multiplier in the burst", _TRACE)
    prompt_len: str = _opt("lognormal:200:0.8", "fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA", _TRACE)
    output_len: str = _opt("lognormal:100:0.6", "same forms as --prompt-len", _TRACE)
    seed: int = _opt(0, "random seed of the generated trace and the simulation", _TRACE)
    replicas: int = _opt(1, "replicas at the start", _FLEET)
    routing: str = _opt("least-load", "the gateway's routing policy", _FLEET, choices=tuple(sorted(ROUTING_POLICIES)))
    cold_start: float = _opt(60.0, "seconds from scale-up to a ready replica", _FLEET, unit="seconds")
    interval: float = _opt(10.0, "seconds between fleet samples / scaler decisions", _FLEET, unit="seconds")
    request_overhead: float = _opt(0.0, "seconds each request spends outside engine steps (HTTP, tokenizing), on "
                                        "top of the cost model's served calibration", _FLEET, unit="seconds")
    step_overhead: float = _opt(0.0, "seconds a served step costs beyond the cost model's step (streaming, the "
                                     "HTTP front), on top of its served calibration", _FLEET, unit="seconds")
    stalls: str = _opt("independent", "how served steps slow down: independent (each step its own stretch) or "
                                      "recorded (the served calibration's steps replayed as they came, slow ones in "
                                      "runs)", _FLEET, choices=STALL_MODELS)
    autoscale: str = _opt("none", "predictive: max(reactive, Holt-Winters forecast / --capacity-per-replica)",
                          _SCALING, choices=("none", "reactive", "predictive"))
    min_replicas: int = _opt(1, "fewest replicas", _SCALING)
    max_replicas: int = _opt(8, "most replicas", _SCALING)
    scale_on: tuple[str, ...] = _opt((), "reactive signal and its per-replica target, repeatable (default: "
                                         "in_flight=8)", _SCALING, repeatable=True, metavar="SIGNAL=TARGET")
    scale_down_window: float = _opt(300.0, "seconds (HPA's stabilisation)", _SCALING, unit="seconds")
    capacity_per_replica: Optional[float] = _opt(None, "predictive: requests/s one replica serves within the SLO",
                                                 _SCALING)
    forecast_bucket: float = _opt(60.0, "predictive: seconds per forecast point", _SCALING, unit="seconds")
    headroom: float = _opt(1.2, "predictive: forecast multiplier", _SCALING)
    max_num_seqs: Optional[int] = _opt(None, "most sequences in a step (default: the calibrated engine's)", _REPLICA)
    max_num_batched_tokens: Optional[int] = _opt(None, "most tokens in a step (default: the calibrated engine's)",
                                                 _REPLICA, unit="tokens")
    enable_chunked_prefill: Optional[bool] = _opt(None, "split long prompts over steps (default: the calibrated "
                                                        "engine's)", _REPLICA)
    num_blocks: Optional[int] = _opt(None, "KV cache blocks per replica (default: the calibrated engine's)",
                                     _REPLICA)
    block_size: Optional[int] = _opt(None, "tokens per KV cache block (default: the calibrated engine's)",
                                     _REPLICA, unit="tokens")
    max_model_len: Optional[int] = _opt(None, "longest sequence (default: the calibrated engine's)", _REPLICA,
                                        unit="tokens")
    slo_ttft: float = _opt(1.0, "time-to-first-token objective", _OUTPUT, unit="seconds")
    slo_tpot: float = _opt(0.1, "time-per-output-token objective", _OUTPUT, unit="seconds")
    slo_from: Optional[float] = _opt(None, "also report the SLO attainment of the requests arriving from this "
                                           "second on", _OUTPUT, unit="seconds")
    summary: Optional[Path] = _opt(None, "write the JSON summary here (default: stdout)", _OUTPUT)
    plot: Optional[Path] = _opt(None, "write a PNG of load, replicas and latency over time", _OUTPUT)


def build_trace(args: SimulateRunConfig) -> list[TraceRequest]:
    if args.trace.endswith(".jsonl"):
        return load_jsonl(args.trace)
    spec = TraceSpec(
        kind=args.trace, duration_s=args.duration, rate=args.rate,
        prompt=LengthDist.parse(args.prompt_len, "prompt_len"), output=LengthDist.parse(args.output_len, "output_len"),
        burst_rate=args.burst_rate, on_s=args.on_s, off_s=args.off_s, amplitude=args.amplitude,
        period_s=args.period, burst_at_s=args.burst_at, burst_s=args.burst_s, burst_factor=args.burst_factor,
    )
    return generate(spec, args.seed)


def replica_shape(cost_model: CostModel, args: SimulateRunConfig) -> ReplicaShape:
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


def autoscaler_config(args: SimulateRunConfig) -> AutoscalerConfig:
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


class _Progress:
    """One line on stderr each time another tenth of the trace's time has been simulated."""

    def __init__(self, trace: list[TraceRequest]) -> None:
        self.span = max((t.arrival_s for t in trace), default=0.0)
        self.shown = 0

    def __call__(self, now: float, finished: int, total: int) -> None:
        tenth = min(10, int(10 * now / self.span)) if self.span > 0 else 10
        if tenth > self.shown:
            self.shown = tenth
            print(f"simulated {now:.0f} s of {self.span:.0f} s: {finished} of {total} requests finished",
                  file=sys.stderr, flush=True)


def run(args: SimulateRunConfig) -> dict:
    cost_model = CostModel.load(args.cost_model)
    shape = replica_shape(cost_model, args)
    fleet = FleetConfig(routing=args.routing, initial_replicas=args.replicas, cold_start_s=args.cold_start,
                        interval_s=args.interval, request_overhead_s=args.request_overhead,
                        step_overhead_s=args.step_overhead, stalls=args.stalls)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    trace = build_trace(args)
    scaler = None
    if args.autoscale != "none":
        scaler = PolicyScaler(Autoscaler(autoscaler_config(args)), args.interval)
    result = Simulator(cost_model, shape, fleet, scaler, seed=args.seed).run(trace, _Progress(trace))
    summary = summarize(result, slo, args.slo_from)
    if scaler is not None:
        summary["scale_decisions"] = [{"time_s": t, "from": a, "to": b, "reason": d.reason}
                                      for (t, a, b), d in zip(result.scale_events, scaler.decisions)]
    summary["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
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
