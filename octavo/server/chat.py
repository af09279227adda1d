"""POST /v1/chat/completions."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from octavo.outputs import RequestOutput
from octavo.server.errors import bad_request
from octavo.server.logprobs import chat_logprobs, prompt_logprobs_body
from octavo.server.params import build_sampling_params, request_api_names
from octavo.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageOut,
    Usage,
)
from octavo.server.state import ServerState
from octavo.server.streams import collect, primed, sse, sse_response, until_disconnected



async def create_chat_completion(req: ChatCompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    state.check_engine()
    state.config.limits.check(req)
    # Template rendering and tokenization take time in proportion to the
    # request: in a thread, so the event loop keeps serving everyone else.
    prompt_ids, params = await asyncio.to_thread(_prepare, req, state)
    state.admit(1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.generate(prompt_ids, params, req.priority, _api_names(req))
    if req.stream:
        stream = await primed(raw, stream)
        return sse_response(_stream(req, state, request_id, len(prompt_ids), stream))
    out = await until_disconnected(raw, collect(stream, prompt_ids))
    choices = []
    for c in out.outputs:
        lp = None
        if req.logprobs and c.logprobs is not None:
            lp = chat_logprobs(state.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(role="assistant", content=c.text),
                logprobs=lp,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    body = ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=_usage(len(prompt_ids), sum(len(c.token_ids) for c in out.outputs)))
    if req.prompt_logprobs is not None:
        body.prompt_logprobs = prompt_logprobs_body(state.tokenizer, prompt_ids, out.prompt_logprobs)
    return Response(body.model_dump_json(), media_type="application/json")


def render_messages(
    messages: list[ChatMessage],
    state: ServerState,
    add_generation_prompt: bool,
    kwargs: Optional[dict[str, Any]],
    chat_template: Optional[str] = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Chat template -> token ids (also used by /tokenize). Blocking: call it in a thread.
    The template writes BOS and role markers itself: by default (as vLLM)
    the tokenizer adds nothing more."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    plain = [_plain_message(i, m) for i, m in enumerate(messages)]
    kwargs = dict(kwargs or {})
    # A template may come as its own field (vLLM) or inside chat_template_kwargs.
    for param, template in (("chat_template_kwargs", kwargs.get("chat_template")), ("chat_template", chat_template)):
        if template is not None and not state.config.trust_request_chat_template:
            raise bad_request(
                f"{param}: this server does not accept chat templates in requests "
                "(the operator can allow them with --trust-request-chat-template)",
                param,
            )
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        text = state.tokenizer.apply_chat_template(
            plain,
            add_generation_prompt=add_generation_prompt,
            timeout_s=state.config.limits.max_template_seconds,
            **kwargs,
        )
    except (ValueError, TypeError) as exc:
        raise bad_request(f"could not apply the chat template: {exc}", "messages") from None
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _plain_message(i: int, m: ChatMessage) -> dict[str, Any]:
    if not m.role:
        raise bad_request(f"messages.{i}.role must not be empty", "messages")
    content = m.content
    if isinstance(content, list):
        bad = [p.type for p in content if p.type != "text" or p.text is None]
        if bad:
            raise bad_request(f"messages.{i}.content: only text parts are supported, got {bad[0]!r}", "messages")
        content = "\n".join(p.text for p in content)  # type: ignore[misc]
    message: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.name is not None:
        message["name"] = m.name
    return message


def _prepare(req: ChatCompletionRequest, state: ServerState) -> tuple[list[int], Any]:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    ids = render_messages(req.messages, state, req.add_generation_prompt, req.chat_template_kwargs, req.chat_template,
                          add_special_tokens=req.add_special_tokens)
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > 0:
        ids = ids[-req.truncate_prompt_tokens :]
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = state.check_prompt_ids(ids, requested, param="messages")
    params = build_sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        defaults=state.client.info.generation_defaults,
        vocab_size=state.client.info.vocab_size,
        max_logprobs=state.client.info.max_logprobs,
        api_names=_api_names(req),
    )
    return ids, params


def _api_names(req: ChatCompletionRequest) -> dict[str, str]:
    renames = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    return request_api_names(req, renames)


async def _stream(
    req: ChatCompletionRequest,
    state: ServerState,
    request_id: str,
    num_prompt_tokens: int,
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices, usage=usage))

    # OpenAI opens each choice with a role-only delta.
    for i in range(req.n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatMessageOut(role="assistant", content=""))])
    completion_tokens = 0
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for out in stream:  # deltas: each choice's new part
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs and c.logprobs is not None:
                    lp = chat_logprobs(state.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
                choice = ChatChunkChoice(
                    index=c.index,
                    delta=ChatMessageOut(content=c.text),
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                yield chunk([choice])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], _usage(num_prompt_tokens, completion_tokens))


def _usage(num_prompt_tokens: int, completion: int) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion, total_tokens=num_prompt_tokens + completion)
