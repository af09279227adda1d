"""Request fields -> validated SamplingParams; every failure is a 400 naming the field."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from octavo.openai.errors import APIError, bad_request
from octavo.openai.protocol import SamplingFields
from octavo.sampling_params import SamplingParams, StructuredOutputParams

# Fields copied as they are when the request sets them.
_DIRECT = (
    "n", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "top_k", "min_p",
    "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
    "logit_bias",
)
_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_LEADING_NAME = re.compile(r"^\s*([a-z_]+)")


def build_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: Optional[int],
    logprobs: Optional[int],
    prompt_logprobs: Optional[int],
    defaults: dict[str, Any],
    vocab_size: int,
    best_of: Optional[int] = None,
    api_names: dict[str, str],
    max_logprobs: Optional[int] = None,
) -> SamplingParams:
    """``defaults`` (the model's generation_config) fill fields the request
    left unset; ``api_names`` maps SamplingParams fields back to the names
    this endpoint uses, so the 400 names what the client sent."""
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if k in _PARAM_FIELDS}
    for name in _DIRECT:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    kwargs["max_tokens"] = max_tokens
    kwargs["logprobs"] = logprobs
    kwargs["prompt_logprobs"] = prompt_logprobs
    if best_of is not None:
        kwargs["best_of"] = best_of
    kwargs["structured_outputs"] = structured_outputs(req)
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(vocab_size)
        if max_logprobs is not None:
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > max_logprobs:
                    raise ValueError(f"{name} must be <= {max_logprobs} (the server's --max-logprobs), got {value}")
    except ValueError as exc:
        raise param_error(str(exc), api_names) from None
    return params


def structured_outputs(req: SamplingFields) -> Optional[StructuredOutputParams]:
    fmt = req.response_format
    so = req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise bad_request("set either response_format or structured_outputs, not both", "response_format")
    try:
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputParams(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise bad_request(
                    "response_format.json_schema.schema is required when type is json_schema", "response_format"
                )
            return StructuredOutputParams(json_schema=fmt.json_schema.json_schema)
        if so is not None:
            return StructuredOutputParams(
                json_schema=so.json_, json_object=so.json_object, regex=so.regex, choice=so.choice
            )
    except ValueError as exc:
        raise bad_request(str(exc), "response_format" if fmt is not None else "structured_outputs") from None
    return None


def request_api_names(req: SamplingFields, renames: dict[str, str]) -> dict[str, str]:
    """SamplingParams field -> the request field it came from, where they differ."""
    names = dict(renames)
    if req.response_format is not None:
        names["structured_outputs"] = "response_format"
    return names


def param_error(message: str, api_names: dict[str, str]) -> APIError:
    """A 400 whose param is the field the message starts with, in the request's naming."""
    match = _LEADING_NAME.match(message)
    field = match.group(1) if match else None
    if field not in _PARAM_FIELDS:
        return bad_request(message)
    param = api_names.get(field, field)
    if param != field:
        message = message.replace(field, param, 1)
    return bad_request(message, param)
