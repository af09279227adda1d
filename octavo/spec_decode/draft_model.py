"""The draft model of speculative decoding: a second, smaller model in the
target's worker, proposing up to k tokens per request and step.

The worker builds and hosts the model (``model_host.DraftModelHost``). Its KV
cache is paged on the target's block ids: block b of a request holds the
target's K/V in the target's tensors and the draft's in the draft's (shaped
for the draft's layers and heads), so the scheduler's allocation, prefix
sharing, copy-on-write and freeing cover both, and the memory sizing counts
both per block. The scheduler reserves k lookahead slots past each step's
positions (``SpeculativeConfig.num_lookahead_slots``): the K/V of the
draft's own guesses go there.

The draft model is replicated, never split: it is built as a single rank
(whole, no collective) and only the driver rank, the one that samples, runs
it. A small draft is cheap to hold whole, and splitting it would add one
collective per draft layer and per proposal step.

After each target step the draft catches up on what the target accepted
(prompt chunks during prefill; the accepted proposals and the new token
during decode) in one forward for all requests, whose last row per request
gives the first proposal; then k - 1 single-token forwards give the others.
While the governor proposes nothing the draft does not run: when proposals
resume it catches up on every token since (on a request it never saw, from
position 0), the leading tokens in forwards of at most the target's step
budget first.
The K/V the draft wrote for its guesses stay valid as far as the target
agreed with them (``_Seq``); past that they are overwritten later.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from octavo.attention.base import SHORT_QUERY, AttentionBackend, AttentionMetadata, StepLayout
from octavo.checkpoint.paths import model_path
from octavo.config import SpeculativeConfig
from octavo.core.step_state import CachedRequestState, ScheduledRow
from octavo.model.config import ArchConfig, load_arch_config
from octavo.sample.generators import request_generator
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import sample_from_probs, warp_logits
from octavo.spec_decode.draft_vocab import head_tokens
from octavo.spec_decode.proposer import Proposal, ProposalInput, Proposer, ProposerContext


@dataclass
class _Seq:
    """What the draft holds of one request: the K/V of positions
    ``< computed``. Of those, positions ``guess_start ..`` were fed its own
    proposals ``guess`` and are valid only as far as the target accepted
    them, and only while the blocks they were written to (``guess_blocks``,
    from block index ``guess_start // block_size``) are still the request's."""

    computed: int
    guess_start: int = 0
    guess: list[int] = field(default_factory=list)
    guess_blocks: list[int] = field(default_factory=list)

    def settle(self, tokens: _Tokens, block_ids: list[int], block_size: int) -> None:
        """Keep the guesses' K/V as far as the request's tokens and blocks confirm them."""
        if not self.guess:
            return
        agreed = 0
        for guess, token in zip(self.guess, tokens[self.guess_start : self.guess_start + len(self.guess)]):
            if guess != token:
                break
            agreed += 1
        first = self.guess_start // block_size
        for i, block in enumerate(self.guess_blocks):
            if first + i >= len(block_ids) or block_ids[first + i] != block:
                # The scheduler took that block back: nothing from it on is held.
                agreed = min(agreed, max((first + i) * block_size - self.guess_start, 0))
                break
        self.computed = min(self.computed, self.guess_start + agreed)
        self.guess = []


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
    """A row of a draft forward, as the worker's step layout reads it."""

    request_id: str
    all_token_ids: _Tokens


@dataclass
class _Proposing:
    """A request the draft proposes for in this step: its tokens continue
    after ``end`` known ones; ``tokens`` are the step's new tokens, then
    the proposals so far."""

    input: ProposalInput
    seq: _Seq
    row: ScheduledRow  # its row in the catch-up forward
    end: int
    cap: int
    tokens: list[int]
    proposal: Proposal = field(default_factory=Proposal)

    @property
    def num_proposed(self) -> int:
        return len(self.tokens) - len(self.input.new_token_ids)


class _DecodeSteps:
    """The draft's decode-shaped forwards of one step, laid out without the worker's general step layout
    (``prepare_inputs``: ~70 us a call, a fifth of a draft forward's time): a catch-up on the few tokens a
    verification emitted, then the proposal loop's single-token forwards. The block table is built once,
    each proposal step only moves the positions on by one. Single-token rows go longest context first, as
    the decode kernel's metadata wants."""

    def __init__(
        self, proposing: list[_Proposing], block_size: int, backend: AttentionBackend, device: torch.device
    ) -> None:
        self.proposing, self.block_size, self.backend, self.device = proposing, block_size, backend, device
        self.order = sorted(range(len(proposing)), key=lambda j: -proposing[j].end)
        # Wide enough for the last guess of every row.
        width = max(-(-(p.end + p.cap - 1) // block_size) for p in proposing)
        self._rows = {j: i for i, j in enumerate(self.order)}
        self._table = torch.tensor(
            [(proposing[j].input.state.block_ids + [0] * width)[:width] for j in self.order],
            dtype=torch.int64, device=device,
        )

    def catch_up(self) -> Optional[tuple[torch.Tensor, torch.Tensor, AttentionMetadata, Optional[torch.Tensor]]]:
        """Token ids, positions and attention metadata of the catch-up forward over the proposing rows, and
        which of its rows is each one's last, in ``proposing`` order (None: every row, in that order); None
        when a row is not decode-shaped (a prompt's chunk, or more than ``SHORT_QUERY`` tokens), which the
        worker lays out."""
        if not all(0 < p.row.start_pos and p.row.num_tokens <= SHORT_QUERY for p in self.proposing):
            return None
        order = [j for j in self.order if self.proposing[j].row.num_tokens == 1]
        num_decodes = len(order)
        order += [j for j in self.order if self.proposing[j].row.num_tokens > 1]
        size = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, lens, context = [], [], []
        for j in order:
            row, blocks = self.proposing[j].row, self.proposing[j].input.state.block_ids
            starts.append(len(ids))
            lens.append(row.num_tokens)
            context.append(row.start_pos + row.num_tokens)
            ids += row.token_ids
            span = range(row.start_pos, context[-1])
            positions += span
            slots += [blocks[pos // size] * size + pos % size for pos in span]
        input_ids, pos, slot_mapping = torch.tensor([ids, positions, slots], dtype=torch.int64, device=self.device)
        needed = [-(-c // size) for c in context]
        layout = StepLayout(
            block_size=size, num_decodes=num_decodes, num_short=len(order) - num_decodes, query_starts=starts,
            query_lens=lens, context_lens=context, blocks_needed=needed,
            block_table=self._table_of(order)[:, : max(needed)], slot_mapping=slot_mapping, device=self.device,
        )
        where = {j: start + n - 1 for j, start, n in zip(order, starts, lens)}
        last = [where[j] for j in range(len(self.proposing))]
        index = None if last == list(range(len(ids))) else torch.tensor(last, dtype=torch.int64, device=self.device)
        return input_ids, pos, self.backend.build_metadata(layout), index

    def _table_of(self, rows: list[int]) -> torch.Tensor:
        """The block table of ``rows`` (request indices), in that order."""
        if rows == self.order:
            return self._table
        index = torch.tensor([self._rows[j] for j in rows], dtype=torch.int64, device=self.device)
        return self._table.index_select(0, index)

    def inputs(self, active: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and attention metadata for feeding each active
        row's latest proposal (``active`` in ``order``)."""
        rows = [self.proposing[j] for j in active]
        size = self.block_size
        positions = [p.end + p.num_proposed - 1 for p in rows]
        context = [pos + 1 for pos in positions]
        # Slots from the requests' own block lists, and one tensor for the three rows of integers: a step's
        # layout is a few microseconds of kernels, so each tensor op saved counts.
        slots = [p.input.state.block_ids[pos // size] * size + pos % size for p, pos in zip(rows, positions)]
        input_ids, pos, slot_mapping = torch.tensor([[p.tokens[-1] for p in rows], positions, slots],
                                                    dtype=torch.int64, device=self.device)
        needed = [-(-c // size) for c in context]
        layout = StepLayout(
            block_size=size, num_decodes=len(rows), query_starts=list(range(len(rows))),
            query_lens=[1] * len(rows), context_lens=context, blocks_needed=needed,
            block_table=self._table_of(active)[:, : needed[0]], slot_mapping=slot_mapping, device=self.device,
        )
        return input_ids, pos, self.backend.build_metadata(layout)


class _Draw:
    """The proposals' draws for one step's proposing requests: greedy rows
    take the draft's argmax; the others draw from the draft's distribution
    after temperature, top-k, top-p and min-p (the target's penalties, bans
    and grammar need not apply: rejection sampling corrects any q), whose
    rows are kept as q. With a cut head (``head``: the token of each logit)
    both choose among its tokens, and q is zero elsewhere."""

    def __init__(
        self,
        requests: list[CachedRequestState],
        generators: list[Optional[torch.Generator]],
        vocab_size: int,
        device: torch.device,
        argmax: Callable[[torch.Tensor], torch.Tensor],
        head: Optional[list[int]] = None,
    ) -> None:
        """``argmax``: the model's (``ElementwiseOps.argmax``: native for contiguous CPU logits,
        where torch's is several times slower on bf16 rows)."""
        self._argmax = argmax
        self._head, self._vocab_size = head, vocab_size
        self.request_ids = [r.request_id for r in requests]
        self.random = [j for j, r in enumerate(requests) if not r.sampling_params.greedy]
        self.meta: Optional[SamplingMetadata] = None
        if self.random:
            meta = SamplingMetadata.from_requests(
                [requests[j] for j in self.random], [generators[j] for j in self.random],
                vocab_size if head is None else len(head), device,
            )
            self.meta = dataclasses.replace(meta, penalties=None, masks=None, grammars=None)
        self._q: dict[int, list[torch.Tensor]] = {j: [] for j in self.random}

    def __call__(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """Tokens for ``logits`` [len(rows), head size], row i being request ``rows[i]``."""
        tokens = self._argmax(logits)
        at = {j: i for i, j in enumerate(self.random)}
        mine = [i for i, j in enumerate(rows) if j in at]
        if mine:
            meta = _select(self.meta, [at[rows[i]] for i in mine])
            index = torch.tensor(mine, dtype=torch.int64, device=logits.device)
            probs = torch.softmax(warp_logits(logits.index_select(0, index).float(), meta), dim=-1)
            tokens = tokens.index_copy(0, index, sample_from_probs(probs, meta.generators))
            for i, q in zip(mine, probs):
                self._q[rows[i]].append(q)
        chosen = tokens.tolist()
        return chosen if self._head is None else [self._head[i] for i in chosen]

    def probs(self) -> dict[int, torch.Tensor]:
        """Request index -> its q over the whole vocabulary, one row per proposal drawn."""
        return {j: self._whole(torch.stack(qs)) for j, qs in self._q.items()}

    def _whole(self, q: torch.Tensor) -> torch.Tensor:
        if self._head is None:
            return q
        index = torch.tensor(self._head, dtype=torch.int64, device=q.device)
        return q.new_zeros(q.shape[0], self._vocab_size).index_copy_(1, index, q)


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
    files = [model_path(f) / "tokenizer.json" for f in (draft_folder, target_folder)]
    if all(f.is_file() for f in files) and _vocab(files[0]) != _vocab(files[1]):
        raise ValueError(
            f"speculative_model {draft_folder!r} has a different tokenizer (tokenizer.json vocabulary) "
            f"from the target model {target_folder!r}"
        )


def _vocab(path: Path) -> dict:
    with open(path) as f:
        data = json.load(f)
    return {"model": data.get("model", {}).get("vocab"), "added": data.get("added_tokens")}


class DraftModelProposer(Proposer):
    """The draft model's proposals, for speculative_method draft_model."""

    def __init__(self, spec_config: SpeculativeConfig, context: ProposerContext) -> None:
        """Has the worker load the draft (``spec_config.speculative_model``) and reserve its cache."""
        draft = spec_config.speculative_model
        if draft is None:
            raise ValueError("speculative_model must name the draft model folder")
        arch = load_arch_config(model_path(draft))
        check_compatible(arch, context.target_arch, draft, context.model_config.model)
        # The tokens of a cut LM head's logits, in order (None: the whole vocabulary).
        self._head = head_tokens(draft, spec_config.speculative_draft_vocab, arch.vocab_size)
        self.model = context.host.load_draft_model(draft, self._head)
        if self.model.arch.max_model_len() < context.max_model_len:
            raise ValueError(
                f"speculative_model {draft!r} handles {self.model.arch.max_model_len()} positions, fewer than "
                f"the model's context length {context.max_model_len}: lower max_model_len"
            )
        self.device = context.device
        self.block_size = context.cache_config.block_size
        self._step_budget = context.max_num_batched_tokens
        self._seqs: dict[str, _Seq] = {}
        self._generators: dict[str, torch.Generator] = {}

    def remove_requests(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self._seqs.pop(rid, None)
            self._generators.pop(rid, None)

    def propose(self, rows: list[ProposalInput]) -> list[Proposal]:
        """Catch up on every row's tokens, then propose for those that may."""
        with torch.inference_mode():
            forward, proposing = self._catch_up(rows)
            if not forward:
                return [Proposal() for _ in rows]
            self._run_ahead(forward)
            if not proposing:  # prompt chunks only
                self.model.run_rows(forward, [])
            else:
                steps = _DecodeSteps(proposing, self.block_size, self.model.attention, self.device)
                # Decode-shaped when every row forwarded proposes (the others are prompt chunks).
                laid_out = steps.catch_up() if len(forward) == len(proposing) else None
                if laid_out is None:
                    logits = self.model.run_rows(forward, [p.row for p in proposing])
                else:
                    input_ids, positions, attn, last = laid_out
                    logits = self.model.run(input_ids, positions, attn)
                    logits = logits if last is None else logits.index_select(0, last)
                self._propose(proposing, logits, steps)
        by_id = {p.input.request_id: p for p in proposing}
        out = []
        for row in rows:
            p = by_id.get(row.request_id)
            out.append(Proposal() if p is None else p.proposal)
        return out

    def _run_ahead(self, forward: list[ScheduledRow]) -> None:
        """Bound the catch-up forward to the target's step budget (``max_num_batched_tokens``): resuming
        after the governor proposed nothing for a while, the draft catches up on every token decoded
        meanwhile, and on whole prompts it never saw. Rows keep their last ``budget // len(forward)``
        tokens (at least one) for the forward that proposes; their leading tokens run first, in forwards of
        at most ``budget`` tokens."""
        keep = max(self._step_budget // len(forward), 1)
        ahead: list[ScheduledRow] = []
        size = 0
        for row in forward:
            start, lead = row.start_pos, row.num_tokens - keep
            while lead > 0:
                n = min(lead, self._step_budget - size)
                ahead.append(ScheduledRow(row.request, start, n, row.block_tables, False))
                start, lead, size = start + n, lead - n, size + n
                if size == self._step_budget:
                    self.model.run_rows(ahead, [])
                    ahead, size = [], 0
            row.num_tokens -= start - row.start_pos
            row.start_pos = start
        if ahead:
            self.model.run_rows(ahead, [])

    def _catch_up(self, rows: list[ProposalInput]) -> tuple[list[ScheduledRow], list[_Proposing]]:
        """The first forward's rows (one per request with tokens to compute),
        and those of them that propose."""
        forward: list[ScheduledRow] = []
        proposing: list[_Proposing] = []
        for inp in rows:
            state = inp.state
            tokens = _Tokens(state.all_token_ids, inp.new_token_ids)
            # A prompt chunk: its positions; a sampling row: every known token.
            end = len(tokens) if inp.new_token_ids else inp.start_pos + inp.num_tokens
            capacity = len(state.block_ids) * self.block_size
            # The positions written: the known tokens, then the guesses fed back.
            cap = max(min(inp.max_proposals, capacity - end + 1), 0) if inp.new_token_ids else 0
            end = min(end, capacity)
            # A request first seen starts from position 0: its prompt may have been prefilled, or the blocks
            # of a cached prefix filled, while the governor proposed nothing and the draft did not run, and
            # what the draft's cache holds there is not its K/V of these tokens.
            seq = self._seqs.setdefault(inp.request_id, _Seq(0))
            seq.settle(tokens, state.block_ids, self.block_size)
            seq.computed = min(seq.computed, end)
            start = seq.computed - 1 if cap and seq.computed == end else seq.computed
            if start >= end:
                continue
            row = ScheduledRow(_Row(inp.request_id, tokens), start, end - start, [state.block_ids], bool(cap))
            forward.append(row)
            seq.computed = end
            if cap:
                proposing.append(_Proposing(inp, seq, row, end, cap, list(inp.new_token_ids)))
        return forward, proposing

    def _propose(self, proposing: list[_Proposing], logits: torch.Tensor, steps: _DecodeSteps) -> None:
        """The first proposal from the catch-up's logits, then one
        single-token forward per further proposal, for the rows that want it."""
        requests = [p.input.state for p in proposing]
        draw = _Draw(requests, [self._generator(r) for r in requests], self.model.arch.vocab_size, self.device,
                     self.model.argmax, self._head)
        active = list(range(len(proposing)))
        while True:
            for j, token in zip(active, draw(logits, active)):
                proposing[j].tokens.append(token)
            active = [j for j in steps.order if proposing[j].num_proposed < proposing[j].cap]
            if not active:
                break
            input_ids, positions, attn = steps.inputs(active)
            logits = self.model.run(input_ids, positions, attn)
        probs = draw.probs()
        for j, p in enumerate(proposing):
            proposals = p.tokens[len(p.input.new_token_ids):]
            p.proposal = Proposal(proposals, probs.get(j))
            # The guesses fed back: all proposals but the last.
            seq, blocks = p.seq, p.input.state.block_ids
            seq.guess_start, seq.guess = p.end, proposals[:-1]
            seq.computed = p.end + len(seq.guess)
            seq.guess_blocks = blocks[p.end // self.block_size : -(-seq.computed // self.block_size)]

    def _generator(self, request: CachedRequestState) -> Optional[torch.Generator]:
        if request.sampling_params.greedy:
            return None
        return request_generator(self._generators, request, self.device)
