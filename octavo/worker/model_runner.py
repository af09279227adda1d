"""ModelRunner: one SchedulerOutput in, sampled tokens (and logprobs) out."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from octavo.config import CacheConfig, ModelConfig, SchedulerConfig
from octavo.core.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from octavo.core.step_state import BatchState, CachedRequestState, ScheduledRow
from octavo.model.config import load_arch_config
from octavo.model.loader import load_model, model_folder, resolve_dtype
from octavo.outputs import TokenLogprobs
from octavo.sample.logprobs import token_logprobs
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import Sampler, SamplerOutput
from octavo.worker.backends import model_backends
from octavo.worker.input_batch import StepInputs, prepare_inputs
from octavo.worker.kv_cache import (
    CacheShape,
    allocate_kv_caches,
    copy_blocks,
    num_cache_blocks,
)

logger = logging.getLogger(__name__)


@dataclass
class _LogitRows:
    """Which hidden rows need logits this step, and why."""

    sample: list[ScheduledRow] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # (scheduled request, first row, number of prompt targets)
    prompt: list[tuple[ScheduledRow, int, int]] = field(default_factory=list)

    def rows(self) -> list[int]:
        prompt_rows = [r for _, first, n in self.prompt for r in range(first, first + n)]
        return self.sample_rows + prompt_rows


@dataclass
class _Draw:
    """One sampler pass over some of the step's requests."""

    requests: list[CachedRequestState]
    result: SamplerOutput
    max_num_logprobs: Optional[int]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        memory_share: float = 1.0,
    ) -> None:
        """``memory_share``: this rank's part of the KV cache memory budget
        (see ``num_cache_blocks``)."""
        folder = model_folder(model_config.model)
        self.device = torch.device(model_config.device)
        arch = load_arch_config(folder)
        self.dtype = resolve_dtype(model_config.dtype, arch.dtype)
        cache_dtype = resolve_dtype(cache_config.cache_dtype, str(self.dtype).removeprefix("torch."))
        self.backends = model_backends(model_config, self.device, self.dtype, cache_dtype, arch.layer_windows)
        ops = self.backends.fused_ops
        self.model, self.arch = load_model(
            folder, model_config.dtype, self.device, model_config.max_model_len, self.backends
        )
        self.max_model_len = self.arch.max_model_len(model_config.max_model_len)
        self.vocab_size = self.arch.vocab_size

        self.block_size = cache_config.block_size
        # Each rank caches its own layers (pipeline) and KV heads (tensor) only.
        layers = self.model.local_layers
        shape = CacheShape(len(layers), self.block_size, layers[0].self_attn.num_kv_heads, self.arch.head_dim,
                           cache_dtype)
        self.num_blocks = num_cache_blocks(
            cache_config, shape, self.device, scheduler_config.max_num_seqs * self.max_model_len, memory_share
        )
        self.kv_caches = allocate_kv_caches(shape, self.num_blocks, self.device)

        self.sampler = Sampler(argmax=ops.argmax if ops is not None else None)
        self.batch = BatchState()  # the requests this rank holds, kept across steps
        self._grammar: Optional[GrammarBitmask] = None  # this step's, for the sampler
        self._generators: dict[str, torch.Generator] = {}
        torch.manual_seed(model_config.seed)  # unseeded requests draw from the global RNG

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with torch.inference_mode():
            step = self._forward(scheduler_output)
            if step is None:
                return ModelRunnerOutput()
            inputs, hidden = step
            if hidden is None:
                return ModelRunnerOutput()  # a pipeline stage before the last
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
            num_sample = len(plan.sample)
            if num_sample:
                self._sample(plan.sample, logits[:num_sample], out)
            if plan.prompt:
                _prompt_logprobs(plan, logits[num_sample:].float(), out)
        return out

    def execute_logits(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run the step like ``execute`` (the K/V are written) but return the
        float32 logits of every scheduled position, ``[num_tokens, vocab]`` per
        request, instead of sampling. For scoring and for parity checks."""
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

    def _forward(self, scheduler_output: SchedulerOutput) -> Optional[tuple[StepInputs, Optional[torch.Tensor]]]:
        """Apply the step to the batch state (drop finished requests, add new
        ones, extend the others), apply block copies, run the model. None when
        nothing is scheduled."""
        # A preempted request keeps its generator: it resumes the same random
        # stream, so its seeded output does not depend on the KV pool's size.
        for request_id in scheduler_output.finished_request_ids - scheduler_output.preempted_request_ids:
            self._generators.pop(request_id, None)
        rows = self.batch.apply(scheduler_output)
        self._grammar = scheduler_output.grammar
        copy_blocks(self.kv_caches, scheduler_output.block_copies)
        if not rows:
            return None
        inputs = prepare_inputs(rows, self.block_size, self.backends.attention, self.device)
        return inputs, self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)

    def _sample(self, scheduled: list[ScheduledRow], logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Draw the batch's tokens in one pass. Should building its inputs or
        the draw raise (one request's penalties, masks or grammar mask), draw
        row by row instead, so that only the failing requests fail
        (``out.failed``): a rare, slow path that keeps the common one free of
        per-row guards. Retrying is safe: the draw changes no request state
        (grammars advance on the scheduler side, after the step)."""
        requests = [s.request for s in scheduled]
        try:
            draws = [self._draw(requests, logits)]
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling each request alone", len(requests))
            draws = []
            for i, request in enumerate(requests):
                try:
                    draws.append(self._draw([request], logits[i : i + 1]))
                except Exception as exc:
                    out.failed[request.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
        for draw in draws:
            self._record(draw, out)

    def _draw(self, requests: list[CachedRequestState], logits: torch.Tensor) -> _Draw:
        generators = [self._generator(r) for r in requests]
        meta = SamplingMetadata.from_requests(
            requests, generators, self.vocab_size, device=self.device, grammar=self._grammar
        )
        return _Draw(requests, self.sampler(logits, meta), meta.max_num_logprobs)

    @staticmethod
    def _record(draw: _Draw, out: ModelRunnerOutput) -> None:
        requests, result = draw.requests, draw.result
        tokens = result.token_ids.tolist()
        out.sampled_token_ids.update({r.request_id: [t] for r, t in zip(requests, tokens)})
        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if wanted and result.logprobs is not None:
            idx = torch.tensor(wanted, device=result.logprobs.device)
            entries = token_logprobs(
                result.logprobs.index_select(0, idx), result.token_ids.index_select(0, idx), draw.max_num_logprobs
            )
            for i, entry in zip(wanted, entries):
                entry.top = entry.top[: requests[i].sampling_params.logprobs]
                out.logprobs[requests[i].request_id] = [entry]

    def _generator(self, request: CachedRequestState) -> Optional[torch.Generator]:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen


def _plan_logit_rows(inputs: StepInputs) -> _LogitRows:
    plan = _LogitRows()
    for s, first in zip(inputs.order, inputs.q_starts):
        if s.sample:
            plan.sample.append(s)
            plan.sample_rows.append(first + s.num_tokens - 1)
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
