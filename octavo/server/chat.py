"""POST /v1/chat/completions."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from octavo.openai.disconnect import until_disconnected
from octavo.openai.errors import bad_request
from octavo.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageOut,
    StructuredOutputs,
    Tool,
    ToolCall,
    Usage,
)
from octavo.outputs import RequestOutput
from octavo.server.logprobs import chat_logprobs, prompt_logprobs_body
from octavo.server.params import build_sampling_params, request_api_names
from octavo.server.admission import Reservation
from octavo.server.state import ServerState
from octavo.server.streams import collect, primed, sse, sse_response
from octavo.server.tools import ToolPlan, plan_tools

# Template variables a request sets through their own fields, not chat_template_kwargs.
_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, state: ServerState, reservation: Reservation) -> Response:
    state.check_model(req.model)
    state.check_task(embeddings=False)
    state.check_engine()
    state.check_limits(req)
    # Template rendering and tokenization take time in proportion to the
    # request: in a thread, so the event loop keeps serving everyone else.
    prompt_ids, params, plan = await asyncio.to_thread(prepare_chat, req, state)
    state.admit(reservation, 1, req.priority)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.generate(prompt_ids, params, req.priority, _api_names(req, plan))
    if req.stream:
        stream = await primed(raw, stream)
        return sse_response(_stream(req, state, plan, request_id, len(prompt_ids), stream))
    out = await until_disconnected(raw, collect(stream, prompt_ids))
    choices = []
    for c in out.outputs:
        lp = None
        if req.logprobs and c.logprobs is not None:
            lp = chat_logprobs(state.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
        message = plan.output().message(c.text, c.finish_reason)
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(role="assistant", content=message.content, tool_calls=message.tool_calls),
                logprobs=lp,
                finish_reason=message.finish_reason,
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
    *,
    continue_final_message: bool = False,
    tools: Optional[list[dict[str, Any]]] = None,
    documents: Optional[list[dict[str, Any]]] = None,
) -> str:
    """Chat template -> prompt text (also used by /tokenize). Blocking: call it in a thread."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(set add_generation_prompt to false to continue the final message)",
            "continue_final_message",
        )
    plain = [_plain_message(i, m) for i, m in enumerate(messages)]
    kwargs = dict(kwargs or {})
    reserved = next((k for k in _RESERVED_TEMPLATE_VARIABLES if k in kwargs), None)
    if reserved is not None:
        raise bad_request(f"chat_template_kwargs.{reserved}: set it as the request field {reserved}", "chat_template_kwargs")
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
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            **kwargs,
        )
    except (ValueError, TypeError) as exc:
        raise bad_request(f"could not apply the chat template: {exc}", "messages") from None
    return text


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
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            message[key] = getattr(m, key)
    if m.tool_calls:
        message["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(m.tool_calls)]
    return message


def _template_call(i: int, j: int, call: ToolCall) -> dict[str, Any]:
    """A call as templates read it: arguments as an object (they write it
    with tojson), as vLLM and transformers hand it over."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"messages.{i}.tool_calls.{j}.function.arguments is not valid JSON: {exc}", "messages"
        ) from None
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def template_tools(tools: Optional[list[Tool]]) -> Optional[list[dict[str, Any]]]:
    """The ``tools`` template variable, as transformers passes the request's tools."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def prepare_chat(req: ChatCompletionRequest, state: ServerState) -> tuple[list[int], Any, ToolPlan]:
    """Prompt ids, sampling parameters and tool plan of a chat request (/v1/responses too). Blocking."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    plan = plan_tools(req, state.config)
    text = render_messages(
        req.messages, state, req.add_generation_prompt, req.chat_template_kwargs, req.chat_template,
        continue_final_message=req.continue_final_message,
        tools=template_tools(req.tools),
        documents=req.documents,
    )
    state.check_text_length(text, "messages")
    # The template writes BOS and role markers itself: by default (as vLLM) the tokenizer adds nothing more.
    ids = state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > 0:
        ids = ids[-req.truncate_prompt_tokens :]
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = state.check_prompt_ids(ids, requested, param="messages")
    # The tool plan's grammar and detokenizing are sampling fields like any other.
    update: dict[str, Any] = {}
    if plan.schema is not None:
        update["structured_outputs"] = StructuredOutputs(json=plan.schema)
    if plan.needs_special_tokens:
        update["skip_special_tokens"] = False
    params = build_sampling_params(
        req.model_copy(update=update) if update else req,
        max_tokens=max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        defaults=state.client.info.generation_defaults,
        vocab_size=state.client.info.vocab_size,
        max_logprobs=state.client.info.max_logprobs,
        api_names=_api_names(req, plan),
    )
    return ids, params, plan


def _api_names(req: ChatCompletionRequest, plan: ToolPlan) -> dict[str, str]:
    renames = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    names = request_api_names(req, renames)
    if plan.schema is not None:  # a schema the grammar engine refuses is one of the tools'
        names["structured_outputs"] = "tools"
    return names


async def _stream(
    req: ChatCompletionRequest,
    state: ServerState,
    plan: ToolPlan,
    request_id: str,
    num_prompt_tokens: int,
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    created = int(time.time())

    completion_tokens = 0
    per_chunk = req.stream_options is not None and req.stream_options.usage_per_chunk

    def chunk(choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> str:
        if usage is None and per_chunk:
            usage = _usage(num_prompt_tokens, completion_tokens)
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices, usage=usage))

    # OpenAI opens each choice with a role-only delta.
    for i in range(req.n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatMessageOut(role="assistant", content=""))])
    readers = [plan.output() for _ in range(req.n)]
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for out in stream:  # deltas: each choice's new part
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs and c.logprobs is not None:
                    lp = chat_logprobs(state.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
                deltas, finish_reason = readers[c.index].delta(c.text, c.finish_reason)
                if not deltas and (lp is not None or finish_reason is not None):
                    deltas = [ChatMessageOut()]  # text held back (a call in the making): still report these
                for j, delta in enumerate(deltas):
                    last = j == len(deltas) - 1
                    yield chunk([ChatChunkChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=lp if j == 0 else None,
                        finish_reason=finish_reason if last else None,
                        stop_reason=c.stop_reason if last else None,
                    )])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], _usage(num_prompt_tokens, completion_tokens))


def _usage(num_prompt_tokens: int, completion: int) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion, total_tokens=num_prompt_tokens + completion)
