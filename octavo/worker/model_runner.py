"""ModelRunner: one SchedulerOutput in, sampled tokens (and logprobs) out."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from octavo.attention.kv_groups import group_layers
from octavo.attention.kv_quant import KV_QUANT_DTYPES
from octavo.attention.quest import with_key_bounds
from octavo.checkpoint.paths import model_path
from octavo.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from octavo.core.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from octavo.core.step_state import BatchState, CachedRequestState, ScheduledRow, seeded_random
from octavo.distributed.communication import all_ranks_min
from octavo.distributed.parallel_state import get_parallel_state
from octavo.kernels.build import default_kernels, prebuild
from octavo.kv_offload.local_tiers import local_tiers
from octavo.kv_offload.transfers import TierReport
from octavo.model.config import load_arch_config
from octavo.model.dtypes import resolve_dtype
from octavo.model.kv_scales import load_static_kv_scales
from octavo.model.layers.moe import moe_blocks
from octavo.model.layers.route_counts import RouteCounts
from octavo.model.loader import load_model
from octavo.model.pooler_config import resolve_pooler
from octavo.outputs import TokenLogprobs
from octavo.sample.generators import request_generator
from octavo.sample.logprobs import token_logprobs
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.rejection import Drafts, verification_rows, verify
from octavo.sample.sampler import Sampler
from octavo.spec_decode.adaptive import SpeculationGovernor
from octavo.spec_decode.proposer import ProposalInput, ProposerContext
from octavo.spec_decode.registry import create_proposer
from octavo.worker.backends import model_backends
from octavo.worker.decode_graphs import DecodeGraphs
from octavo.worker.draft_host import DraftHost
from octavo.worker.input_batch import StepInputs, prepare_inputs
from octavo.worker.kernel_tape import import_recorder_dependencies
from octavo.worker.recorded_decode import can_record, record_decode_steps
from octavo.worker.kv_cache import (
    allocate_kv_caches,
    copy_blocks,
    num_cache_blocks,
)
from octavo.worker.pooler import Pooler

logger = logging.getLogger(__name__)


@dataclass
class _LogitRows:
    """Which hidden rows need logits this step, and why."""

    sample: list[ScheduledRow] = field(default_factory=list)
    # A sampling request's last row, or with k proposals its last k + 1 rows.
    sample_rows: list[int] = field(default_factory=list)
    # (scheduled request, first row, number of prompt targets)
    prompt: list[tuple[ScheduledRow, int, int]] = field(default_factory=list)

    def rows(self) -> list[int]:
        prompt_rows = [r for _, first, n in self.prompt for r in range(first, first + n)]
        return self.sample_rows + prompt_rows


@dataclass
class _Draw:
    """One sampler pass over some of the step's requests: request i emitted
    ``token_ids[i]``, the logits of its j-th token are row ``row_starts[i] + j``
    of ``logprobs``."""

    requests: list[CachedRequestState]
    token_ids: list[list[int]]
    row_starts: list[int]
    logprobs: Optional[torch.Tensor]
    max_num_logprobs: Optional[int]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        memory_share: float = 1.0,
        speculative_config: Optional[SpeculativeConfig] = None,
    ) -> None:
        """``memory_share``: this rank's part of the KV cache memory budget
        (see ``num_cache_blocks``)."""
        folder = model_path(model_config.model)
        self.device = torch.device(model_config.device)
        if self.device.type == "cpu":
            prebuild(default_kernels())  # compiled side by side while the checkpoint loads (cold starts)
            import_recorder_dependencies()
        arch = load_arch_config(folder)
        if arch.quantization is not None and model_config.quantization is not None:
            raise ValueError(f"quantization {model_config.quantization!r} quantizes a float checkpoint while "
                             f"loading it; {folder} is already quantized ({arch.quantization.method}, as its "
                             "config.json or GGUF file says): leave quantization unset")
        self.dtype = resolve_dtype(model_config.dtype, arch.dtype)
        cache_dtype = KV_QUANT_DTYPES.get(cache_config.kv_cache_dtype) or resolve_dtype(
            cache_config.cache_dtype, str(self.dtype).removeprefix("torch.")
        )
        self.backends = model_backends(model_config, self.device, self.dtype, cache_dtype, arch.layer_windows)
        # An embedding model: every request pools its prompt's hidden states, no logits.
        pooler_config = resolve_pooler(model_config)
        self.pooler = Pooler(pooler_config) if pooler_config is not None else None
        self.model, self.arch = load_model(
            folder, model_config.dtype, self.device, model_config.max_model_len, self.backends,
            lm_head=self.pooler is None,
        )
        self.max_model_len = self.arch.max_model_len(model_config.max_model_len)
        self.vocab_size = self.arch.vocab_size

        self.block_size = cache_config.block_size
        # Each rank caches its own layers (pipeline) and KV heads (tensor) only.
        self.kv_cache_specs = self.model.kv_cache_specs(self.block_size, cache_dtype)
        if model_config.sparse_attention is not None:
            self.kv_cache_specs = with_key_bounds(self.kv_cache_specs, arch.layer_windows)
        # Grouped from the whole model, so every rank agrees; this rank's layers share tensors by slot.
        groups = group_layers(arch.layer_windows)
        local = self.model.model.layer_range
        self._layer_groups = [groups.group_of(layer) for layer in local]
        slots = [groups.slot_of(layer) for layer in local]
        slot_specs = list(dict(zip(slots, self.kv_cache_specs)).values())
        spec = speculative_config or SpeculativeConfig()
        # The most rows of a step: a verifying request has 1 + k of them, as has a draft's catch-up after it.
        max_rows = scheduler_config.max_num_seqs * (1 + spec.num_speculative_tokens if spec.enabled else 1)
        # Built before the pool is sized: a draft model's cache shares the
        # target's block ids, so the pool is sized for both, per block.
        self._draft_host = DraftHost(model_config, cache_config, self.max_model_len)
        context = ProposerContext(model_config, cache_config, self.device, self.max_model_len, self.arch,
                                  self._draft_host, scheduler_config.max_num_batched_tokens)
        self.proposer = create_proposer(spec, context)
        self.kv_cache_windows = groups.windows  # for the scheduler's block tables
        self.num_blocks = num_cache_blocks(
            cache_config, [*slot_specs, *self._draft_host.kv_cache_specs], self.device,
            scheduler_config.max_num_seqs * self.max_model_len, memory_share,
        )
        static_scales = (load_static_kv_scales(self.model, folder, cache_dtype)
                         if cache_config.kv_cache_dtype != "auto" else None)
        use_graphs = self._can_use_graphs(model_config)
        # Recorded steps pad batches with rows that write into one extra block the scheduler never hands out;
        # window groups name it (the scheduler's null block) where they released a block.
        padding = int(use_graphs or any(w is not None for w in groups.windows))
        self.kv_caches = allocate_kv_caches(self.kv_cache_specs, self.backends.attention, self.num_blocks,
                                            self.device, static_scales, padding_blocks=padding, slots=slots)
        self._draft_host.allocate(self.num_blocks, max_rows, self._longest_sequence())
        # The tiers below the pool hold every tensor indexed by block id: the draft's caches too. Each
        # once: the layers of a slot (one per KV cache group) share theirs.
        state = get_parallel_state()
        drafts = [m.kv_caches for m in self._draft_host.models]
        tensors = list({id(t): t for caches in [self.kv_caches, *drafts] for c in caches
                        for t in (c.data, c.scales, c.key_bounds) if t is not None}.values())
        models = [folder, *(model_path(d) for d in (spec.speculative_model,) if d is not None)]
        rank = state.pp_rank * state.tp_size + state.tp_rank
        self.kv_tiers = local_tiers(cache_config, tensors, models, rank, state.tp_size * state.pp_size,
                                    functools.partial(all_ranks_min, device=self.device), len(groups.windows))
        self._tier_report = TierReport()  # what the tiers did since the last step's output

        self.sampler = Sampler(argmax=self.backends.ops.argmax)
        self.batch = BatchState()  # the requests this rank holds, kept across steps
        self._grammar: Optional[GrammarBitmask] = None  # this step's, for the sampler
        self._generators: dict[str, torch.Generator] = {}
        torch.manual_seed(model_config.seed)  # unseeded requests draw from the global RNG
        self.num_speculative_tokens = spec.num_speculative_tokens
        # A model proposer's q of the proposals sent back, until verified.
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.governor = SpeculationGovernor(spec.num_speculative_tokens, spec.speculative_adaptive,
                                            spec.speculative_max_batch_size)
        # A mixture's routing statistics (None for a dense model), masking out recorded steps' padding rows.
        self.route_counts = RouteCounts.attach(moe_blocks(self.model), max_rows, self.device)
        self._graphs: Optional[DecodeGraphs] = None
        if use_graphs:
            self._graphs = record_decode_steps(self.model, self.kv_caches, self.num_blocks, self.block_size,
                                               max_rows, self._longest_sequence(), self.backends.attention,
                                               self.device, self._layer_groups,
                                               None if self.route_counts is None else self.route_counts.rows)
        self.decode_batch_sizes = self._graphs.sizes if self._graphs is not None else ()
        self._last_end: Optional[float] = None  # CPU time when the previous step left the runner
        self._last_cost = 0.0  # ... and what that step cost in it
        self._speculated = 0  # the governor's choice in the previous step: proposals per request
        self._last_batch = 0  # ... and the requests that decoded in it

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self._execute(scheduler_output)
        if self._tier_report:
            out.kv_tiers, self._tier_report = self._tier_report, TierReport()
        return out

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # The governor's clock is the process's CPU time: on a shared machine
        # wall time swings with other processes' load, which would decide for
        # or against speculation at random; CPU time is the work each mode
        # costs (and an idle engine between steps spends none).
        start = time.process_time()
        # A gap far longer than a step is not per-step overhead: the process
        # was busy with something else (another engine, a request burst's
        # tokenizing) and would make long steps look cheap.
        if self.proposer is not None and self._last_end is not None and start - self._last_end <= 4 * self._last_cost:
            self.governor.record_overhead(start - self._last_end, self._last_batch, self._speculated)
        with torch.inference_mode():
            step = self._forward(scheduler_output)
            if step is None:
                return ModelRunnerOutput()
            inputs, hidden = step
            if hidden is None:
                return ModelRunnerOutput()  # a pipeline stage before the last
            if self.pooler is not None:
                pooled = self.pooler.pool(inputs.order, inputs.q_starts, hidden, self.model.final_hidden)
                return ModelRunnerOutput(pooled=pooled)
            plan = _plan_logit_rows(inputs)
            row_ids = plan.rows()
            if not row_ids:
                return ModelRunnerOutput()
            rows = torch.tensor(row_ids, dtype=torch.int64, device=self.device)
            # In the model's dtype: the sampler converts when it needs float32.
            # Under tensor parallelism only the driver rank gets the logits.
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            out = ModelRunnerOutput()
            if logits is None:
                return out
            num_sample = len(plan.sample_rows)
            if plan.sample:
                self._sample(plan.sample, logits[:num_sample], out)
            if plan.prompt:
                _prompt_logprobs(plan, logits[num_sample:].float(), out)
            if self.proposer is not None:
                self._speculate(plan, inputs, hidden, out, start)
        return out

    def _speculate(
        self, plan: _LogitRows, inputs: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput, start: float
    ) -> None:
        """Propose as many tokens as the governor says pays at this batch size,
        and tell it what this step cost per emitted token.

        Seeded random requests propose ``num_speculative_tokens`` whatever the
        governor says: their tokens depend on the proposals they were verified
        against, and a choice made from timings would make them unreproducible."""
        batch = len(plan.sample)
        k = self.governor.proposals(batch)
        if k or (self.batch.seeded_random and any(_needs_steady_proposals(s.request) for s in plan.sample)):
            self._propose(inputs, hidden, out, k)
        end = self._last_end = time.process_time()
        self._last_cost = end - start
        # By the governor's choices (not by the proposals made): a step counts
        # when it verified and proposed as many as the choice before it;
        # and only when it was all decodes: a prompt chunk's cost would be
        # charged to whichever choice happened to be on. A step of single-token
        # rows whose every request sampled emitted one token each: told without
        # reading the rows one by one, which at batch 32 cost ~1% of a plain step.
        if inputs.attn[0].num_decodes == len(inputs.order) and len(out.sampled_token_ids) == batch:
            self.governor.record([1] * batch, end - start, self._speculated, k)
        elif all(s.num_tokens == 1 + len(s.spec_token_ids) for s in inputs.order):
            emitted = [len(out.sampled_token_ids.get(s.request.request_id, ())) for s in plan.sample]
            self.governor.record(emitted, end - start, self._speculated, k)
        self._speculated, self._last_batch = k, batch

    def execute_logits(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run the step like ``execute`` (the K/V are written) but return the
        float32 logits of every scheduled position, ``[num_tokens, vocab]`` per
        request, instead of sampling. For scoring and for parity checks."""
        if self.pooler is not None:
            # Built without an LM head: its step ends in pooled vectors, never in logits.
            raise ValueError("execute_logits needs a model served with task 'generate'; "
                             "this one is served with task 'embed' (it has no language-model head)")
        with torch.inference_mode():
            step = self._forward(scheduler_output)
            if step is None:
                return {}
            inputs, hidden = step
            if hidden is None:
                return {}  # a pipeline stage before the last
            logits = self.model.compute_logits(hidden)
            if logits is None:
                return {}  # not the driver rank
            logits = logits.float()
        return {
            s.request.request_id: logits[first : first + s.num_tokens]
            for s, first in zip(inputs.order, inputs.q_starts)
        }

    def moe_routing_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by layer, of this rank's mixture-of-experts layers."""
        return {} if self.route_counts is None else self.route_counts.read()

    def _forward(self, scheduler_output: SchedulerOutput) -> Optional[tuple[StepInputs, Optional[torch.Tensor]]]:
        """Apply the step to the batch state (drop finished requests, add new
        ones, extend the others), apply block copies, run the model. None when
        nothing is scheduled."""
        # A preempted request keeps its generator: it resumes the same random
        # stream, so its seeded output does not depend on the KV pool's size.
        for request_id in scheduler_output.finished_request_ids - scheduler_output.preempted_request_ids:
            self._generators.pop(request_id, None)
        if self.proposer is not None and scheduler_output.finished_request_ids:
            for request_id in scheduler_output.finished_request_ids:
                self._draft_probs.pop(request_id, None)
            self.proposer.remove_requests(scheduler_output.finished_request_ids)
        if self.pooler is not None:
            self.pooler.forget(scheduler_output.finished_request_ids)
        rows = self.batch.apply(scheduler_output)
        self._grammar = scheduler_output.grammar
        if self.kv_tiers is not None:
            self.kv_tiers.apply(scheduler_output.kv_transfers)  # before anything of the step writes the pool
            done = self.kv_tiers.finish_loads(wait=not scheduler_output.scheduled)
            self._tier_report.loaded += done.loaded
            self._tier_report.failed += done.failed
            self._tier_report.failed_writes += done.failed_writes
        copy_blocks(self.kv_caches, scheduler_output.block_copies)
        self._draft_host.copy_blocks(scheduler_output.block_copies)
        if not rows:
            return None
        inputs = prepare_inputs(rows, self.block_size, self.backends.attention, self.device)
        graphs = self._graphs
        first = inputs.attn[0]
        if graphs is not None and not first.prefills and graphs.takes(first.num_decodes):
            hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.attn)
        else:
            metas = [inputs.attn[g] for g in self._layer_groups]
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metas)
        if self.route_counts is not None:
            self.route_counts.commit()  # the forward ran to its end: its routes count, once
        return inputs, hidden

    def _can_use_graphs(self, model_config: ModelConfig) -> bool:
        """Decode steps replay recordings (CUDA graphs with the Triton backend, kernel tapes on CPU with the
        native one; ``recorded_decode.can_record``) at one rank (no collectives or stage hand-offs inside a
        recording), for generating models (an embedding model never decodes). Speculative verification steps
        replay them too: their rows are decode rows (``StepLayout.num_short``)."""
        state = get_parallel_state()
        return (can_record(self.model, self.backends.attention, self.device, model_config.enforce_eager)
                and state.tp_size == 1 and state.pp_size == 1 and self.pooler is None)

    def _longest_sequence(self) -> int:
        """The most tokens one sequence can reach: max_model_len, or fewer where the pool holds fewer
        (the scheduler's rule). The recorded steps' block tables are this long: sized by max_model_len
        alone, a context of 2^24 made them 2 GiB for a pool of 64 blocks."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def _sample(self, scheduled: list[ScheduledRow], logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Draw the batch's tokens (verify its proposals) in one pass. Should
        building its inputs or the draw raise (one request's penalties, masks
        or grammar mask), draw request by request instead, so that only the
        failing requests fail (``out.failed``): a rare, slow path that keeps
        the common one free of per-row guards. Retrying is safe: the draw
        changes no request state (grammars advance on the scheduler side,
        after the step)."""
        try:
            draws = [self._draw(scheduled, logits)]
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling each request alone", len(scheduled))
            draws = []
            first = 0
            for s in scheduled:
                num_rows = len(s.spec_token_ids) + 1
                try:
                    draws.append(self._draw([s], logits[first : first + num_rows]))
                except Exception as exc:
                    out.failed[s.request.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
                first += num_rows
        for draw in draws:
            self._record(draw, out)
        for s in scheduled:
            self._draft_probs.pop(s.request.request_id, None)  # verified now, or never

    def _draw(self, scheduled: list[ScheduledRow], logits: torch.Tensor) -> _Draw:
        requests = [s.request for s in scheduled]
        generators = [self._generator(r) for r in requests]
        if not any(s.spec_token_ids for s in scheduled):
            meta = SamplingMetadata.from_requests(
                requests, generators, self.vocab_size, device=self.device, grammar=self._grammar
            )
            result = self.sampler(logits, meta)
            tokens = [[t] for t in result.token_ids.tolist()]
            return _Draw(requests, tokens, list(range(len(requests))), result.logprobs, meta.max_num_logprobs)
        rows = verification_rows(scheduled, generators)
        meta = SamplingMetadata.from_requests(
            rows.states, rows.generators, self.vocab_size, device=self.device, grammar=self._grammar,
            positions=rows.positions,
        )
        result = verify(logits, meta, self._drafts(scheduled), self.backends.ops.argmax)
        return _Draw(requests, result.token_ids, rows.row_starts, result.logprobs, meta.max_num_logprobs)

    def _drafts(self, scheduled: list[ScheduledRow]) -> Drafts:
        specs = [s.spec_token_ids for s in scheduled]
        ids = torch.tensor([t for spec in specs for t in spec], dtype=torch.int64, device=self.device)
        probs = None
        if any(s.request.request_id in self._draft_probs for s in scheduled):
            # The scheduler may have kept only a prefix of the proposals.
            parts = []
            for s, spec in zip(scheduled, specs):
                q = self._draft_probs.get(s.request.request_id)
                if q is None:  # no q kept (a deterministic guess): one-hot
                    q = torch.nn.functional.one_hot(
                        torch.tensor(spec, dtype=torch.int64, device=self.device), self.vocab_size
                    ).float()
                parts.append(q[: len(spec)])
            probs = torch.cat(parts)
        return Drafts([len(spec) for spec in specs], ids, probs)

    @staticmethod
    def _record(draw: _Draw, out: ModelRunnerOutput) -> None:
        requests = draw.requests
        out.sampled_token_ids.update({r.request_id: tokens for r, tokens in zip(requests, draw.token_ids)})
        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not wanted or draw.logprobs is None:
            return
        rows = [draw.row_starts[i] + j for i in wanted for j in range(len(draw.token_ids[i]))]
        chosen = [t for i in wanted for t in draw.token_ids[i]]
        device = draw.logprobs.device
        entries = iter(token_logprobs(
            draw.logprobs.index_select(0, torch.tensor(rows, device=device)),
            torch.tensor(chosen, device=device), draw.max_num_logprobs,
        ))
        for i in wanted:
            mine = [next(entries) for _ in draw.token_ids[i]]
            for entry in mine:
                entry.top = entry.top[: requests[i].sampling_params.logprobs]
            out.logprobs[requests[i].request_id] = mine

    def _propose(self, inputs: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput, k: int) -> None:
        """Ask the proposer for up to ``k`` next tokens of each sampled request
        (``num_speculative_tokens`` for seeded random ones); every scheduled row
        is shown: a draft model follows prompt chunks too."""
        rows = []
        for s, first in zip(inputs.order, inputs.q_starts):
            new = out.sampled_token_ids.get(s.request.request_id, [])
            wanted = self.num_speculative_tokens if _needs_steady_proposals(s.request) else k
            row = ProposalInput(s.request, s.start_pos, s.num_tokens, new, self._max_proposals(s.request, new, wanted))
            if self.proposer.needs_hidden_states and new:
                last = first + s.num_tokens - 1 - len(s.spec_token_ids)
                row.hidden_states = hidden[last : last + len(new)]
            rows.append(row)
        for row, proposal in zip(rows, self.proposer.propose(rows)):
            if proposal.token_ids:
                out.spec_token_ids[row.request_id] = proposal.token_ids
                if proposal.probs is not None:
                    self._draft_probs[row.request_id] = proposal.probs

    def _max_proposals(self, request: CachedRequestState, new: list[int], k: int) -> int:
        """How many of ``k`` proposals could be verified after ``new``: each verified
        one is a context position, and the step emits one token past them."""
        if not new:
            return 0
        num_tokens = request.num_tokens + len(new)
        room = [k, self._longest_sequence() - num_tokens]
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room.append(max_tokens - request.num_output_tokens - len(new) - 1)
        return max(0, min(room))

    def _generator(self, request: CachedRequestState) -> Optional[torch.Generator]:
        return request_generator(self._generators, request, self.device)


def _needs_steady_proposals(request: CachedRequestState) -> bool:
    """A seeded random request: its output must not depend on the governor."""
    return seeded_random(request.sampling_params)


def _plan_logit_rows(inputs: StepInputs) -> _LogitRows:
    plan = _LogitRows()
    for s, first in zip(inputs.order, inputs.q_starts):
        if s.sample:
            plan.sample.append(s)
            last = first + s.num_tokens - 1
            plan.sample_rows.extend(range(last - len(s.spec_token_ids), last + 1))
        req = s.request
        # Prompt logprobs come from the first pass only: a recompute after
        # preemption (outputs already exist) would report them twice.
        if req.sampling_params.prompt_logprobs is None or req.num_output_tokens:
            continue
        # Row for position p scores prompt token p + 1.
        targets = min(s.start_pos + s.num_tokens, req.num_prompt_tokens - 1) - s.start_pos
        if s.start_pos < req.num_prompt_tokens:
            plan.prompt.append((s, first, max(targets, 0)))
    return plan


def _prompt_logprobs(plan: _LogitRows, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
    targets: list[int] = []
    for s, _, n in plan.prompt:
        targets += s.request.prompt_token_ids[s.start_pos + 1 : s.start_pos + 1 + n]
    entries: list[TokenLogprobs] = []
    if targets:
        ids = torch.tensor(targets, dtype=torch.int64, device=logits.device)
        most = max(s.request.sampling_params.prompt_logprobs for s, _, _ in plan.prompt)
        entries = token_logprobs(torch.log_softmax(logits, dim=-1), ids, most)
    offset = 0
    for s, _, n in plan.prompt:
        mine = entries[offset : offset + n]
        for entry in mine:
            entry.top = entry.top[: s.request.sampling_params.prompt_logprobs]
        out.prompt_logprobs[s.request.request_id] = mine
        offset += n
