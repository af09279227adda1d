"""Each seeded request's own random stream, so its tokens do not depend on the rest of the batch."""
from __future__ import annotations

from typing import Optional

import torch

from octavo.core.step_state import CachedRequestState


def request_generator(generators: dict[str, torch.Generator], request: CachedRequestState,
                      device: torch.device) -> Optional[torch.Generator]:
    """The request's generator (made and seeded on first use, kept in ``generators`` by request id),
    or None for an unseeded request, which draws from the global one."""
    seed = request.sampling_params.seed
    if seed is None:
        return None
    gen = generators.get(request.request_id)
    if gen is None:
        gen = generators[request.request_id] = torch.Generator(device=device)
        gen.manual_seed(seed)
    return gen
