"""The step's rows -> its flattened tensors and attention metadata (one per KV cache group)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from octavo.attention.base import SHORT_QUERY, AttentionBackend, AttentionMetadata, StepLayout
from octavo.core.step_state import ScheduledRow


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: list[AttentionMetadata]  # per KV cache group: its block tables and slots
    # The scheduled requests in row order (single-token rows first); request i
    # owns rows q_starts[i] .. q_starts[i] + num_tokens - 1.
    order: list[ScheduledRow]
    q_starts: list[int]


def prepare_inputs(
    scheduled: list[ScheduledRow],
    block_size: int,
    backend: AttentionBackend,
    device: torch.device,
) -> StepInputs:
    """Lay the step's tokens out (decodes first, longest context first, so
    decodes of similar length sit in contiguous rows; then the short requests
    over a cached context, see ``StepLayout.num_short``) and let ``backend``
    build its metadata from that layout, once per KV cache group (each
    group's layers read its own block tables)."""
    decodes = sorted(
        (s for s in scheduled if s.num_tokens == 1), key=lambda s: s.start_pos, reverse=True
    )
    short = [s for s in scheduled if 1 < s.num_tokens <= SHORT_QUERY and s.start_pos > 0]
    short_ids = {id(s) for s in short}
    order = decodes + short + [s for s in scheduled if s.num_tokens > 1 and id(s) not in short_ids]
    lens = [s.num_tokens for s in order]
    starts = [s.start_pos for s in order]
    context = [start + n for start, n in zip(starts, lens)]
    blocks_needed = [-(-c // block_size) for c in context]
    for s, need, tokens in zip(order, blocks_needed, context):
        held = min(len(table) for table in s.block_tables)
        if held < need:
            raise ValueError(
                f"request {s.request.request_id}: {held} blocks cannot hold "
                f"{tokens} tokens with block_size {block_size}"
            )
    q_starts = list(itertools.accumulate(lens, initial=0))[:-1]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    width = max(blocks_needed)
    row_req = torch.repeat_interleave(torch.arange(len(order), device=device), ints(lens))
    positions = torch.arange(sum(lens), device=device) + (ints(starts) - ints(q_starts))[row_req]
    attn = []
    for group in range(len(order[0].block_tables)):
        block_table = ints([s.block_tables[group][:n] + [0] * (width - n) for s, n in zip(order, blocks_needed)])
        slot_mapping = block_table[row_req, positions // block_size] * block_size + positions % block_size
        attn.append(backend.build_metadata(StepLayout(
            block_size=block_size, num_decodes=len(decodes), num_short=len(short), query_starts=q_starts,
            query_lens=lens,
            context_lens=context, blocks_needed=blocks_needed, block_table=block_table, slot_mapping=slot_mapping,
            device=device,
        )))
    input_ids = ints(list(itertools.chain.from_iterable(s.token_ids for s in order)))
    return StepInputs(input_ids, positions, attn, order, q_starts)
