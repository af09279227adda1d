"""Request bodies of /v1/embeddings and /v1/responses.

Apart from their routes so that the gateway, which must stay torch-free, can
validate these bodies with the very models a replica uses (as it does with
octavo/server/protocol.py for completions and chat)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field

from octavo.server.protocol import _Body, _Request


class EmbeddingRequest(_Body):
    model: Optional[str] = None
    # A text, texts, token ids, or lists of token ids (OpenAI's four shapes).
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # Extensions (vLLM's names).
    priority: int = 0
    add_special_tokens: bool = True



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
