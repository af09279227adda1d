"""The data that crosses the scheduler / model-runner boundary (torch-free)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from octavo.kv_offload.transfers import KVTransfer, TierReport
from octavo.outputs import TokenLogprobs
from octavo.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen (new, a fork sibling, or resumed
    after preemption), sent once: the workers keep it until its id is in
    ``finished_request_ids``."""

    request_id: str
    prompt_token_ids: list[int]
    # Outputs so far: empty unless a preempted request resumes (it recomputes them).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]


@dataclass
class ScheduledRequest:
    """One request's share of a step, as a delta on what the workers hold:
    compute the tokens at positions ``start_pos .. start_pos + num_tokens - 1``
    and, when ``sample`` is set, sample the next token from the last
    position's logits. ``new_token_ids`` extend the worker's token list (the
    tokens sampled since it last saw the request). ``block_ids`` holds one list
    per KV cache group: that group's table from index ``blocks_from`` on, the
    blocks this step writes and any after them (copy-on-write may have replaced
    the block a step writes into, so that one is always sent). Entries before
    it change only when a sliding-window group releases them; the worker keeps
    its stale ids, which lie outside every window still to be read.
    ``new`` is set on the request's first step on the workers.

    Speculative decoding: ``spec_token_ids`` are proposals (from the previous
    step's ``ModelRunnerOutput.spec_token_ids``) placed after the request's
    last token; they are the last ``len(spec_token_ids)`` of the
    ``num_tokens`` positions, are not part of the request's tokens, and are
    verified this step: the sampler emits the accepted ones plus one token.
    The block table covers them (and any lookahead slots of the proposer)."""

    request_id: str
    start_pos: int
    num_tokens: int
    new_token_ids: list[int]
    blocks_from: int
    block_ids: list[list[int]]
    sample: bool
    new: Optional[NewRequestData] = None
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class GrammarBitmask:
    """Structured output, computed on the scheduler side where the grammar
    matchers live: for each listed request that samples this step, the tokens
    its grammar allows, packed 32 per int32 word (token t at bit t % 32 of
    word t // 32), row i for ``request_ids[i]``. ``terminated`` lists the
    requests whose grammar is complete (only EOS may follow).

    With speculative proposals, request i has ``num_positions[i]`` rows (its
    k proposals + 1), in order: row j is the grammar's mask after the first
    j proposals, and ``terminated_at`` gives, per request, the first j > 0 at
    which the grammar is complete."""

    request_ids: list[str]
    num_words: int
    bitmask: bytes  # sum(num_positions) x num_words int32, native byte order
    terminated: set[str] = field(default_factory=set)
    num_positions: Optional[list[int]] = None  # None: one row per request
    terminated_at: dict[str, int] = field(default_factory=dict)

    def first_rows(self) -> dict[str, int]:
        """Request id -> its first row of ``bitmask``."""
        counts = self.num_positions or [1] * len(self.request_ids)
        starts = itertools.accumulate(counts, initial=0)
        return dict(zip(self.request_ids, starts))


@dataclass
class SchedulerOutput:
    """One step, the whole of what crosses from the scheduler to the workers:
    plain data (ids, token ids, parameters), never scheduler objects, so that
    it can be serialized once and broadcast to every rank."""

    scheduled: list[ScheduledRequest]
    # Copy-on-write: copy K/V of block src into block dst before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests that left since the last step (finished, aborted, preempted);
    # the workers drop their state (a preempted one keeps its random generator
    # and comes back as ``new`` data).
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    grammar: Optional[GrammarBitmask] = None
    # Moves between the pool and the tiers below it (octavo/kv_offload/),
    # applied in order before the block copies and the forward.
    kv_transfers: list[KVTransfer] = field(default_factory=list)
    # Loads from disk started in earlier steps and not reported done: the
    # workers must see a step (even an empty one) to finish them.
    kv_loads_in_flight: bool = False

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def needs_workers(self) -> bool:
        """Anything for the workers to do: run tokens, copy or move blocks, finish
        loads from disk or drop the state of requests that left (else it would stay there)."""
        return bool(self.scheduled or self.block_copies or self.finished_request_ids or self.kv_transfers
                    or self.kv_loads_in_flight)


@dataclass
class ModelRunnerOutput:
    # Only requests that sampled this step appear; a partial prefill chunk does
    # not. With speculative decoding a list holds the accepted proposals, then
    # the token the target sampled (a correction or the bonus token).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding: tokens proposed to follow the sampled ones, for the
    # scheduler to have verified next step (a model proposer's distributions
    # stay on the driver rank). Absent or empty: no proposal.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per scheduled prompt chunk: logprobs of each prompt token given its prefix
    # (the first prompt token has none, so it is absent from the list). For a
    # chunk starting at start_pos, entry i is for prompt position
    # start_pos + 1 + i: the logits of a position score the token after it.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests whose own sampling-side work raised (penalties, masks,
    # logprobs): request id -> message. They sampled nothing; the
    # scheduler ends them with an error, the rest of the step stands.
    failed: dict[str, str] = field(default_factory=dict)
    # Embedding models: a request's pooled hidden state, once its prompt's
    # last chunk is computed (octavo/worker/pooler.py).
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # The KV tiers: loads from disk finished (or failed) and files not written since the last output.
    kv_tiers: TierReport = field(default_factory=TierReport)


@dataclass
class EngineCoreOutput:
    """What the scheduler reports for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[TokenLogprobs]] = None
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None  # set with finish_reason "error"
    pooled: Optional[list[float]] = None  # an embedding request's vector, with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about the loaded model (from the driver rank)."""

    vocab_size: int
    max_model_len: int
    # Per KV cache group, its sliding window (None: keeps every position), for the scheduler's KVCacheManager.
    kv_cache_windows: tuple[Optional[int], ...] = (None,)
    # The batch sizes decode steps are recorded at (worker/decode_graphs.py): a decode step of n rows runs at the
    # smallest one >= n, padded. Empty where decode steps run at their own size.
    decode_batch_sizes: tuple[int, ...] = ()
