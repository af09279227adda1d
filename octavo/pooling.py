"""Embedding models: how a model's hidden states become one vector per
request (``PoolerConfig``, fixed per served model) and what one request
asks of it (``PoolingParams``). Torch-free: the engine and the HTTP front
validate with these; the worker's ``octavo/worker/pooler.py`` does the math.

Choices worth knowing:
- ``dimensions`` (Matryoshka) keeps the first N values of the pooled vector
  and, when the model normalizes, normalizes them again, as vLLM and OpenAI's
  ``text-embedding-3`` do (sentence-transformers' ``truncate_dim`` would not
  renormalize: the direction is the same, only the length differs).
- Only models that say they were trained for it accept ``dimensions``
  (config.json ``is_matryoshka`` or ``matryoshka_dimensions``): cutting other
  models' vectors gives something that looks like an embedding and is not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from octavo.tokenizer import Tokenizer

# The last three as sentence-transformers names them: the element-wise max of
# the rows, their sum over sqrt(length), and their mean weighted 1..n by position.
POOLING_TYPES = ("last", "mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean")
TASKS = ("auto", "generate", "embed")


@dataclass(frozen=True)
class PoolerConfig:
    """How the served embedding model pools (resolved at start-up)."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # L2-normalize the pooled vector
    hidden_size: int  # the length of a full embedding
    # Matryoshka: None = the model was not trained for truncation; () = any
    # length up to hidden_size; else the lengths it was trained for.
    matryoshka_dimensions: Optional[tuple[int, ...]] = None
    # Each text is embedded as a user message in the chat template (what sentence-transformers 6
    # does for a folder whose Transformer module has the "message" modality).
    chat_prompt: bool = False

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")

    def embedding_ids(self, tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids ``text`` is embedded from, made as sentence-transformers makes them: the text
        as a user message rendered by the chat template (no generation prompt) where ``chat_prompt``,
        else the text encoded as it is."""
        if not self.chat_prompt:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False)
        return tokenizer.encode(rendered, add_special_tokens=False)

    def check_dimensions(self, dimensions: Optional[int]) -> None:
        """ValueError naming ``dimensions`` when this model cannot give that many."""
        if dimensions is None:
            return
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
        if self.matryoshka_dimensions is None:
            raise ValueError("dimensions is not supported by this model: it was not trained for shorter "
                             "embeddings (no is_matryoshka or matryoshka_dimensions in its config.json)")
        if dimensions > self.hidden_size:
            raise ValueError(f"dimensions must be <= {self.hidden_size} (the model's embedding size), got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            allowed = ", ".join(map(str, self.matryoshka_dimensions))
            raise ValueError(f"dimensions must be one of {allowed} for this model, got {dimensions}")

    def shorten(self, vector: list[float], dimensions: Optional[int]) -> list[float]:
        """The first ``dimensions`` values of a pooled vector, normalized
        again when the model normalizes (see the module docstring)."""
        if dimensions is None or dimensions >= len(vector):
            return vector
        cut = vector[:dimensions]
        if not self.normalize:
            return cut
        norm = math.sqrt(math.fsum(x * x for x in cut))
        return [x / norm for x in cut] if norm > 0 else cut


@dataclass
class PoolingParams:
    """One embedding request: what ``LLM.embed`` and ``/v1/embeddings`` send
    instead of SamplingParams. ``dimensions``: Matryoshka truncation."""

    dimensions: Optional[int] = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
