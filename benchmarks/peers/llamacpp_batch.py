"""llama.cpp batched: several sequences per ``llama_decode``, through llama-cpp-python's low-level API.

The high-level ``Llama`` API holds one sequence, so offline it runs requests one after another; an engine
that batches must be compared with llama.cpp batching too. ``LlamaCppContext`` opens a second context on a
loaded ``Llama``'s model with one sequence per request: prompts prefilled together in ``n_batch`` chunks,
then one ``llama_decode`` per step for every sequence, greedy argmax of the logits in numpy.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


class LlamaCppContext:
    """A second llama.cpp context on a loaded ``Llama``'s model, driven through the batch API: several
    sequences per llama_decode (``generate``) or logits for every token (``token_logprobs``)."""

    def __init__(self, llm: Any, n_ctx: int, n_batch: int, n_seq: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, min(n_batch, 512), n_seq
        self.ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens, {n_seq} sequences")
        self.n_vocab = llm.n_vocab()
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def _decode(self, items: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
        """items: (token, position, sequence, wants logits); the logits rows of those that want them."""
        b = self.batch
        for i, (token, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(1 for item in items if item[3])
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def generate(self, prompts: Sequence[list[int]], output_lens: int | Sequence[int]) -> list[list[int]]:
        """Greedy, all prompts as sequences of one batch; exactly ``output_lens`` tokens each (one length
        for all, or one per prompt: a sequence leaves the batch when it has its tokens)."""
        lens = [output_lens] * len(prompts) if isinstance(output_lens, int) else list(output_lens)
        self._clear()
        items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        following: list[int] = [0] * len(prompts)
        for start in range(0, len(items), self.n_batch):
            chunk = items[start:start + self.n_batch]
            logits = self._decode(chunk)
            row = 0
            for _, _, seq, out in chunk:
                if out:
                    following[seq] = int(logits[row].argmax())
                    row += 1
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(max(lens)):
            live = [s for s in range(len(prompts)) if step < lens[s]]
            for seq in live:
                outputs[seq].append(following[seq])
            live = [s for s in live if step + 1 < lens[s]]
            if not live:
                break
            logits = self._decode([(following[s], len(prompts[s]) + step, s, True) for s in live])
            for s, token in zip(live, logits.argmax(axis=1)):
                following[s] = int(token)
        return outputs

    def token_logprobs(self, window: list[int]) -> np.ndarray:
        """log p(window[i] | window[:i]) for i >= 1, from llama.cpp's logits (float32)."""
        self._clear()
        rows = []
        for start in range(0, len(window), self.n_batch):
            chunk = window[start:start + self.n_batch]
            rows.append(self._decode([(t, start + i, 0, True) for i, t in enumerate(chunk)]).copy())
        logits = torch.from_numpy(np.concatenate(rows)[:-1])
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(window[1:])[:, None])[:, 0].numpy()
