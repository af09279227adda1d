"""Building requests and sampling metadata for sampler tests."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from octavo.core.request import Request
from octavo.sample.metadata import SamplingMetadata
from octavo.sampling_params import SamplingParams


def make_request(
    params: SamplingParams,
    prompt: Sequence[int] = (1, 2, 3),
    output: Sequence[int] = (),
    eos_token_id: Optional[int] = 0,
    grammar=None,
    request_id: str = "r",
) -> Request:
    req = Request(request_id, list(prompt), params, eos_token_id=eos_token_id, grammar=grammar)
    for t in output:
        req.append_output_token(t)
    return req


def metadata(requests: Sequence[Request], vocab_size: int, seeded: bool = False) -> SamplingMetadata:
    """One generator per seeded request when ``seeded``, as the model runner keeps them."""
    generators = [
        torch.Generator().manual_seed(r.sampling_params.seed)
        if seeded and r.sampling_params.seed is not None
        else None
        for r in requests
    ]
    return SamplingMetadata.from_requests(requests, generators, vocab_size)
