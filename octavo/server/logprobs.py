"""TokenLogprobs -> the two OpenAI logprobs shapes (legacy completions, chat)."""
from __future__ import annotations

from typing import Optional, Sequence

from octavo.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from octavo.outputs import TokenLogprobs
from octavo.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # Special tokens are shown too: a logprob entry must name its token.
    return tokenizer.decode([token_id], skip_special_tokens=False)


class LegacyLogprobs:
    """Builds the legacy completions shape for one choice, keeping the
    running text offset so stream chunks continue where the last one ended."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._num_top = num_top
        self._skip = skip_special_tokens
        self._offset = 0

    def build(self, token_ids: Sequence[int], entries: Sequence[Optional[TokenLogprobs]]) -> CompletionLogprobs:
        """``entries[i]`` describes ``token_ids[i]``; None means no logprob (the first prompt token)."""
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = token_text(self._tok, token_id)
            out.tokens.append(text)
            out.text_offset.append(self._offset)
            # Offsets index the returned text, where skipped special tokens take no room.
            shown = self._tok.decode([token_id], skip_special_tokens=True) if self._skip else text
            self._offset += len(shown)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry.logprob)
            top = {token_text(self._tok, t): lp for t, lp in entry.top[: self._num_top]}
            # OpenAI lists the chosen token among the alternatives even when
            # it is not in the top N.
            top.setdefault(text, entry.logprob)
            out.top_logprobs.append(top)
        return out


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprobs], num_top: int
) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        top = [_top(tokenizer, t, lp) for t, lp in entry.top[:num_top]]
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def aligned_prompt_logprobs(
    prompt_ids: Sequence[int], prompt_logprobs: Optional[Sequence[Optional[TokenLogprobs]]]
) -> list[Optional[TokenLogprobs]]:
    """One entry per prompt token, None where the engine has none (position 0)."""
    entries = list(prompt_logprobs or [])
    if len(entries) < len(prompt_ids):
        entries = [None] * (len(prompt_ids) - len(entries)) + entries
    return entries


def prompt_logprobs_body(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], entries: Optional[Sequence[Optional[TokenLogprobs]]]
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, the token itself and the top alternatives."""
    body: PromptLogprobs = []
    for entry in aligned_prompt_logprobs(prompt_ids, entries):
        if entry is None:
            body.append(None)
            continue
        position = {
            t: PromptLogprob(logprob=lp, rank=rank, decoded_token=token_text(tokenizer, t))
            for rank, (t, lp) in enumerate(entry.top, start=1)
        }
        position.setdefault(
            entry.token_id,
            PromptLogprob(logprob=entry.logprob, rank=entry.rank, decoded_token=token_text(tokenizer, entry.token_id)),
        )
        body.append(position)
    return body
