"""Per-request bookkeeping on the engine side: the n (or best_of) sequences of
one user request, their detokenizers, and the assembly of RequestOutput."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from octavo.core.outputs import EngineCoreOutput
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from octavo.pooling import PoolingParams
from octavo.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceState:
    """One generated sequence (a child request in the scheduler). Tokens,
    logprobs and text are appended to; an output either copies them all
    (cumulative, final) or slices off what came after the previous delta."""

    index: int
    detokenizer: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    # How much the deltas sent so far covered.
    _sent_tokens: int = 0
    _sent_chars: int = 0
    _sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def as_output(self, with_logprobs: bool) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if with_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def trim_to_text(self) -> None:
        """After a stop string cut the text: keep only the tokens (and their
        logprobs) that produced it, so they describe exactly what is returned."""
        if self.detokenizer is None:
            return
        keep = max(self.detokenizer.tokens_covering(len(self.detokenizer.text)), self._sent_tokens)
        if dropped := self.logprobs[keep:]:
            self.cumulative_logprob -= sum(lp.logprob for lp in dropped)
        del self.token_ids[keep:], self.logprobs[keep:]

    def _sendable_tokens(self) -> int:
        # While text is held back (it may start a stop string), so are the
        # tokens that make it: a stop may still remove them.
        detok = self.detokenizer
        if detok is None or self.finished or not detok.has_stops:
            return len(self.token_ids)
        return max(self._sent_tokens, detok.tokens_within(len(self.text)))

    def take_delta(self, with_logprobs: bool) -> Optional[CompletionOutput]:
        """What is new since the previous delta (None: nothing is)."""
        start, self._sent_tokens = self._sent_tokens, self._sendable_tokens()
        text, self._sent_chars = self.text[self._sent_chars :], len(self.text)
        ends_now = self.finished and not self._sent_finish
        self._sent_finish = self.finished
        if start == self._sent_tokens and not text and not ends_now:
            return None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start : self._sent_tokens],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start : self._sent_tokens] if with_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    child_ids: list[str]
    sequences: dict[str, SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    num_cached_tokens: int = 0
    _sent_prompt_logprobs: int = 0  # entries already in a delta
    # An embedding request: what it asked for, and its vector once pooled.
    pooling: Optional[PoolingParams] = None
    embedding: Optional[list[float]] = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            # Nothing comes before the first prompt token to score it: its entry is
            # None, and a one-token prompt's list is [None] (vLLM's), not None.
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences.values())

    @property
    def text_at_end(self) -> bool:
        """Whether the text is decoded once when a sequence ends: nobody sees
        it before, and no stop string needs it earlier."""
        return self.params.output_kind is RequestOutputKind.FINAL_ONLY and not self.params.stop

    def apply(self, out: EngineCoreOutput) -> Optional[str]:
        """Fold one scheduler output into its sequence. Returns the stop string
        when the detokenizer found one (the caller must stop the sequence);
        ``out.new_token_ids`` is then cut after the token that completed it."""
        seq = self.sequences[out.request_id]
        if seq.finished:
            return None  # a step in flight when a stop string ended it: nothing of it is returned
        now = time.monotonic()
        # Every child computes the same prompt; keep the first child's.
        if out.prompt_logprobs is not None and self.prompt_logprobs is not None and out.request_id == self.child_ids[0]:
            self.prompt_logprobs.extend(out.prompt_logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        stop_str = None
        if out.new_token_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
            if seq.detokenizer is not None and not self.text_at_end:
                stopped_on_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
                stop_str, used = seq.detokenizer.update_until_stop(
                    self._text_ids(out.new_token_ids, stopped_on_token))
                if stop_str is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    # Several tokens in one step (speculative decoding): the
                    # ones after the stop string's end are not output.
                    out.new_token_ids = out.new_token_ids[:used]
                    if out.new_logprobs is not None:
                        out.new_logprobs = out.new_logprobs[:used]
            seq.token_ids.extend(out.new_token_ids)
            for lp in out.new_logprobs or []:
                seq.logprobs.append(lp)
                seq.cumulative_logprob += lp.logprob
            if stop_str is not None:
                seq.trim_to_text()  # the tokens (and logprobs) describe exactly the returned text
        if out.finish_reason is not None and not seq.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.finished:
            self._finish_text(seq)
        elif seq.detokenizer is not None:
            seq.text += seq.detokenizer.get_delta()
        if self.finished:
            self.metrics.finished_time = now
        return stop_str

    def finish_all(self, reason: str) -> None:
        for seq in self.sequences.values():
            if not seq.finished:
                seq.finish_reason = reason
                self._finish_text(seq)
        self.metrics.finished_time = time.monotonic()

    def _finish_text(self, seq: SequenceState) -> None:
        if seq.detokenizer is None:
            return
        if self.text_at_end:
            stopped_on_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
            seq.detokenizer.update(self._text_ids(seq.token_ids, stopped_on_token))
        seq.detokenizer.finish()
        if seq.detokenizer.stop_str is not None:
            seq.trim_to_text()
        seq.text += seq.detokenizer.get_delta()

    def _text_ids(self, token_ids: list[int], stopped_on_token: bool) -> list[int]:
        """The tokens whose text the output shows: all but a stop token (EOS or
        one of stop_token_ids) that ended the sequence, as in vLLM, unless
        include_stop_str_in_output. With skip_special_tokens false the EOS
        would otherwise end every answer as text ("...</s>"), which tool-call
        parsers, reading special tokens, then take for content."""
        if stopped_on_token and token_ids and not self.params.include_stop_str_in_output:
            return token_ids[:-1]
        return token_ids

    def make_output(self) -> Optional[RequestOutput]:
        """The output of this step as ``params.output_kind`` asks: with DELTA,
        only the sequences that progressed and the new part of each (None when
        nothing is new); otherwise each sequence whole."""
        with_logprobs = self.params.logprobs is not None
        delta = self.params.output_kind is RequestOutputKind.DELTA
        seqs = sorted(self.sequences.values(), key=lambda s: s.index)
        n = self.params.n
        ranked = self.params.best_of is not None and self.params.best_of > n
        if ranked:
            # best_of > n: the n most likely sequences, reported once all are done.
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
        if delta:
            outputs = [o for o in (s.take_delta(with_logprobs) for s in seqs) if o is not None]
        else:
            outputs = [s.as_output(with_logprobs) for s in seqs]
        if ranked:
            for i, o in enumerate(outputs):
                o.index = i
        prompt_logprobs = self.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[self._sent_prompt_logprobs :] or None
            self._sent_prompt_logprobs = len(self.prompt_logprobs)
        if delta and not outputs and prompt_logprobs is None and not self.finished:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            embedding=self.embedding,
        )
