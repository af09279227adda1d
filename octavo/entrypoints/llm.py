"""LLM: the offline Python API (batch generation and chat)."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from tqdm import tqdm

from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.engine_args import engine_config
from octavo.outputs import RequestOutput
from octavo.pooling import PoolingParams
from octavo.sampling_params import RequestOutputKind, SamplingParams
from octavo.tokenizer import Tokenizer

PromptType = Union[str, list[int]]
Messages = list[dict[str, Any]]


class LLM:
    """Generate for many prompts at once; the engine batches them continuously.

    ``model`` is a Hugging Face checkpoint folder; ``None`` means the
    built-in default model shipped with Octavo.
    """

    def __init__(self, model: Optional[str | Path] = None, **options: Any) -> None:
        """``options`` are the engine config fields by name (``dtype``,
        ``max_model_len``, ``num_blocks``, ``enable_prefix_caching``,
        ``attention_backend``, ...: see ``octavo/config.py``), the same names
        as the command line's ``--dtype``, ``--max-model-len``, ...; an
        unknown name is a ValueError naming it."""
        self.engine = LLMEngine(engine_config(model, **options))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (they also stop
        when this process exits)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        *,
        priority: Optional[Sequence[int]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single string or a single
        list of token ids is one prompt."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        # Only final outputs are returned: the engine need not build the others.
        request_ids = self._add(prompt_list, _with_kind(params_list, RequestOutputKind.FINAL_ONLY), priority)
        return self._run(request_ids, use_tqdm)

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        *,
        priority: Optional[Sequence[int]] = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Outputs as they are produced, all prompts batched together:
        ``(index into prompts, output)`` where the output holds only what is
        new since that prompt's previous one (``OutputAccumulator`` folds them
        back). Closing the iterator early aborts the unfinished prompts."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        request_ids = self._add(prompt_list, _with_kind(params_list, RequestOutputKind.DELTA), priority)
        index = {request_id: i for i, request_id in enumerate(request_ids)}
        for out in self._outputs(request_ids):
            yield index[out.request_id], out

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: Optional[PoolingParams | Sequence[PoolingParams]] = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One vector per prompt, in ``RequestOutput.embedding``, in the order
        of ``prompts``; the model must serve embeddings (``task="embed"``, or
        an embedding checkpoint). ``PoolingParams(dimensions=N)`` shortens a
        Matryoshka model's vectors."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(pooling_params or PoolingParams(), len(prompt_list), "pooling_params")
        return self._run(self._add(prompt_list, params_list, None), use_tqdm)

    def _add(
        self,
        prompts: list[PromptType],
        params_list: Sequence[SamplingParams] | Sequence[PoolingParams],
        priority: Optional[Sequence[int]],
    ) -> list[str]:
        """Queue every prompt (or none: a refused one aborts those queued before it)."""
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError("priority must have one entry per prompt")
        request_ids: list[str] = []
        try:
            for prompt, params, prio in zip(prompts, params_list, priorities):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params, priority=prio)
                request_ids.append(request_id)
        except BaseException:  # the prompts queued so far must not stay in the engine
            self.engine.abort_request(request_ids)
            self._drain()
            raise
        return request_ids

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        *,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        documents: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template (as
        transformers' apply_chat_template does: ``tools`` and ``documents``
        are template variables, ``chat_template_kwargs`` more of them, e.g.
        ``enable_thinking``), then generate."""
        prompts = self.encode_chat(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, documents=documents,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def encode_chat(
        self,
        messages: Messages | Sequence[Messages],
        *,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        documents: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[list[int]]:
        """Each conversation's prompt token ids, as ``chat`` renders them (for ``stream``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts: list[list[int]] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                **(chat_template_kwargs or {}),
            )
            # The template writes the BOS token itself where the model wants one.
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return prompts

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm or len(request_ids) < 2)
        try:
            for out in self._outputs(request_ids):
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
        return [final[r] for r in request_ids]

    def _outputs(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """Step the engine until ``request_ids`` have finished, yielding their outputs."""
        pending = set(request_ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        except BaseException:
            # Interrupted (KeyboardInterrupt, the caller closed the iterator, an
            # engine error): free what is left. After an engine error the drain
            # may fail again; the first error is the one to report.
            self.engine.abort_request(pending)
            with contextlib.suppress(Exception):
                self._drain()
            raise
        self._drain()  # one more (empty) step: the ranks drop the finished requests' state now

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _with_kind(params_list: list[SamplingParams], kind: RequestOutputKind) -> list[SamplingParams]:
    """The parameters with ``output_kind`` set; one copy per distinct object (a broadcast one stays shared)."""
    by_id = {id(p): dataclasses.replace(p, output_kind=kind) for p in params_list}
    return [by_id[id(p)] for p in params_list]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _broadcast(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} must be one value or one per prompt ({count})")
        return list(value)
    return [value] * count
