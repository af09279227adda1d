"""The draft model of speculative decoding: a second, smaller model in the
target's worker, proposing k tokens per request and step.

Its KV cache is paged on the target's block ids: block b of a request holds
the target's K/V in the target's tensors and the draft's in the draft's
(shaped for the draft's layers and heads), so the scheduler's allocation,
prefix sharing, copy-on-write and freeing cover both, and the memory sizing
counts both per block. The draft model is replicated, never split: only the
driver rank (the one that samples) builds and runs it, with no collective.

After each target step the draft catches up on what the target accepted
(prompt chunks during prefill; the accepted proposals and the new token
during decode), one forward for all requests, whose last row gives the
first proposal; then k - 1 single-token forwards give the others. The K/V
the draft wrote for its own guesses stay valid as far as the target agreed
with them (``_Seq.guess``); past that they are simply overwritten later.

Positions past a request's allocated blocks (the guesses of a request whose
proposals the target accepted in full, before the scheduler reserves the
next step's blocks) go to scratch blocks past the pool, one range per
proposing row; their K/V only serve the proposal loop that wrote them, so
the request's draft state never counts them as computed.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from octavo.config import CacheConfig, ModelConfig
from octavo.core.step_state import CachedRequestState, ScheduledRow
from octavo.distributed.parallel_state import ParallelState, parallel_state
from octavo.model.config import ArchConfig, load_arch_config
from octavo.model.loader import load_model, model_folder, resolve_dtype
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import _sample_exponential, warp_logits
from octavo.worker.backends import model_backends
from octavo.worker.input_batch import prepare_inputs
from octavo.worker.kv_cache import CacheShape, allocate_kv_caches, copy_blocks

logger = logging.getLogger(__name__)


@dataclass
class DraftInput:
    """One request's share of the draft's work after a target step.

    The request's tokens are ``request.all_token_ids`` followed by
    ``new_token_ids`` (what the step added that the worker's state does not
    hold yet); the draft may compute positions up to ``end_pos`` (exclusive):
    the chunk's end for a prompt chunk, every known token for a request that
    sampled. ``start_pos`` is the first position the target computed this
    step (where a request the draft has not seen starts: earlier positions
    are a prefix-cache hit or a parent's, whose draft K/V are in the blocks)."""

    request: CachedRequestState
    new_token_ids: list[int]
    start_pos: int
    end_pos: int
    block_ids: list[int]
    propose: bool


@dataclass
class DraftProposals:
    """Per request that got proposals: the proposed tokens and, for requests
    that sample at random, the draft distributions q they were drawn from
    (``[len(tokens), vocab]`` float32, after temperature / top-k / top-p /
    min-p, so that rejection sampling against the target is exact). Greedy
    requests have no q: their proposals are the draft's argmax."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    probs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Seq:
    """What the draft holds of one request: the K/V of positions
    ``< computed``; of those, positions ``guess_start ..`` were fed its own
    proposals ``guess``, valid only as far as the target accepted them."""

    computed: int
    guess_start: int = 0
    guess: list[int] = field(default_factory=list)


class _Tokens:
    """A request's tokens without copying them: the worker's list, then the step's new ones."""

    def __init__(self, base: list[int], extra: Sequence[int]) -> None:
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, span: slice) -> list[int]:
        n = len(self.base)
        start, stop = span.start or 0, span.stop if span.stop is not None else len(self)
        return self.base[start:min(stop, n)] + list(self.extra[max(start - n, 0):max(stop - n, 0)])


@dataclass
class _Row:
    """A row of a draft forward, as ``prepare_inputs`` reads it."""

    request_id: str
    all_token_ids: _Tokens


@dataclass
class _Proposing:
    """A request the draft proposes for in this step."""

    input: DraftInput
    seq: _Seq
    row: int  # its row in the catch-up forward
    cap: int  # most proposals
    tokens: list[int]  # the step's new tokens, then the proposals so far
    table: list[int] = field(default_factory=list)  # its blocks, then its scratch blocks

    @property
    def num_proposed(self) -> int:
        return len(self.tokens) - len(self.input.new_token_ids)

    def next_row(self) -> ScheduledRow:
        """The last proposal, fed at its position (``end_pos`` is where the first goes)."""
        tokens = _Tokens(self.input.request.all_token_ids, self.tokens)
        position = self.input.end_pos + self.num_proposed - 1
        return ScheduledRow(_Row(self.input.request.request_id, tokens), position, 1, self.table, True)


class _Draw:
    """The proposals' draws for one step's proposing requests: greedy rows
    take the draft's argmax; the others draw from the draft's distribution
    after temperature, top-k, top-p and min-p (the target's penalties, bans
    and grammar need not apply: rejection sampling corrects any q), whose
    rows are kept as q."""

    def __init__(
        self,
        requests: list[CachedRequestState],
        generators: list[Optional[torch.Generator]],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.request_ids = [r.request_id for r in requests]
        self.random = [j for j, r in enumerate(requests) if not r.sampling_params.greedy]
        self.meta: Optional[SamplingMetadata] = None
        if self.random:
            meta = SamplingMetadata.from_requests(
                [requests[j] for j in self.random], [generators[j] for j in self.random], vocab_size, device
            )
            self.meta = dataclasses.replace(meta, penalties=None, masks=None, grammars=None)
        self._q: dict[int, list[torch.Tensor]] = {j: [] for j in self.random}

    def __call__(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """Tokens for ``logits`` [len(rows), V], row i being request ``rows[i]``."""
        tokens = logits.argmax(dim=-1)
        at = {j: i for i, j in enumerate(self.random)}
        mine = [i for i, j in enumerate(rows) if j in at]
        if mine:
            meta = _select(self.meta, [at[rows[i]] for i in mine])
            index = torch.tensor(mine, dtype=torch.int64, device=logits.device)
            probs = torch.softmax(warp_logits(logits.index_select(0, index).float(), meta), dim=-1)
            tokens = tokens.index_copy(0, index, _sample_exponential(probs, meta.generators))
            for i, q in zip(mine, probs):
                self._q[rows[i]].append(q)
        return tokens.tolist()

    def probs(self) -> dict[str, torch.Tensor]:
        return {self.request_ids[j]: torch.stack(qs) for j, qs in self._q.items()}


def _select(meta: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    """``meta`` for some of its rows, in the given order."""
    if rows == list(range(len(meta.request_ids))):
        return meta
    index = torch.tensor(rows, dtype=torch.int64, device=meta.temperature.device)
    return dataclasses.replace(
        meta,
        request_ids=[meta.request_ids[i] for i in rows],
        temperature=meta.temperature.index_select(0, index),
        top_k=meta.top_k.index_select(0, index),
        top_p=meta.top_p.index_select(0, index),
        min_p=meta.min_p.index_select(0, index),
        generators=[meta.generators[i] for i in rows],
        requests=[meta.requests[i] for i in rows],
    )


def check_compatible(draft: ArchConfig, target: ArchConfig, draft_folder: str, target_folder: str) -> None:
    """ValueError naming ``speculative_model`` unless the draft's tokens mean
    the target's: the same vocabulary size and the same tokenizer."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_model {draft_folder!r} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"model {target_folder!r} {target.vocab_size}: the draft must share the target's tokenizer"
        )
    files = [model_folder(f) / "tokenizer.json" for f in (draft_folder, target_folder)]
    if all(f.is_file() for f in files) and _vocab(files[0]) != _vocab(files[1]):
        raise ValueError(
            f"speculative_model {draft_folder!r} has a different tokenizer (tokenizer.json vocabulary) "
            f"from the target model {target_folder!r}"
        )


def _vocab(path) -> dict:
    import json

    with open(path) as f:
        data = json.load(f)
    return {"model": data.get("model", {}).get("vocab"), "added": data.get("added_tokens")}


class DraftModelRunner:
    """The draft model, its KV cache on the target's block ids, its proposals."""

    def __init__(
        self,
        draft_model: str,
        num_speculative_tokens: int,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_num_seqs: int,
        target_arch: ArchConfig,
        max_model_len: int,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        folder = model_folder(draft_model)
        arch = load_arch_config(folder)
        check_compatible(arch, target_arch, str(draft_model), model_config.model)
        self.k = num_speculative_tokens
        self.device = torch.device(model_config.device)
        dtype = resolve_dtype(model_config.dtype, arch.dtype)
        cache_dtype = resolve_dtype(cache_config.cache_dtype, str(dtype).removeprefix("torch."))
        self.backends = model_backends(model_config, self.device, dtype, cache_dtype, arch.layer_windows)
        # Built as a single rank: whole, replicated, and run without collectives.
        with parallel_state(ParallelState()):
            self.model, self.arch = load_model(folder, model_config.dtype, self.device, max_model_len, self.backends)
        self.max_model_len = min(max_model_len, self.arch.max_model_len(max_model_len))
        self.block_size = cache_config.block_size
        self.shape = CacheShape(arch.num_layers, self.block_size, arch.num_kv_heads, arch.head_dim, cache_dtype)
        # A row's positions past its blocks: the new tokens (at most k + 1)
        # and the k - 1 guesses after them, wherever the blocks end.
        self._scratch_per_row = -(-2 * self.k // self.block_size) + 1
        self._max_rows = max_num_seqs
        self.num_blocks = 0
        self.kv_caches: list[torch.Tensor] = []
        self._seqs: dict[str, _Seq] = {}
        self._generators: dict[str, torch.Generator] = {}

    @property
    def scratch_blocks(self) -> int:
        return self._max_rows * self._scratch_per_row

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache: the pool's ``num_blocks`` plus the scratch blocks."""
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.shape, num_blocks + self.scratch_blocks, self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The target's copy-on-write, applied to the draft's K/V too."""
        copy_blocks(self.kv_caches, copies)

    def drop(self, finished: set[str], preempted: set[str]) -> None:
        """Requests that left the workers. A preempted one recomputes from
        scratch when it returns but keeps its random stream, as the target does."""
        for rid in finished:
            self._seqs.pop(rid, None)
        for rid in finished - preempted:
            self._generators.pop(rid, None)

    # ---- one step -------------------------------------------------------

    def propose(self, inputs: list[DraftInput]) -> DraftProposals:
        """Catch up on every input's tokens, then propose for those that ask."""
        out = DraftProposals()
        with torch.inference_mode():
            rows, proposing = self._catch_up_rows(inputs)
            if not rows:
                return out
            for slot, p in enumerate(proposing):
                first = self.num_blocks + slot * self._scratch_per_row
                p.table = p.input.block_ids + list(range(first, first + self._scratch_per_row))
                rows[p.row] = dataclasses.replace(rows[p.row], block_ids=p.table)
            logits = self._forward(rows, [rows[p.row] for p in proposing])
            if proposing:
                self._propose(proposing, logits, out)
        return out

    def _catch_up_rows(self, inputs: list[DraftInput]) -> tuple[list[ScheduledRow], list[_Proposing]]:
        """The first forward's rows (one per input with tokens to compute)
        and, for those that propose, how many tokens each may propose."""
        rows: list[ScheduledRow] = []
        proposing: list[_Proposing] = []
        for inp in inputs:
            rid = inp.request.request_id
            tokens = _Tokens(inp.request.all_token_ids, inp.new_token_ids)
            seq = self._seqs.setdefault(rid, _Seq(inp.start_pos))
            if seq.guess:
                seq.computed = min(seq.computed, seq.guess_start + _agreed(seq, tokens))
                seq.guess = []
            seq.computed = min(seq.computed, inp.end_pos)
            cap = self._proposal_cap(inp) if inp.propose else 0
            capacity = len(inp.block_ids) * self.block_size
            # Without proposals, only what the blocks hold (scratch is for proposing rows).
            end = inp.end_pos if cap else min(inp.end_pos, capacity)
            start = seq.computed
            if cap and start == end:
                start -= 1  # its K/V are there, but the proposal needs its logits
            if start >= end:
                continue
            if cap:
                proposing.append(_Proposing(inp, seq, len(rows), cap, list(inp.new_token_ids)))
            rows.append(ScheduledRow(_Row(rid, tokens), start, end - start, inp.block_ids, bool(cap)))
            seq.computed = min(end, capacity)
        return rows, proposing

    def _proposal_cap(self, inp: DraftInput) -> int:
        """Proposals worth making: none past the context length, none past the
        last token max_tokens allows (the target adds one of its own)."""
        params = inp.request.sampling_params
        cap = min(self.k, self.max_model_len - inp.end_pos)
        if params.max_tokens is not None:
            outputs = inp.end_pos - inp.request.num_prompt_tokens
            cap = min(cap, params.max_tokens - outputs - 1)
        return max(cap, 0)

    def _forward(self, rows: list[ScheduledRow], sample: list[ScheduledRow]) -> torch.Tensor:
        """Run the draft on ``rows``; the logits of the last position of each of ``sample``."""
        inputs = prepare_inputs(rows, self.block_size, self.backends.attention, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        # prepare_inputs reorders the rows (decodes first): find each one's last row.
        where = {id(s): first + s.num_tokens - 1 for s, first in zip(inputs.order, inputs.q_starts)}
        last = torch.tensor([where[id(s)] for s in sample], dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, last))

    def _propose(self, proposing: list[_Proposing], logits: torch.Tensor, out: DraftProposals) -> None:
        """The first proposal from the catch-up's logits, then one
        single-token forward per further proposal, for the rows that want it."""
        requests = [p.input.request for p in proposing]
        draw = _Draw(requests, [self._generator(r) for r in requests], self.arch.vocab_size, self.device)
        active = list(range(len(proposing)))
        while True:
            for j, token in zip(active, draw(logits, active)):
                proposing[j].tokens.append(token)
            active = [j for j in active if proposing[j].num_proposed < proposing[j].cap]
            if not active:
                break
            rows = [proposing[j].next_row() for j in active]
            logits = self._forward(rows, rows)
        for p in proposing:
            rid = p.input.request.request_id
            proposals = p.tokens[len(p.input.new_token_ids):]
            out.token_ids[rid] = proposals
            # The guesses fed back (all but the last proposal) hold K/V up to
            # where the target will disagree; scratch positions hold none.
            p.seq.guess_start, p.seq.guess = p.input.end_pos, proposals[:-1]
            p.seq.computed = min(p.input.end_pos + len(p.seq.guess), len(p.input.block_ids) * self.block_size)
        out.probs.update(draw.probs())

    def _generator(self, request: CachedRequestState) -> Optional[torch.Generator]:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen


def _agreed(seq: _Seq, tokens: _Tokens) -> int:
    """How many of the draft's guesses the request's tokens confirm."""
    actual = tokens[seq.guess_start : seq.guess_start + len(seq.guess)]
    n = 0
    for guess, token in zip(seq.guess, actual):
        if guess != token:
            break
        n += 1
    return n
