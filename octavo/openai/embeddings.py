"""Bodies of /v1/embeddings: the request and its list of vectors."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel

from octavo.openai.protocol import _Body


class EmbeddingRequest(_Body):
    model: Optional[str] = None
    # A text, texts, token ids, or lists of token ids (OpenAI's four shapes).
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # Extensions (vLLM's names).
    priority: int = 0
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
