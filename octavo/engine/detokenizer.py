"""Incremental detokenization with stop strings, for streaming.

Decoding one token at a time is wrong for byte-level vocabularies (a token
may hold half a UTF-8 character) and for SentencePiece ones (a token's
leading space depends on what precedes it). So each step decodes a small
window twice, ``ids[prefix:read]`` and ``ids[prefix:]``, and emits the
difference once it no longer ends in U+FFFD (an incomplete character); the
window then slides forward. The window starts on the last few prompt tokens,
so the first output token is decoded in context. Each update costs
O(new tokens), however long the output grows.

Stop strings are searched only where a new match can be: from
(max stop length - 1) characters before the new text, and only once more
than ``min_tokens`` tokens exist (as for stop tokens, the first token that
can end the output is the one after the first min_tokens). While no stop
has matched, ``get_delta`` holds that many trailing characters back, because
they could still turn out to start a stop string (not needed with
include_stop_str_in_output: nothing before a stop's end is ever removed).

With stop strings the text length after each token is kept, so that once a
stop cuts the text, ``tokens_covering`` says how many tokens produced what
is left: the caller trims token ids and logprobs to exactly the returned
text (and holds back tokens whose text is held back while streaming).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Optional

from octavo.sampling_params import SamplingParams
from octavo.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the first output token
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Output text of one sequence, built token by token.

    ``update(ids)`` appends tokens and returns the stop string that just
    matched (the text is then cut before it, or after it with
    include_stop_str_in_output, and later updates are ignored).
    ``get_delta()`` returns the text not returned yet. ``finish()`` is called
    once the sequence ends for any reason: it flushes tokens still waiting
    for the rest of a character and releases the held-back tail.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._min_tokens = params.min_tokens
        self._hold = 0 if self._include_stop else max(self._longest_stop - 1, 0)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0  # window start: context for the tokens being decoded
        self._read = len(self._ids)  # tokens before this are already in ``text``
        self._sent = 0  # characters of ``text`` returned by get_delta
        self.token_ids: list[int] = []
        self._token_ends: list[int] = []  # len(text) after each token; kept only with stop strings
        self.text = ""
        self.stop_str: Optional[str] = None
        self.finished = False

    def update(self, new_token_ids: list[int]) -> Optional[str]:
        """Append tokens; returns the stop string when one matched now."""
        if self.finished:
            return None
        start = len(self.text)
        if self._stops:
            # Token by token: a stop's cut must map back to a token count.
            for token_id in new_token_ids:
                self._append([token_id])
        else:
            # One window decode for all of them: the same text as one per
            # token (the window only moves on once its text is complete), and
            # what makes decoding a whole output at its end cheap.
            self._append(new_token_ids)
        return self._find_stop(start)

    def update_until_stop(self, new_token_ids: list[int]) -> tuple[Optional[str], int]:
        """``update``, but a stop string also ends the tokens: with stop
        strings, tokens go in one at a time until one completes a stop.
        Returns the stop string (or None) and how many tokens were taken."""
        if not self._stops or len(new_token_ids) == 1:
            return self.update(new_token_ids), len(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            stop = self.update([token_id])
            if stop is not None:
                return stop, i + 1
        return None, len(new_token_ids)

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def tokens_covering(self, num_chars: int) -> int:
        """How many of ``token_ids`` it takes to produce the first
        ``num_chars`` characters of ``text`` (tokens whose text is only
        partly inside count). Meaningful with stop strings only."""
        if num_chars <= 0:
            return 0
        return min(bisect_left(self._token_ends, num_chars) + 1, len(self.token_ids))

    def tokens_within(self, num_chars: int) -> int:
        """How many leading tokens produced text inside the first ``num_chars`` characters only."""
        return bisect_right(self._token_ends, num_chars)

    def _append(self, token_ids: list[int]) -> None:
        self._ids.extend(token_ids)
        self.token_ids.extend(token_ids)
        self.text += self._decode_window(flush=False)
        if self._stops:
            self._token_ends.extend([len(self.text)] * len(token_ids))

    def finish(self) -> Optional[str]:
        """End of the sequence: decode what is pending (an incomplete
        character comes out as U+FFFD) and release the held-back text.
        Returns a stop string only if the flushed text completed one."""
        if self.finished:
            return None
        start = len(self.text)
        self.text += self._decode_window(flush=True)
        if self._token_ends:
            self._token_ends[-1] = len(self.text)  # the flushed text is the last token's
        stop = self._find_stop(start)
        self.finished = True
        return stop

    def get_delta(self) -> str:
        """Text not yet returned, except a tail that might start a stop string."""
        end = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta

    def _decode_window(self, flush: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith(_INCOMPLETE) and not flush):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _find_stop(self, start: int) -> Optional[str]:
        """Earliest stop string in text that was not fully there before ``start``."""
        if not self._stops or len(self.token_ids) <= self._min_tokens:
            return None
        search_from = max(0, start - self._longest_stop + 1)
        best: Optional[tuple[int, str]] = None
        for stop in self._stops:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self._include_stop else at]
        self.stop_str = stop
        self.finished = True
        return stop
