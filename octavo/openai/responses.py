"""Bodies of /v1/responses, OpenAI's Responses API (its text subset): the
request's input items and the response object its stream and answer carry."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from octavo.openai.protocol import _Body, _Request


class InputContent(_Request):
    # input_text in user turns; output_text in assistant turns sent back as received.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputContent]]
    # Set on output items a client sends back.
    id: Optional[str] = None
    status: Optional[str] = None


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Request):
    unsupported = frozenset({"verbosity"})
    format: Optional[TextFormat] = None


class ResponsesRequest(_Body):
    unsupported = frozenset({
        "background", "conversation", "include", "max_tool_calls", "parallel_tool_calls", "prompt",
        "prompt_cache_key", "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier",
        "stream_options", "tool_choice", "tools", "top_logprobs",
    })

    model: Optional[str] = None
    input: Union[str, list[InputMessage]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    text: Optional[TextConfig] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None  # the only behaviour here: too long is a 400
    user: Optional[str] = None
    # Extensions (vLLM's names).
    seed: Optional[int] = None
    priority: int = 0


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: Optional[dict[str, str]] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    previous_response_id: None = None
    store: bool = False
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    metadata: dict[str, str] = Field(default_factory=dict)
