"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out."""
from __future__ import annotations

import dataclasses
import os
import logging
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Optional

from octavo.checkpoint.paths import model_path
from octavo.config import EngineConfig
from octavo.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from octavo.core.request import Request, RequestStatus
from octavo.core.scheduler import Scheduler
from octavo.core.structured_output import StructuredOutputBackend, StructuredOutputGrammar
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.kv_events_publisher import KVEventPublisher
from octavo.engine.request_state import RequestState, SequenceState
from octavo.engine.routing_stats import RoutingStatsReader
from octavo.engine.stats import EngineStats, StepStats
from octavo.executor.registry import create_executor
from octavo.kv_offload.index import TierIndex
from octavo.model.config import load_arch_config
from octavo.model.generation_config import GenerationDefaults, load_generation_defaults
from octavo.model.pooler_config import resolve_pooler
from octavo.outputs import RequestMetrics, RequestOutput
from octavo.pooling import PoolingParams
from octavo.sampling_params import RequestOutputKind, SamplingParams
from octavo.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """Work for one request failed below the engine (runner or scheduler)."""


class LLMEngine:
    """Owns the tokenizer, the scheduler and the executor (which runs the
    model, in this process or in one worker process per rank). Not
    thread-safe: one caller drives ``add_request`` / ``abort_request`` /
    ``step``; ``shutdown`` stops the workers."""

    def __init__(self, config: EngineConfig) -> None:
        model_dir = model_path(config.model.model)
        self.config = config
        # Set when the model serves embeddings (--task): then every request is one.
        self.pooler_config = resolve_pooler(config.model)
        if self.pooler_config is not None and config.speculative.enabled:
            raise ValueError("speculative decoding does not apply to an embedding model (task embed): "
                             "leave speculative_method and speculative_model unset")
        self.tokenizer = Tokenizer(config.model.tokenizer or config.model.model)
        self.executor = create_executor(config)
        try:
            info = self.executor.model_info
            self.vocab_size = info.vocab_size
            self.max_model_len = info.max_model_len
            # The folder as the user named it: a symlink ("current" -> "v3") is served under its own name.
            names = config.model.served_model_name or (Path(os.path.abspath(model_dir)).name,)
            self.model_name, self.model_aliases = names[0], names[1:]
            # generation_config.json is read here, from the model folder, not by
            # the workers: its sampling defaults fill the fields a request leaves
            # unset (the server and `octavo generate` apply them), its stop
            # tokens end sequences (config.json's when it names none).
            defaults = load_generation_defaults(model_dir)
            source = config.model.generation_config
            if source in ("vllm", "none"):
                defaults = GenerationDefaults(eos_token_ids=defaults.eos_token_ids)
            elif source != "auto":
                if not (Path(source) / "generation_config.json").is_file():
                    raise ValueError(f"generation_config: no generation_config.json in {source}")
                defaults = load_generation_defaults(source)
            self.generation_defaults = {
                k: v for k, v in dataclasses.asdict(defaults).items() if v is not None and k != "eos_token_ids"
            }
            eos_ids = list(defaults.eos_token_ids or load_arch_config(model_dir).eos_token_ids)
            if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos_ids:
                eos_ids.insert(0, self.tokenizer.eos_token_id)
            self.eos_token_id: Optional[int] = eos_ids[0] if eos_ids else None
            # Checkpoints with several end tokens (e.g. end-of-turn and end-of-text)
            # stop on any of them; the extra ones act as stop tokens.
            self._extra_eos_ids = eos_ids[1:]
            num_blocks = self.executor.determine_num_kv_blocks()
            offload = None
            if config.cache.kv_offload_enabled:
                offload = TierIndex(self.executor.collective_rpc("kv_tier_layout"), config.cache.block_size)
            self.scheduler = Scheduler(
                config.scheduler, config.cache, num_blocks, self.max_model_len, config.speculative,
                info.kv_cache_windows, offload,
            )
            self._routing = RoutingStatsReader(self.executor)
            self._kv_events: Optional[KVEventPublisher] = None
            if config.cache.kv_events_endpoint:
                self.scheduler.kv_cache_manager.enable_events()
                self._kv_events = KVEventPublisher(config.cache.kv_events_endpoint)
        except BaseException:
            self.executor.shutdown()
            raise
        self._requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step()
        # Steps submitted to the executor, oldest first, with whether they
        # went to the workers and the requests whose grammar mask failed.
        self._in_flight: deque[tuple[SchedulerOutput, bool, dict[str, str]]] = deque()
        self._grammar_backend: Optional[StructuredOutputBackend] = None  # built at the first constrained request
        self._grammar_ids: set[str] = set()  # sequences with a grammar
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = StepStats()
        # Called with each batch once scheduled, before its forward: the engine process
        # records what a step that hangs was running (and, asked to, every step's work).
        self.on_step_scheduled: Optional[Callable[[SchedulerOutput], None]] = None

    # ---- requests -------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> None:
        """Queue one request; raises ValueError for input the engine cannot serve.
        ``PoolingParams``: an embedding request (the model must serve embeddings),
        whose final output carries ``embedding``.

        All or nothing: whatever it raises, no part of the request stays queued."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            self._add_request(request_id, prompt, params, priority, arrival_time)
        except RecursionError:
            # A structure nested past Python's recursion limit somewhere in the
            # request (a JSON schema, usually): bad input, not an engine fault.
            self._remove(request_id, RequestStatus.FINISHED_ABORTED)
            raise ValueError("the request is too deeply nested (structured_outputs?)") from None
        except BaseException:
            self._remove(request_id, RequestStatus.FINISHED_ABORTED)  # no output: the caller gets the exception
            raise

    def _add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        arrival_time: Optional[float],
    ) -> None:
        # A copy validates again (fields may have been set since construction)
        # and keeps later changes by the caller away from the running request.
        params, pooling = self._for_task(dataclasses.replace(params))
        prompt_text, prompt_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens :]
        self._check_prompt(prompt_ids, params)
        params.check_vocab(self.vocab_size)
        params = self._resolve_params(params, len(prompt_ids))
        num_seqs = params.best_of or params.n
        grammars = self._compile_grammars(params, num_seqs)

        state = RequestState(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_ids,
            params=params,
            child_ids=[],
            sequences={},
            metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()),
            pooling=pooling,
        )
        seq_params = params
        if num_seqs > params.n and params.logprobs is None:
            # Ranking by cumulative logprob needs the chosen tokens' logprobs;
            # the output leaves them out again (state.params keeps logprobs None).
            seq_params = dataclasses.replace(params, logprobs=0)
        children: list[Request] = []
        for i in range(num_seqs):
            child_id = request_id if num_seqs == 1 else f"{request_id}#{i}"
            child_params = seq_params
            if params.seed is not None and i > 0:
                # Each sequence of a seeded request draws its own, reproducible stream.
                child_params = dataclasses.replace(seq_params, seed=params.seed + i)
            children.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=prompt_ids,
                    sampling_params=child_params,
                    eos_token_id=self.eos_token_id,
                    priority=priority,
                    arrival_time=state.metrics.arrival_time,
                    fork_of=children[0].request_id if i > 0 else None,
                    pooling=self.pooler_config.pooling_type if pooling is not None else None,
                )
            )
            if grammars:
                children[-1].grammar = grammars[i]
            state.child_ids.append(child_id)
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
                if params.detokenize
                else None
            )
            state.sequences[child_id] = SequenceState(index=i, detokenizer=detok)
        self._requests[request_id] = state
        for child in children:
            self._child_to_parent[child.request_id] = request_id
            if child.grammar is not None:
                self._grammar_ids.add(child.request_id)
            self.scheduler.add_request(child)
        self._prompt_tokens += len(prompt_ids)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Cancel requests in any state; their blocks return to the pool now and
        each yields a final output with finish_reason "abort"."""
        for request_id in request_ids:
            state = self._remove(request_id, RequestStatus.FINISHED_ABORTED)
            if state is None:
                continue
            try:
                state.finish_all("abort")
                out = state.make_output()
                if out is not None:
                    self._pending.append(out)
            except Exception as exc:  # the final detokenization of this one request
                self._pending.append(_error_output(state, exc))

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self._requests) or bool(self._pending) or bool(self._in_flight)
            or self.scheduler.has_unfinished_requests()
            # One more step after the last request ends, so that the ranks drop
            # its state now rather than whenever the next request comes.
            or self.scheduler.has_finished_to_send()
        )

    # ---- the step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step's results (with pipeline stages, the oldest of
        the steps in flight, after topping them up). An exception from here
        is an engine failure (the forward itself, or a rank gone); anything
        that goes wrong for one request (its sampling, bookkeeping or
        detokenization) ends that request with ``RequestOutput.error`` set
        and its blocks freed, and the other requests carry on."""
        outputs, self._pending = self._pending, []
        self._fill_pipeline()
        sched_out, submitted, grammar_failed = self._in_flight.popleft()
        runner_out = self.executor.collect() if submitted else ModelRunnerOutput()
        if submitted:
            self._routing.step_ran()
        runner_out.failed.update(grammar_failed)
        progressed: dict[str, RequestState] = {}
        stopped: list[str] = []
        for core_out in self.scheduler.update_from_output(sched_out, runner_out):
            parent = self._child_to_parent.get(core_out.request_id)
            if parent is None:
                continue  # aborted or failed meanwhile
            state = self._requests[parent]
            try:
                self._apply(state, core_out, stopped)
            except Exception as exc:
                outputs.append(self._fail(state, exc))
                progressed.pop(parent, None)
                continue
            progressed[parent] = state
        if stopped:
            # Ids of requests failed meanwhile are gone from the scheduler: ignored.
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for request_id, state in progressed.items():
            try:
                out = self._output_of(request_id, state)
            except Exception as exc:
                out = self._fail(state, exc)
            if out is not None:
                outputs.append(out)
        if self._kv_events is not None:
            self._kv_events.publish(self.scheduler.kv_cache_manager.take_events())
        self._routing.maybe_read(nothing_in_flight=not any(sent for _, sent, _ in self._in_flight),
                                 idle=not self.has_unfinished_requests())
        return outputs

    def _apply(self, state: RequestState, core_out: EngineCoreOutput, stopped: list[str]) -> None:
        if core_out.error is not None:
            raise RequestFailedError(core_out.error)
        if state.pooling is not None and core_out.finish_reason == "length":  # its prompt is computed
            if core_out.pooled is None:
                raise RequestFailedError("the model runner returned no embedding")
            state.embedding = self.pooler_config.shorten(core_out.pooled, state.pooling.dimensions)
            # Done because its vector is, not cut at a limit: "stop", as vLLM reports
            # pooling requests (the scheduler says "length" for any prompt-only request).
            core_out = dataclasses.replace(core_out, finish_reason="stop")
        stop = state.apply(core_out)  # may cut new_token_ids at a stop string
        self._generation_tokens += len(core_out.new_token_ids)
        if stop is not None:
            stopped.append(core_out.request_id)

    def _output_of(self, request_id: str, state: RequestState) -> Optional[RequestOutput]:
        # best_of > n ranks the candidates once all are done.
        hold = state.params.best_of is not None and state.params.best_of > state.params.n
        if state.finished:
            self._remove(request_id, RequestStatus.FINISHED_STOPPED)  # the scheduler is done with it already
        elif hold or state.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        return state.make_output()

    def _fail(self, state: RequestState, exc: Exception) -> RequestOutput:
        """End one request whose own work raised: free its sequences' blocks
        (the scheduler's abort path) and report the error as its final output."""
        if not isinstance(exc, RequestFailedError):
            logger.exception("request %s failed", state.request_id)
        self._remove(state.request_id, RequestStatus.FINISHED_ERROR)
        return _error_output(state, exc)

    def _fill_pipeline(self) -> None:
        """Schedule and submit steps until the executor holds as many as it
        can run at once (one, without pipeline stages) or nothing more can be
        scheduled: a request whose step is in flight has no token to compute
        until its result is back, so later steps hold other requests or
        further prompt chunks."""
        while len(self._in_flight) < self.executor.max_concurrent_batches:
            sched_out = self.scheduler.schedule()
            if self._in_flight and not sched_out.needs_workers:
                return  # nothing new: wait for the oldest step
            grammar_failed = self._attach_grammar(sched_out) if self._grammar_ids else {}
            submitted = sched_out.needs_workers
            # Before submitting: the in-process executor runs the forward
            # inside submit, and the queue time must not include it.
            self._note_first_scheduled(sched_out)
            if sched_out.scheduled:
                sched = self.config.scheduler
                self._steps.observe(sched_out.total_num_tokens, len(sched_out.scheduled),
                                    sched.max_num_batched_tokens, sched.max_num_seqs)
                if self.on_step_scheduled is not None:
                    self.on_step_scheduled(sched_out)
            if submitted:
                self.executor.submit(sched_out)
            self._in_flight.append((sched_out, submitted, grammar_failed))
            if sched_out.is_empty:
                return

    def _attach_grammar(self, sched_out: SchedulerOutput) -> dict[str, str]:
        """Pack what the grammars of the requests sampling this step allow
        into the step (the grammars stay here; the scheduler advances them
        with the sampled tokens). A grammar that raises fails its request
        alone: its row goes unmasked and its token is discarded. Returns
        those requests' errors."""
        from octavo.sample.structured import grammar_bitmask

        rows = [s for s in sched_out.scheduled if s.sample and s.request_id in self._grammar_ids]
        if not rows:
            return {}
        backend = self._grammar_backend
        assert backend is not None, "a request has a grammar, so the backend that compiled it exists"
        ids = [s.request_id for s in rows]
        grammars = [self.scheduler.get_request(rid).grammar for rid in ids]
        # Proposals being verified need a mask at each of their positions.
        proposals = [s.spec_token_ids for s in rows]
        try:
            sched_out.grammar = grammar_bitmask(backend, ids, grammars, self.vocab_size, proposals)
            return {}
        except Exception:
            logger.exception("grammar masks of %d requests failed; computing each alone", len(ids))
        failed: dict[str, str] = {}
        for rid, grammar, spec in zip(ids, grammars, proposals):
            try:
                grammar_bitmask(backend, [rid], [grammar], self.vocab_size, [spec])
            except Exception as exc:
                failed[rid] = f"structured output failed: {type(exc).__name__}: {exc}"
        good = [i for i, rid in enumerate(ids) if rid not in failed]
        if good:
            sched_out.grammar = grammar_bitmask(
                backend, [ids[i] for i in good], [grammars[i] for i in good], self.vocab_size,
                [proposals[i] for i in good],
            )
        return failed

    def _note_first_scheduled(self, sched_out: SchedulerOutput) -> None:
        now = time.monotonic()
        for scheduled in sched_out.scheduled:
            if scheduled.new is None:
                continue  # sent before: a first schedule always carries the request's data
            parent = self._child_to_parent.get(scheduled.request_id)
            if parent is not None:
                metrics = self._requests[parent].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now

    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        spec = self.scheduler.spec_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_total_blocks=kv.num_total_blocks,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
            steps=self._steps.copy(),
            kv_offload_hits=dict(kv.offload.hits) if kv.offload is not None else {},
            kv_offload_bytes=kv.offload.bytes_held() if kv.offload is not None else {},
            kv_offload_errors=dict(kv.offload.errors) if kv.offload is not None else {},
            moe_routed_tokens=self._routing.routed_tokens,  # replaced, never changed in place, by a read
            moe_load_imbalance=dict(self._routing.load_imbalance),
        )

    def shutdown(self) -> None:
        """Stop the executor's workers (no-op in process); safe to call twice.
        With a disk tier, the blocks of the pool and the host tier are written
        to it first, for the next engine started on the folder."""
        scheduler = getattr(self, "scheduler", None)
        offload = scheduler.kv_cache_manager.offload if scheduler is not None else None
        if offload is not None and not self._in_flight:
            try:
                moves = offload.persist(scheduler.kv_cache_manager.pool.cached_by_age())
                if moves:
                    self.executor.collective_rpc("apply_kv_transfers", (moves,))
            except Exception:  # the workers may be gone (a failed engine): then there is nothing to save
                logger.exception("saving the KV cache to kv_offload_dir failed")
        self.executor.shutdown()
        if self._kv_events is not None:
            self._kv_events.close()
            self._kv_events = None

    # ---- helpers --------------------------------------------------------

    def _remove(self, request_id: str, status: RequestStatus) -> Optional[RequestState]:
        """Forget a request; its sequences still in the scheduler end with
        ``status`` and free their blocks."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.scheduler.finish_requests(state.child_ids, status)
            for child_id in state.child_ids:
                self._child_to_parent.pop(child_id, None)
                self._grammar_ids.discard(child_id)
        return state

    def _tokenize(self, prompt: str | list[int]) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.pooler_config is not None:  # an embedding model: its texts as sentence-transformers makes them
                return prompt, self.pooler_config.embedding_ids(self.tokenizer, prompt)
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("prompt must be a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt contains token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        return None, list(prompt)

    def _for_task(self, params: SamplingParams | PoolingParams) -> tuple[SamplingParams, Optional[PoolingParams]]:
        """The request's sampling parameters, and its pooling ones for an
        embedding request; ValueError when the model serves the other task."""
        if isinstance(params, PoolingParams):
            if self.pooler_config is None:
                raise ValueError("this model serves text generation (task generate), not embeddings; "
                                 "serve an embedding model, or this one with --task embed")
            self.pooler_config.check_dimensions(params.dimensions)
            # Prefill only: the scheduler computes the prompt and ends the
            # request (max_tokens 0), whose one output is the final one.
            sampling = SamplingParams(max_tokens=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
            return sampling, params
        if self.pooler_config is not None:
            raise ValueError("this model serves embeddings (task embed), not text generation: "
                             "use LLM.embed or /v1/embeddings")
        return params, None

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be <= {limit} (the engine's max_logprobs), got {value}")
        requested = len(prompt_ids) + (params.max_tokens or 0)
        if len(prompt_ids) > self.max_model_len or (
            params.max_tokens is not None and requested > self.max_model_len
        ):
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {requested} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens or 0} for the completion)."
            )

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        changes: dict = {}
        if params.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - prompt_len
        if self._extra_eos_ids and not params.ignore_eos:
            extra = [t for t in self._extra_eos_ids if t not in params.stop_token_ids]
            if extra:
                changes["stop_token_ids"] = list(params.stop_token_ids) + extra
        if changes:
            params = dataclasses.replace(params, **changes)
        if params.bad_words:
            params.resolve_bad_words(self.tokenizer)
        return params

    def _compile_grammars(self, params: SamplingParams, num_seqs: int) -> list[StructuredOutputGrammar]:
        """One grammar per sequence of a constrained request (none otherwise);
        ValueError for a constraint the backend cannot serve."""
        if params.structured_outputs is None:
            return []
        if self._grammar_backend is None:
            from octavo.sample.structured_registry import create_structured_output_backend

            eos_ids = [self.eos_token_id, *self._extra_eos_ids] if self.eos_token_id is not None else []
            self._grammar_backend = create_structured_output_backend(self.tokenizer, self.vocab_size, eos_ids)
        return [self._grammar_backend.compile(params.structured_outputs) for _ in range(num_seqs)]


def _error_output(state: RequestState, exc: BaseException) -> RequestOutput:
    """The final output of a failed request: the error and nothing else (its
    partial text may be what broke)."""
    message = str(exc) if isinstance(exc, RequestFailedError) else f"{type(exc).__name__}: {exc}"
    metrics = state.metrics
    metrics.finished_time = time.monotonic()
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[],
        finished=True,
        num_cached_tokens=state.num_cached_tokens,
        metrics=metrics,
        error=message,
    )
