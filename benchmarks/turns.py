"""Timing engines in turns, so that a machine that speeds up or slows down (a shared VM) hits them alike.

Every run is warmed once, then ``rounds`` rounds run every engine once each, one after the other. A ratio
between two engines is taken within each round (runs minutes apart at most) and reported as the median and
the min-max over rounds. Timing one engine's repeats and then the next's lets a noisy neighbour decide the
ratio: on a shared VM one engine-after-engine ratio moved 0.74-2.78x between runs.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence


def median_time(fn: Callable[[], object], repeats: int, warm: bool = True, fastest: bool = False,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """One function alone: median (``fastest``: minimum) of ``repeats`` timed runs, after a warm-up run
    (page faults and allocator growth happen there, not in the timing). ``clock``: wall time, or
    ``time.thread_time`` for the CPU time of a single-threaded call on a machine other jobs share."""
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times) if fastest else statistics.median(times)


def timed(run: Callable[[], object]) -> Callable[[], tuple[float, float]]:
    """``run`` returning its own (wall s, process CPU s)."""
    def measure() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        return time.perf_counter() - wall, time.process_time() - cpu
    return measure


def in_rounds(runs: dict[str, Callable[[], object]], rounds: int,
              warmups: Optional[dict[str, Callable[[], object]]] = None) -> dict[str, list[tuple[float, float]]]:
    """Each run warmed once (or its ``warmups`` entry run), then ``rounds`` rounds of every run in turn:
    (wall s, process CPU s) per run per round."""
    return self_timed_rounds({name: timed(run) for name, run in runs.items()}, rounds, warmups)


def self_timed_rounds(runs: dict[str, Callable[[], tuple[float, float]]], rounds: int,
                      warmups: Optional[dict[str, Callable[[], object]]] = None,
                      ) -> dict[str, list[tuple[float, float]]]:
    """``in_rounds`` for runs that time themselves and return (wall s, CPU s): a peer in another process
    measures its own call, so that the message to it and back is not counted."""
    for name, run in runs.items():
        (warmups or {}).get(name, run)()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run())
    return times


def in_turns(runs: dict[str, Callable[[], object]], repeats: int, fastest: bool = False) -> dict[str, float]:
    """``in_rounds`` reduced to one figure per run: median (``fastest``: minimum) wall seconds."""
    times = in_rounds(runs, repeats)
    return {name: (min if fastest else statistics.median)(wall for wall, _ in t) for name, t in times.items()}


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_spread(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def ratios(rates: dict[str, Any], key: str, ours: Sequence[str], peers: Sequence[str]) -> list[dict[str, Any]]:
    """``rates[engine][key]``: one value per round; each of ``ours`` over each of ``peers``, round by round."""
    rows = []
    for o in ours:
        for p in peers:
            per_round = [a / b for a, b in zip(rates[o][key], rates[p][key])]
            rows.append({"octavo": o, "peer": p, "ratio": spread(per_round), "per_round": per_round})
    return rows


def batch1_decode(engines: dict[str, Callable[[list[int], int], Any]], prompt: list[int], new_tokens: int,
                  rounds: int, self_timed: bool = False) -> dict[str, Any]:
    """Batch-1 decode of every engine in turns: per round, decode tok/s = (N - 1) / (t(N) - t(1)) with both
    timed in that round (prefill subtracted), the end-to-end rate N / t(N), and CPU seconds per token.
    ``self_timed``: each engine returns its own (wall s, CPU s) (``self_timed_rounds``)."""
    runs = {}
    for name, gen in engines.items():
        runs[f"{name}|{new_tokens}"] = lambda gen=gen: gen(prompt, new_tokens)
        runs[f"{name}|1"] = lambda gen=gen: gen(prompt, 1)
    times = self_timed_rounds(runs, rounds) if self_timed else in_rounds(runs, rounds)
    rates = {}
    for name in engines:
        full, one = times[f"{name}|{new_tokens}"], times[f"{name}|1"]
        rates[name] = {
            "decode_tok_s": [(new_tokens - 1) / (f[0] - o[0]) for f, o in zip(full, one)],
            "end_to_end_tok_s": [new_tokens / f[0] for f in full],
            "cpu_s_per_token": [(f[1] - o[1]) / (new_tokens - 1) for f, o in zip(full, one)],
            "wall_s": [f[0] for f in full], "wall_s_1_token": [o[0] for o in one],
        }
    return rates
