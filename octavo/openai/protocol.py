"""OpenAI API bodies of completions, chat and tokenize (pydantic), and the
checks every request body gets.

An unknown request field is dropped, and named in the list the validation
context's ``IGNORED_FIELDS`` holds (the server logs it and names it in a
response header): clients written for other OpenAI-compatible servers send
their vendor fields. With ``STRICT_FIELDS`` set in the context it is a 400
naming it instead. Fields OpenAI documents that Octavo does not implement
are a 400 either way, with their own message ("not supported"): a client
that sends ``tools`` or ``audio`` and gets plain text with a 200 could not
tell that they were ignored."""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_serializer, model_validator

from octavo.openai.errors import FieldError

_INT64 = 2**63 - 1
# Keys of the validation context (``model_validate(data, context=...)``).
STRICT_FIELDS = "strict_fields"  # True: an unknown field is a 400
IGNORED_FIELDS = "ignored_fields"  # a list that collects the unknown fields dropped


class _Request(BaseModel):
    """Any object of a request body. Its names are checked before its fields:
    all unknown ones in one 400 (pydantic would report one at a time)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    # Names OpenAI's API has here that Octavo does not implement; a null value
    # means "not asked for" (clients that echo response objects send nulls).
    unsupported: ClassVar[frozenset[str]] = frozenset()
    # Whole bodies also get the raw-value walk (see _Body).
    check_raw: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _check_names_first(cls, data: Any, info: ValidationInfo) -> Any:
        if cls.check_raw:
            _check_raw(data)
        if isinstance(data, dict):
            data = _check_names(cls, data, info.context or {})
        return data


class _Body(_Request):
    """A whole request body. Its raw JSON is checked once, before any field,
    for what no field type catches but what breaks later stages: lone UTF-16
    surrogates (JSON allows "\\ud800"; the tokenizer, msgspec and UTF-8
    output all refuse them) and integers outside int64 (msgpack and torch
    overflow). One walk covers every field, present and future, nested
    schemas and dict keys included, and names the path of the bad value."""

    check_raw: ClassVar[bool] = True


def _check_names(cls: type[_Request], data: dict[Any, Any], context: dict[str, Any]) -> dict[Any, Any]:
    """``data`` less its unknown names and the unsupported names it sets to null."""
    known = set(cls.model_fields)
    known.update(f.alias for f in cls.model_fields.values() if f.alias)
    extra = [k for k in data if k not in known]
    if not extra:
        return data
    unsupported = sorted(k for k in extra if k in cls.unsupported and data[k] is not None)
    unknown = sorted(str(k) for k in extra if k not in cls.unsupported)
    if unsupported:
        raise FieldError([unsupported[0]], f"not supported by this server: {', '.join(unsupported)}", named=True)
    if unknown and context.get(STRICT_FIELDS):
        plural = "s" if len(unknown) > 1 else ""
        raise FieldError([unknown[0]], f"unknown field{plural}: {', '.join(unknown)}", named=True)
    if unknown and IGNORED_FIELDS in context:
        context[IGNORED_FIELDS].extend(unknown)
    return {k: v for k, v in data.items() if k in known}


def _check_raw(data: Any) -> None:
    # Runs on the event loop over bodies of up to --max-body-size: scalars
    # are checked inline and a path is built only for containers and errors
    # (2M token ids: 0.1 s; one tuple per value made it 6 s).
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:  # iterative: the body's depth is the client's choice
        path, container = stack.pop()
        if isinstance(container, dict):
            for key in container:
                if isinstance(key, str) and not key.isascii():
                    # The path names the key escaped: the error body must itself be valid UTF-8.
                    _check_text((*path, key.encode("utf-8", "backslashreplace").decode()), key)
            items: Any = container.items()
        elif isinstance(container, list):
            items = enumerate(container)
        else:
            continue
        for key, value in items:
            kind = type(value)
            if kind is str:
                if not value.isascii():
                    _check_text((*path, key), value)
            elif kind is int:
                if value > _INT64 or value < -_INT64 - 1:
                    raise FieldError((*path, key), f"integer out of range (64-bit signed): {value}")
            elif kind is dict or kind is list:
                stack.append(((*path, key), value))


def _check_text(path: tuple[str | int, ...], text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(path, f"invalid Unicode: a lone surrogate at character {exc.start}") from None


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm asks for it).
    continuous_usage_stats: bool = False

    @property
    def usage_per_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class JsonSchemaFormat(_Request):
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(_Request):
    """vLLM-style extension: one of json / regex / choice."""

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None


class SamplingFields(_Body):
    """Fields both endpoints share, including the vLLM extensions."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # Extensions.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    priority: int = 0
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs: Optional[StructuredOutputs] = None

    @model_validator(mode="after")
    def _check_stream_fields(self) -> SamplingFields:
        # OpenAI refuses this too: the options describe a stream that will not exist.
        if self.stream_options is not None and not self.stream:
            raise FieldError(["stream_options"], "stream_options is only allowed when stream is true")
        # As vLLM: stream chunks have no place for them.
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError(["prompt_logprobs"], "prompt_logprobs are not available when stream is true")
        return self


class CompletionRequest(SamplingFields):
    # A string, token ids, or a batch of either (mixed batches are accepted too).
    prompt: Union[str, list[int], list[Union[str, list[int]]]]
    suffix: Optional[str] = None
    echo: bool = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = 16
    best_of: Optional[int] = None
    # vLLM extension: whether text prompts get the tokenizer's special tokens (BOS).
    add_special_tokens: bool = True


class ContentPart(_Request):
    # Other part types carry other keys; the handler names the type it refuses.
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None


class FunctionCall(_Request):
    name: str
    # A JSON text, as OpenAI sends it (templates get it parsed: see octavo/server/chat.py).
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    unsupported = frozenset({"refusal", "audio", "function_call", "tool_calls", "tool_call_id"})

    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    # Assistant turns that called tools, and the tool turns answering them.
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # A reasoning model's earlier thinking (vLLM's name; templates read it).
    reasoning_content: Optional[str] = None
    # In assistant messages the openai client sends back as it received them.
    refusal: Optional[str] = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    unsupported = frozenset({
        "audio", "function_call", "functions", "metadata", "modalities", "parallel_tool_calls", "prediction",
        "prompt_cache_key", "reasoning_effort", "safety_identifier", "service_tier", "store", "tool_choice",
        "tools", "verbosity", "web_search_options",
    })

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Tool]] = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    # Continue the last (assistant) message instead of starting a new one;
    # needs add_generation_prompt false (vLLM's rule).
    continue_final_message: bool = False
    # Passed to the template as `documents` (retrieval-augmented templates).
    documents: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM extension; refused unless the server trusts request templates.
    chat_template: Optional[str] = None
    # vLLM extension: the template writes BOS itself, so by default nothing is added.
    add_special_tokens: bool = False


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # With messages, as vLLM's: the prompt a chat request with these fields would get.
    continue_final_message: bool = False
    tools: Optional[list[Tool]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _chat_fields_need_messages(self) -> "TokenizeRequest":
        if self.messages is None:
            for name in ("tools", "chat_template", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise FieldError([name], f"{name} applies to messages only")
        return self


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


# Responses.
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape for one token at one prompt position."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One per prompt token (None at the first: nothing precedes it): token id -> its logprob.
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    # vLLM extension, where vLLM puts it: on each choice.
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallOut(BaseModel):
    """A whole call in a message; in a stream's delta, a fragment: the first
    carries index, id, type and the name, later ones argument text."""

    index: Optional[int] = None
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None

    @field_serializer("tool_calls")
    def _calls(self, calls: Optional[list[ToolCallOut]]) -> Optional[list[dict[str, Any]]]:
        # Fragments leave out what they do not carry: clients join fields
        # by concatenation, and a null is not text to join.
        return None if calls is None else [c.model_dump(exclude_none=True) for c in calls]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    # vLLM extension, where vLLM puts it for chat: once, beside the choices (one prompt for all).
    prompt_logprobs: Optional[PromptLogprobs] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
