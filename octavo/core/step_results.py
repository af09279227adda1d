"""What one step's model results do to a request: appended tokens, stop
checks and prompt logprobs (torch-free, no scheduler state)."""
from __future__ import annotations

from typing import Iterable, Optional

from octavo.core.request import Request, RequestStatus
from octavo.outputs import TokenLogprobs


def check_stop(request: Request, max_len: int) -> Optional[RequestStatus]:
    """The status the request finishes with after its newest output token, or
    None. Stop tokens count only once ``min_tokens`` outputs exist; they win
    over the length limits when both hit on the same token."""
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_sampled(
    request: Request,
    token_ids: Iterable[int],
    logprobs: Optional[list[TokenLogprobs]],
    max_len: int,
) -> tuple[list[int], Optional[list[TokenLogprobs]], Optional[RequestStatus]]:
    """Append sampled tokens up to the first that finishes the request (later
    ones, e.g. from speculative decoding, are dropped), advancing the
    request's grammar by each. Returns the appended tokens, their logprobs
    and the finish status."""
    new_ids: list[int] = []
    status = None
    for token_id in token_ids:
        if request.grammar is not None:
            # The worker masked with the grammar's state before this token.
            request.grammar.accept_tokens([token_id])
        request.append_output_token(token_id)
        new_ids.append(token_id)
        status = check_stop(request, max_len)
        if status is not None:
            break
    if logprobs is not None:
        logprobs = logprobs[: len(new_ids)]
        request.cumulative_logprob += sum(lp.logprob for lp in logprobs)
    return new_ids, logprobs, status


def take_prompt_logprobs(
    request: Request, start_pos: int, entries: Optional[list[TokenLogprobs]]
) -> Optional[list[TokenLogprobs]]:
    """The part of a chunk's prompt logprobs not reported before. ``entries[i]``
    scores the prompt token at position ``start_pos + 1 + i`` (the logits of a
    position score the token after it); a recompute after preemption yields
    positions already sent, which are dropped."""
    if not entries:
        return None
    first = start_pos + 1
    skip = max(0, request.prompt_logprobs_upto - first)
    request.prompt_logprobs_upto = max(request.prompt_logprobs_upto, first + len(entries))
    return entries[skip:] or None
