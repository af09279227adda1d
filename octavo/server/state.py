"""What every handler needs: the engine client, the tokenizer, limits, metrics."""
from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from octavo.engine.async_client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineHungError,
    EngineRequestError,
    RequestTimeoutError,
)
from octavo.openai.errors import APIError, bad_request
from octavo.openai.protocol import SamplingFields
from octavo.outputs import RequestOutput
from octavo.pooling import PoolingParams
from octavo.sampling_params import SamplingParams
from octavo.server import metrics
from octavo.server.admission import Admission, Reservation
from octavo.server.config import ServerConfig
from octavo.server.metrics import ServerMetrics
from octavo.server.params import param_error
from octavo.server.shedding import check_shedding
from octavo.tokenizer import Tokenizer


@dataclass
class ServerState:
    client: AsyncEngineClient
    tokenizer: Tokenizer
    config: ServerConfig
    metrics: ServerMetrics
    admission: Admission
    shutting_down: bool = False

    @property
    def model_name(self) -> str:
        return self.client.info.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name requests may use (--served-model-name a b); responses carry the first."""
        return (self.model_name, *self.client.info.model_aliases)

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_task(self, embeddings: bool) -> None:
        """A server serves one task (--task): a request for the other is a 400."""
        serves_embeddings = self.client.info.pooler is not None
        if embeddings and not serves_embeddings:
            raise bad_request(f"the model `{self.model_name}` generates text; it serves no embeddings "
                              "(serve an embedding model, or this one with --task embed)", "model")
        if not embeddings and serves_embeddings:
            raise bad_request(f"the model `{self.model_name}` is an embedding model (task embed): it serves "
                              "/v1/embeddings only, not text generation", "model")

    def check_engine(self) -> None:
        if not self.client.is_alive:
            self.metrics.refused(metrics.REFUSED_ENGINE_DEAD)
            raise APIError(503, f"the engine is not running ({self.client.dead_reason})", code="engine_dead")
        if self.shutting_down:
            self.metrics.refused(metrics.REFUSED_SHUTTING_DOWN)
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def check_limits(self, req: SamplingFields) -> None:
        """The per-field request limits (a 400 naming the field)."""
        try:
            self.config.limits.check(req)
        except APIError:
            self.metrics.refused(metrics.REFUSED_REQUEST_LIMIT)
            raise

    def reserve(self) -> Reservation:
        """A place for one request, taken before its handler awaits anything
        (octavo/server/admission.py). Overload answers 503 (the server, not
        the client, is over its capacity: a rate limit of one client would be
        429) with Retry-After, which OpenAI clients and load balancers honour."""
        try:
            return self.admission.reserve()
        except APIError:
            self.metrics.refused(metrics.REFUSED_QUEUE_FULL)
            raise

    def admit(self, reservation: Reservation, count: int, priority: int) -> None:
        """Once the request is read: places for all its ``count`` prompts, and
        a 503 for a sheddable priority while the engine is near capacity (--shed-*)."""
        try:
            check_shedding(self.config.shedding, self.client.stats, priority,
                           self.admission.waiting_besides(reservation))
        except APIError:
            self.metrics.refused(metrics.REFUSED_SHED)
            raise
        if count > reservation.count:
            try:
                reservation.grow(count - reservation.count)
            except APIError:
                self.metrics.refused(metrics.REFUSED_QUEUE_FULL)
                raise

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """A 400 for a text too long for the context whatever its tokens, before
        the seconds its tokenization would take: no token stands for more
        than ``max_token_bytes`` bytes, and a character is at least one byte.
        Twice that bound leaves room for a normalizer that drops characters."""
        limit = self.max_model_len
        bound = limit * 2 * self.tokenizer.max_token_bytes
        if len(text) > bound:
            where = "messages" if param == "messages" else "prompt"
            raise self._too_long(f"the {where} has {len(text)} characters, more than {limit} tokens of this "
                                 f"model's tokenizer can hold ({bound} characters)", f"the {where}", param)

    def check_prompt_ids(self, ids: list[int], max_tokens: Optional[int], param: str = "prompt") -> int:
        """Validate a tokenized prompt; returns max_tokens, defaulting to the
        model's generation_config ``max_new_tokens`` when the request left it
        unset (as transformers' generate and vLLM take it), capped by the rest
        of the context, which is the default without one."""
        if not ids:
            raise bad_request(f"{param} must not be empty", param)
        vocab = self.client.info.vocab_size
        bad = [t for t in ids if not (0 <= t < vocab)]
        if bad:
            raise bad_request(f"{param} contains token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param)
        limit = self.max_model_len
        if max_tokens is None:
            resolved = limit - len(ids)
            default = self.client.info.generation_defaults.get("max_new_tokens")
            if default is not None:
                resolved = min(resolved, default)
            requested = len(ids) + 1  # room for at least one token
        else:
            resolved = max_tokens
            requested = len(ids) + max(max_tokens, 0)  # a negative max_tokens is SamplingParams' 400
        if requested > limit:
            where = "messages" if param == "messages" else "prompt"
            raise self._too_long(f"you requested {requested} tokens ({len(ids)} in the {where}, "
                                 f"{requested - len(ids)} in the completion)", f"the {where} or completion", param)
        return resolved

    def _too_long(self, detail: str, reduce: str, param: str) -> APIError:
        """The context-length 400, in OpenAI's words (clients match them)."""
        self.metrics.refused(metrics.REFUSED_CONTEXT_LENGTH)
        return bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, {detail}. "
                           f"Please reduce the length of {reduce}.", param)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams | PoolingParams, priority: int, api_names: dict[str, str]
    ) -> AsyncIterator[RequestOutput]:
        """One engine request with metrics; engine failures become APIErrors
        (``api_names`` as for ``build_sampling_params``). ``PoolingParams``:
        an embedding request."""
        arrival = time.monotonic()
        timeout = self.config.request_timeout_s
        deadline = arrival + timeout if timeout is not None else None
        tracker = self.metrics.tracker(arrival, len(prompt_ids))
        finished = False
        error: Optional[str] = None  # why it failed (metrics.ERROR_*)
        try:
            stream = self.client.generate(uuid.uuid4().hex, prompt_ids, params, priority, arrival, deadline)
            # aclosing: when our consumer stops, the engine request aborts now, not at garbage collection.
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if out.error is not None:
                        error = metrics.ERROR_ENGINE
                        raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
                    now = time.monotonic()
                    tracker.on_output(out, now)
                    if out.finished:
                        finished = True
                        tracker.on_finish(out, now)
                    yield out
        except EngineDeadError as exc:
            # The engine died (or hung) under this request and is being restarted
            # (or the server is about to exit): a retry may well succeed.
            hung = isinstance(exc, EngineHungError)
            error = metrics.ERROR_ENGINE_HUNG if hung else metrics.ERROR_ENGINE_DEAD
            raise APIError(503, f"the engine failed while serving this request: {exc}", code=error,
                           headers={"Retry-After": "1"}) from None
        except RequestTimeoutError:
            # 504: the server gave up waiting on its own engine, the client did nothing wrong.
            error = metrics.ERROR_TIMEOUT
            raise APIError(504, f"the request did not finish within {timeout} s (--request-timeout)",
                           code="timeout") from None
        except EngineRequestError as exc:
            error = metrics.ERROR_REJECTED
            raise param_error(str(exc), api_names) from None
        finally:
            if not finished:
                tracker.on_finish(None, time.monotonic(), error)
