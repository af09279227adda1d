"""A snapshot of the engine's state and counters, for metrics and logs.

Per-step distributions (tokens per step, batch efficiency) are histograms
kept in the engine process: the front only sees a snapshot every 0.1 s, so
shipping the latest value would lose every step in between. Each step adds
one count to a bucket of each of three histograms (a bisect over ~13 bounds:
4 us for the three, `python -m timeit` on a busy 2-core Xeon, against steps
of milliseconds); the snapshot carries the cumulative counts, which the front
exposes as Prometheus histograms without re-counting.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0

# Tokens one step computes (vLLM's iteration_tokens buckets).
ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
# Fractions of a step's capacity in use (1 = full).
UTILIZATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass
class StepHistogram:
    """Cumulative bucket counts of a per-step value: ``counts[i]`` counts
    values <= ``bounds[i]`` and > ``bounds[i - 1]``; the last entry counts
    values above every bound (Prometheus' +Inf bucket)."""

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0

    @classmethod
    def with_bounds(cls, bounds: tuple[float, ...]) -> StepHistogram:
        return cls(list(bounds), [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> StepHistogram:
        return StepHistogram(list(self.bounds), list(self.counts), self.sum)


def _iteration_tokens() -> StepHistogram:
    return StepHistogram.with_bounds(ITERATION_TOKEN_BUCKETS)


def _utilization() -> StepHistogram:
    return StepHistogram.with_bounds(UTILIZATION_BUCKETS)


@dataclass
class StepStats:
    """What the steps that ran a forward looked like, accumulated over the
    engine's life. Batch efficiency is two fractions per step: tokens
    scheduled over the token budget (``max_num_batched_tokens``), and
    sequences in the step's batch over ``max_num_seqs``."""

    iteration_tokens: StepHistogram = field(default_factory=_iteration_tokens)
    token_utilization: StepHistogram = field(default_factory=_utilization)
    seq_utilization: StepHistogram = field(default_factory=_utilization)

    def observe(self, num_tokens: int, num_seqs: int, token_budget: int, max_num_seqs: int) -> None:
        self.iteration_tokens.observe(num_tokens)
        self.token_utilization.observe(num_tokens / token_budget)
        self.seq_utilization.observe(num_seqs / max_num_seqs)

    def copy(self) -> StepStats:
        return StepStats(self.iteration_tokens.copy(), self.token_utilization.copy(), self.seq_utilization.copy())


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    # Cumulative counters (monotonic over the engine's life).
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Speculative decoding (octavo/core/spec_stats.py): verifications, proposals
    # verified, proposals accepted, and accepted ones by position (0-based).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    steps: StepStats = field(default_factory=StepStats)
    # Tiers below the pool (octavo/kv_offload/), by medium ("cpu", "disk"):
    # prompt tokens loaded from each (cumulative), and bytes each holds now.
    kv_offload_hits: dict[str, int] = field(default_factory=dict)
    kv_offload_bytes: dict[str, int] = field(default_factory=dict)
    # Block files the disk tier could not read or write ("read", "write"; cumulative): each a miss, not an error.
    kv_offload_errors: dict[str, int] = field(default_factory=dict)
    # Mixtures of experts (octavo/engine/routing_stats.py), by decoder layer: (token, choice) pairs routed
    # to each expert (cumulative), and the busiest expert's pairs over the mean in the last window read.
    moe_routed_tokens: dict[int, list[int]] = field(default_factory=dict)
    moe_load_imbalance: dict[int, float] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class StatsLogger:
    """The engine's periodic log line: load, KV use, token rates and, with
    speculative decoding, the mean acceptance length, all over the last
    interval (counters are cumulative, so the line shows their differences)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: Optional[EngineStats] = None
        self._last_time = 0.0

    def maybe_log(self, stats: EngineStats, now: float) -> Optional[str]:
        """Log (and return) a line when the interval has passed since the last."""
        if self._last is not None and now - self._last_time < self.interval_s:
            return None
        prev = self._last or EngineStats()
        elapsed = max(now - self._last_time, 1e-9) if self._last is not None else None
        self._last, self._last_time = stats, now
        if elapsed is None or stats.generation_tokens == prev.generation_tokens and not stats.num_running:
            return None  # the first snapshot, or idle since the last line
        line = format_stats_line(stats, prev, elapsed)
        logger.info("%s", line)
        return line


def format_stats_line(stats: EngineStats, prev: EngineStats, elapsed_s: float) -> str:
    parts = [
        f"running {stats.num_running}, waiting {stats.num_waiting}",
        f"KV cache {100 * stats.kv_cache_usage:.1f}%",
        f"prompt {(stats.prompt_tokens - prev.prompt_tokens) / elapsed_s:.1f} tok/s",
        f"generation {(stats.generation_tokens - prev.generation_tokens) / elapsed_s:.1f} tok/s",
    ]
    drafts = stats.spec_num_drafts - prev.spec_num_drafts
    if drafts:
        proposed = stats.spec_num_draft_tokens - prev.spec_num_draft_tokens
        accepted = stats.spec_num_accepted_tokens - prev.spec_num_accepted_tokens
        per_pos = [
            (n - (prev.spec_accepted_per_position[i] if i < len(prev.spec_accepted_per_position) else 0)) / drafts
            for i, n in enumerate(stats.spec_accepted_per_position)
        ]
        parts.append(
            f"spec decode: mean acceptance length {1 + accepted / drafts:.2f}, "
            f"acceptance rate {100 * accepted / max(proposed, 1):.1f}%, "
            f"per position {', '.join(f'{r:.2f}' for r in per_pos)}"
        )
    return "; ".join(parts)
