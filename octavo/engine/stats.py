"""A snapshot of the engine's state and counters, for metrics and logs."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


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
