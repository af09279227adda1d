"""The engine's numbers as Prometheus metrics, read at scrape time.

They come from the latest EngineStats snapshot the engine process pushed:
its counters and per-step histograms are cumulative already, so they are
exposed as they are, never re-counted here (a restarted engine starts them
from zero again, which Prometheus' ``rate`` treats as a counter reset).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from octavo.config import CacheConfig
from octavo.engine.stats import EngineStats, StepHistogram
from octavo.kv_offload.transfers import TIERS

_GAUGES = (
    ("num_requests_running", "Requests in the engine's running batch.", lambda s: s.num_running),
    ("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", lambda s: s.kv_cache_usage),
    ("kv_free_blocks", "Free KV cache blocks (cached-but-unused blocks count as free).", lambda s: s.num_free_blocks),
    ("kv_total_blocks", "KV cache blocks in the pool.", lambda s: s.num_total_blocks),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
    ("num_preemptions", "Requests preempted (recomputed later).", lambda s: s.num_preemptions),
    ("prompt_tokens", "Prompt tokens processed.", lambda s: s.prompt_tokens),
    ("generation_tokens", "Tokens generated.", lambda s: s.generation_tokens),
    ("spec_decode_num_drafts", "Speculative verifications (request-steps that carried proposals).",
     lambda s: s.spec_num_drafts),
    ("spec_decode_num_draft_tokens", "Speculative proposals verified.", lambda s: s.spec_num_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Speculative proposals accepted.", lambda s: s.spec_num_accepted_tokens),
)
_STEP_HISTOGRAMS = (
    ("iteration_tokens_total", "Tokens computed per engine step (prompt chunks, decodes and proposals).",
     lambda s: s.steps.iteration_tokens),
    ("batch_token_utilization", "Per engine step: tokens scheduled / max_num_batched_tokens.",
     lambda s: s.steps.token_utilization),
    ("batch_seq_utilization", "Per engine step: sequences in the batch / max_num_seqs.",
     lambda s: s.steps.seq_utilization),
)


@dataclass
class EngineSource:
    """Where the collector reads the engine from (callables: the engine may
    be replaced by a restart between two scrapes)."""

    model_name: str
    cache: CacheConfig
    stats: Callable[[], EngineStats]
    num_restarts: Callable[[], int]
    pid: Callable[[], Optional[int]]
    # octavo:moe_expert_tokens per layer and expert: layers x experts series (6144 for Qwen3-30B-A3B), so only
    # when asked (--moe-expert-metrics); the per-layer imbalance is always there.
    moe_expert_metrics: bool = False


class EngineStatsCollector(Collector):
    def __init__(self, source: EngineSource) -> None:
        self._src = source

    def collect(self) -> Iterator[Metric]:
        stats = self._src.stats()
        model = [self._src.model_name]
        for name, doc, get in _GAUGES:
            family = GaugeMetricFamily(f"octavo:{name}", doc, labels=["model_name"])
            family.add_metric(model, float(get(stats)))
            yield family
        for name, doc, get in _COUNTERS:
            yield _counter(f"octavo:{name}", doc, model, float(get(stats)))
        for name, doc, get in _STEP_HISTOGRAMS:
            yield _histogram(f"octavo:{name}", doc, model, get(stats))
        family = CounterMetricFamily(
            "octavo:spec_decode_num_accepted_tokens_per_pos",
            "Speculative proposals accepted, by position in the proposal (0 = first).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(stats.spec_accepted_per_position):
            family.add_metric([*model, str(position)], float(count))
        yield family
        hits = CounterMetricFamily("octavo:kv_offload_hits", "Prompt tokens whose K/V were loaded into the pool "
                                   "from a tier below it, by medium.", labels=["model_name", "medium"])
        held = GaugeMetricFamily("octavo:kv_offload_bytes", "Bytes of KV blocks a tier below the pool holds "
                                 "(all ranks), by medium.", labels=["model_name", "medium"])
        for medium in TIERS:
            hits.add_metric([*model, medium], float(stats.kv_offload_hits.get(medium, 0)))
            held.add_metric([*model, medium], float(stats.kv_offload_bytes.get(medium, 0)))
        yield hits
        yield held
        errors = CounterMetricFamily("octavo:kv_offload_errors", "Block files the disk tier could not read or write "
                                     "(each block computed again instead), by operation.",
                                     labels=["model_name", "op"])
        for op in ("read", "write"):
            errors.add_metric([*model, op], float(stats.kv_offload_errors.get(op, 0)))
        yield errors
        yield from self._moe_routing(stats)
        yield _counter("octavo:engine_restarts", "Times the engine process died and was restarted.", model,
                       float(self._src.num_restarts()))
        yield self._cache_info(stats)

    def _moe_routing(self, stats: EngineStats) -> Iterator[Metric]:
        model = self._src.model_name
        imbalance = GaugeMetricFamily(
            "octavo:moe_load_imbalance",
            "Mixture-of-experts layers: tokens routed to the busiest expert over the mean per expert, in the "
            "last window the engine read (1 = even).", labels=["model_name", "layer"])
        for layer, value in stats.moe_load_imbalance.items():
            imbalance.add_metric([model, str(layer)], value)
        yield imbalance
        routed = CounterMetricFamily(
            "octavo:moe_expert_tokens",
            "Mixture-of-experts layers: (token, choice) pairs routed to each expert (--moe-expert-metrics).",
            labels=["model_name", "layer", "expert"])
        if self._src.moe_expert_metrics:
            for layer, counts in stats.moe_routed_tokens.items():
                for expert, count in enumerate(counts):
                    routed.add_metric([model, str(layer), str(expert)], float(count))
        yield routed

    def _cache_info(self, stats: EngineStats) -> Metric:
        cache = self._src.cache
        labels = {
            "model_name": self._src.model_name,
            "block_size": str(cache.block_size),
            "num_blocks": str(stats.num_total_blocks),
            "cache_dtype": cache.cache_dtype,
            "kv_cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching).lower(),
        }
        family = GaugeMetricFamily("octavo:cache_config_info", "KV cache configuration (labels); the value is 1.",
                                   labels=list(labels))
        family.add_metric(list(labels.values()), 1.0)
        return family


def _counter(name: str, doc: str, labels: list[str], value: float) -> Metric:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _histogram(name: str, doc: str, labels: list[str], hist: StepHistogram) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, hist.bounds), "+Inf"], hist.counts):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    family.add_metric(labels, buckets, hist.sum)
    return family
