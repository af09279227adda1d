"""POST /v1/embeddings: one vector per input, from a model served with --task embed.

Each input is its own engine request (prefill only, see octavo/pooling.py);
they run batched like any requests. ``encoding_format`` base64 is the vector's
float32 little-endian bytes, which is what the openai client asks for by
default and decodes with numpy."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import Response

from octavo.openai.disconnect import until_disconnected
from octavo.openai.embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from octavo.openai.errors import bad_request
from octavo.outputs import RequestOutput
from octavo.pooling import PoolingParams
from octavo.server.admission import Reservation
from octavo.server.state import ServerState
from octavo.server.streams import merge


async def create_embedding(req: EmbeddingRequest, raw: Request, state: ServerState, reservation: Reservation) -> Response:
    state.check_model(req.model)
    state.check_task(embeddings=True)
    state.check_engine()
    pooler = state.client.info.pooler
    try:
        pooler.check_dimensions(req.dimensions)
    except ValueError as exc:
        raise bad_request(str(exc), "dimensions") from None
    # Tokenizing many long texts takes a while: off the event loop.
    prompts = await asyncio.to_thread(_tokenized, req, state)
    state.admit(reservation, len(prompts), req.priority)
    params = PoolingParams(dimensions=req.dimensions)
    streams = [state.generate(ids, params, req.priority, {}) for ids in prompts]
    finals = await until_disconnected(raw, _collect(streams))
    data = []
    for i, out in enumerate(finals):
        if out.embedding is None:  # aborted under us (shutdown): no vector to give
            raise bad_request("the request ended before its embedding was computed", "input")
        data.append(EmbeddingData(index=i, embedding=_encode(out.embedding, req.encoding_format)))
    num_tokens = sum(len(ids) for ids in prompts)
    body = EmbeddingResponse(data=data, model=state.model_name,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
    return Response(body.model_dump_json(), media_type="application/json")


def _tokenized(req: EmbeddingRequest, state: ServerState) -> list[list[int]]:
    inputs = req.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]  # one text, or one input as token ids
    if not inputs:
        raise bad_request("input must not be empty", "input")
    limit = state.config.limits.max_prompts
    if len(inputs) > limit:
        raise bad_request(f"input has {len(inputs)} entries; at most {limit} are allowed", "input")
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            if not item:
                raise bad_request("input must not contain empty strings", "input")
            state.check_text_length(item, "input")
            item = state.client.info.pooler.embedding_ids(state.tokenizer, item, req.add_special_tokens)
        state.check_prompt_ids(item, 0, param="input")  # empty, outside the vocabulary, too long
        prompts.append(list(item))
    return prompts


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    async with contextlib.aclosing(merge(streams)) as merged:
        async for i, out in merged:
            if out.finished:
                finals[i] = out
    return finals  # type: ignore[return-value]


def _encode(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
