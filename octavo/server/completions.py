"""POST /v1/completions (legacy text completions)."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from octavo.openai.disconnect import until_disconnected
from octavo.openai.errors import bad_request
from octavo.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from octavo.outputs import OutputAccumulator, RequestOutput, TokenLogprobs
from octavo.sampling_params import SamplingParams
from octavo.server.logprobs import LegacyLogprobs, aligned_prompt_logprobs, prompt_logprobs_body
from octavo.server.params import build_sampling_params, request_api_names
from octavo.server.admission import Reservation
from octavo.server.state import ServerState
from octavo.server.streams import merge, primed, sse, sse_response

_MAX_LEGACY_LOGPROBS = 5


@dataclass
class _Prompt:
    text: str
    ids: list[int]
    params: SamplingParams


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState, reservation: Reservation) -> Response:
    state.check_model(req.model)
    state.check_task(embeddings=False)
    state.check_engine()
    state.check_limits(req)
    # Tokenizing a long prompt takes seconds: in a thread, off the event loop.
    prompts = await asyncio.to_thread(_prepare, req, state)
    state.admit(reservation, len(prompts), req.priority)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    names = request_api_names(req, {})
    streams = [state.generate(p.ids, p.params, req.priority, names) for p in prompts]
    if req.stream:
        merged = await primed(raw, merge(streams))
        return sse_response(_stream(req, state, request_id, prompts, merged))
    finals = await until_disconnected(raw, _collect(streams, prompts))
    choices = []
    for i, (prompt, out) in enumerate(zip(prompts, finals)):
        for c in out.outputs:
            choice = _ChoiceStream(req, state, prompt).chunk(out.prompt_logprobs, c.text, c.token_ids, c.logprobs)
            choice.index = i * req.n + c.index
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
            if req.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_body(state.tokenizer, prompt.ids, out.prompt_logprobs)
            choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
    body = CompletionResponse(id=request_id, model=state.model_name, choices=choices,
                              usage=_usage(prompts, completion_tokens))
    return Response(body.model_dump_json(), media_type="application/json")


def _prepare(req: CompletionRequest, state: ServerState) -> list[_Prompt]:
    if req.suffix is not None:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.logprobs is not None and not (0 <= req.logprobs <= _MAX_LEGACY_LOGPROBS):
        raise bad_request(f"logprobs must be in [0, {_MAX_LEGACY_LOGPROBS}], got {req.logprobs}", "logprobs")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request("best_of > n cannot be streamed: the best sequences are known only at the end", "best_of")
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs  # echoed prompt tokens carry logprobs too
    prompts = []
    for text, ids in _tokenized(req, state):
        if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > 0:
            ids = ids[-req.truncate_prompt_tokens :]
        max_tokens = state.check_prompt_ids(ids, req.max_tokens)
        params = build_sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=prompt_logprobs,
            best_of=req.best_of,
            defaults=state.client.info.generation_defaults,
            vocab_size=state.client.info.vocab_size,
            max_logprobs=state.client.info.max_logprobs,
            api_names=request_api_names(req, {}),
        )
        prompts.append(_Prompt(text, ids, params))
    return prompts


def _tokenized(req: CompletionRequest, state: ServerState) -> list[tuple[str, list[int]]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]  # one prompt given as token ids
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    result = []
    for p in prompt:
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p, str):
            state.check_text_length(p)
            result.append((p, state.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)))
        else:
            state.check_prompt_ids(p, 0)  # decoding needs ids inside the vocabulary
            result.append((state.tokenizer.decode(p, skip_special_tokens=req.skip_special_tokens), list(p)))
    return result


@dataclass
class _ChoiceStream:
    """One choice's chunks; the first one carries the echoed prompt."""

    req: CompletionRequest
    state: ServerState
    prompt: _Prompt
    started: bool = False
    logprobs: Optional[LegacyLogprobs] = None

    def __post_init__(self) -> None:
        if self.req.logprobs is not None:
            self.logprobs = LegacyLogprobs(self.state.tokenizer, self.req.logprobs, self.req.skip_special_tokens)

    def chunk(
        self,
        prompt_logprobs: Optional[list[Optional[TokenLogprobs]]],
        text: str,
        token_ids: list[int],
        entries: Optional[list],
    ) -> CompletionChoice:
        """``prompt_logprobs``: all of them (echo); the rest: new since the last chunk."""
        ids: list[int] = []
        lps: list = []
        if not self.started and self.req.echo:
            text = self.prompt.text + text
            ids = list(self.prompt.ids)
            lps = aligned_prompt_logprobs(self.prompt.ids, prompt_logprobs)
        self.started = True
        lp = None
        if self.logprobs is not None:
            ids += token_ids
            lps += entries if entries is not None else [None] * len(token_ids)
            lp = self.logprobs.build(ids, lps)
        return CompletionChoice(index=0, text=text, logprobs=lp)


async def _collect(streams: list[AsyncIterator[RequestOutput]], prompts: list[_Prompt]) -> list[RequestOutput]:
    accumulators = [OutputAccumulator(p.ids, p.text) for p in prompts]
    async with contextlib.aclosing(merge(streams)) as merged:
        async for i, out in merged:
            accumulators[i].add(out)
    return [a.take() for a in accumulators]


async def _stream(
    req: CompletionRequest,
    state: ServerState,
    request_id: str,
    prompts: list[_Prompt],
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    created = int(time.time())
    choices: dict[tuple[int, int], _ChoiceStream] = {}
    # Prompt logprobs arrive in pieces (one per prefill chunk); an echo sends them all.
    prompt_logprobs: list[list[Optional[TokenLogprobs]]] = [[] for _ in prompts]
    completion_tokens = 0
    per_chunk = req.stream_options is not None and req.stream_options.usage_per_chunk
    async with contextlib.aclosing(merged):  # type: ignore[type-var]
        async for i, out in merged:  # deltas: each choice's new part
            prompt_logprobs[i].extend(out.prompt_logprobs or ())
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                cs = choices.setdefault((i, c.index), _ChoiceStream(req, state, prompts[i]))
                choice = cs.chunk(prompt_logprobs[i], c.text, c.token_ids, c.logprobs)
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
                choice.index = i * req.n + c.index
                usage = _usage(prompts, completion_tokens) if per_chunk else None
                yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name, choices=[choice],
                                             usage=usage))
    if req.stream_options is not None and req.stream_options.include_usage:
        usage = _usage(prompts, completion_tokens)
        yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name, choices=[], usage=usage))


def _usage(prompts: list[_Prompt], completion_tokens: int) -> Usage:
    prompt_tokens = sum(len(p.ids) for p in prompts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)
