"""A request's tokens, for the rate limits: what it reserves at admission,
and what it used, read from its response or from its stream's events.

To charge a stream that its client abandons for what was generated until
then, the gateway asks the replica for usage on every chunk
(``stream_options.continuous_usage_stats``) and, when the client did not ask
for it, hides it again on the way back: a chunk's usage becomes the ``null``
the replica would have sent, and the closing usage-only chunk is dropped.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

# A completion or chat chunk's usage: a flat object (a Responses event's is nested, and read whole).
_CHUNK_USAGE = re.compile(rb'"usage":(\{[^{}]*\})')
# About four bytes of text per token in common vocabularies. Only the reservation is sized by it (usage
# settles the charge); token-id prompts are over-counted, which errs on the safe side.
_BYTES_PER_TOKEN = 4
# What a request that sets no bound on its output reserves for it (most chat clients send none). Reserving
# the key's whole minute instead would let such a key run one request at a time; the settlement charges
# what it really generated either way, a longer answer as a debt on the key's next requests.
UNBOUNDED_OUTPUT_TOKENS = 1024


def reservation(path: str, data: dict[str, Any], raw: bytes) -> int:
    """The tokens a request may cost: its body's size for the prompt plus the
    most it may generate (``UNBOUNDED_OUTPUT_TOKENS`` when it sets no bound)."""
    prompt = len(raw) // _BYTES_PER_TOKEN + 1
    if path == "/v1/embeddings":
        return prompt
    if path == "/v1/completions":
        limit = data.get("max_tokens", 16)  # the request model's default
    elif path == "/v1/chat/completions":
        limit = data.get("max_completion_tokens") or data.get("max_tokens")
    else:
        limit = data.get("max_output_tokens")
    if limit is None:
        limit = UNBOUNDED_OUTPUT_TOKENS
    return prompt + int(limit) * int(data.get("n") or 1)


def body_tokens(body: bytes) -> int:
    """``usage.total_tokens`` of a JSON body (or a Responses event's response); 0 when it has none."""
    try:
        data = json.loads(body)
        usage = data.get("usage") or (data.get("response") or {}).get("usage") or {}
        return int(usage.get("total_tokens") or 0)
    except (ValueError, AttributeError, TypeError, RecursionError):
        return 0


@dataclass
class StreamUsage:
    """Reads a stream's usage as its events pass and hides what the client did not ask for."""

    hide_final: bool = False  # the closing usage-only chunk
    hide_per_chunk: bool = False  # the usage on every other chunk
    tokens: Optional[int] = None  # the latest usage seen: the stream's cost so far

    def see(self, event: bytes) -> Optional[bytes]:
        """The event as the client gets it; None: not at all."""
        match = _CHUNK_USAGE.search(event)
        if match is None:
            if b'"usage":{' in event:
                self.tokens = body_tokens(event[event.find(b"{"):]) or self.tokens
            return event
        self.tokens = body_tokens(b'{"usage":%s}' % match.group(1)) or self.tokens
        if b'"choices":[]' in event:
            return None if self.hide_final else event
        if self.hide_per_chunk:
            return event[: match.start()] + b'"usage":null' + event[match.end():]
        return event
