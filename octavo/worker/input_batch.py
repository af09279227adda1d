"""SchedulerOutput -> the step's flattened tensors and attention metadata."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from octavo.core.outputs import ScheduledRequest
from octavo.model.attention_metadata import AttentionMetadata, DecodeGroup, MaskByWindow, PagedDecodes, PrefillChunk

if TYPE_CHECKING:
    from octavo.kernels.paged_decode import PagedDecodeKernel


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    # The scheduled requests in row order (single-token rows first); request i
    # owns rows q_starts[i] .. q_starts[i] + num_tokens - 1.
    order: list[ScheduledRequest]
    q_starts: list[int]


def prepare_inputs(
    scheduled: list[ScheduledRequest],
    block_size: int,
    windows: Iterable[Optional[int]],
    device: torch.device,
    decode_kernel: Optional[PagedDecodeKernel] = None,
) -> StepInputs:
    """``decode_kernel``: attend the decodes with the native kernel (one call
    over their block tables) instead of length groups of gather + SDPA."""
    # Longest context first, so decodes of similar length sit in contiguous rows.
    decodes = sorted(
        (s for s in scheduled if len(s.token_ids) == 1), key=lambda s: s.start_pos, reverse=True
    )
    num_decodes = len(decodes)
    order = decodes + [s for s in scheduled if len(s.token_ids) > 1]
    lens = [len(s.token_ids) for s in order]
    starts = [s.start_pos for s in order]
    context = [start + n for start, n in zip(starts, lens)]
    blocks_needed = [-(-c // block_size) for c in context]
    for s, need, tokens in zip(order, blocks_needed, context):
        if len(s.block_ids) < need:
            raise ValueError(
                f"request {s.request.request_id}: {len(s.block_ids)} blocks cannot hold "
                f"{tokens} tokens with block_size {block_size}"
            )
    q_starts = list(itertools.accumulate(lens, initial=0))[:-1]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    width = max(blocks_needed)
    block_table = ints([s.block_ids[:n] + [0] * (width - n) for s, n in zip(order, blocks_needed)])
    row_req = torch.repeat_interleave(torch.arange(len(order), device=device), ints(lens))
    positions = torch.arange(sum(lens), device=device) + (ints(starts) - ints(q_starts))[row_req]
    slot_mapping = block_table[row_req, positions // block_size] * block_size + positions % block_size

    windows = set(windows)
    attn = AttentionMetadata(slot_mapping=slot_mapping, block_size=block_size, num_decodes=num_decodes)
    if decode_kernel is not None and num_decodes:
        attn.paged_decodes = PagedDecodes(
            block_table=block_table[:num_decodes, : blocks_needed[0]],
            context_lens=ints(context[:num_decodes]),
            kernel=decode_kernel,
        )
    groups = [] if decode_kernel is not None else _decode_groups(blocks_needed[:num_decodes])
    for start, end in groups:
        width = blocks_needed[start]  # rows are sorted longest first
        keys = torch.arange(width * block_size, device=device)
        query_pos = ints(context[start:end]).unsqueeze(1) - 1
        attn.decode_groups.append(
            DecodeGroup(
                row_start=start,
                row_end=end,
                block_table=block_table[start:end, :width],
                masks={w: _mask(query_pos, keys, w).view(end - start, 1, 1, -1) for w in windows},
            )
        )
    for i in range(num_decodes, len(order)):
        fresh = starts[i] == 0
        query_pos = torch.arange(starts[i], context[i], device=device).unsqueeze(1)
        keys = torch.arange(context[i], device=device)
        masks: MaskByWindow = {
            # A fresh chunk without a window is exactly the causal square SDPA builds itself.
            w: None if fresh and w is None else _mask(query_pos, keys, w) for w in windows
        }
        attn.prefills.append(
            PrefillChunk(
                q_start=q_starts[i],
                q_end=q_starts[i] + lens[i],
                context_len=context[i],
                fresh=fresh,
                block_ids=None if fresh else block_table[i, : blocks_needed[i]],
                masks=masks,
            )
        )
    input_ids = ints(list(itertools.chain.from_iterable(s.token_ids for s in order)))
    return StepInputs(input_ids, positions, attn, order, q_starts)


def _decode_groups(blocks_needed: list[int]) -> list[tuple[int, int]]:
    """Split rows sorted by descending length into runs whose shortest member
    needs at least half the blocks of the longest: padding then at most doubles
    the work, and a batch mixing 10- and 1000-token contexts no longer pads
    every row to 1000. Each group costs one more attention call per layer, so
    the halving rule keeps their number logarithmic in the length spread."""
    groups: list[tuple[int, int]] = []
    start = 0
    for row in range(1, len(blocks_needed) + 1):
        if row == len(blocks_needed) or 2 * blocks_needed[row] < blocks_needed[start]:
            groups.append((start, row))
            start = row
    return groups


def _mask(query_pos: torch.Tensor, keys: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """query_pos [Q, 1], keys [K] -> [Q, K]: causal, and within the window if any."""
    mask = keys <= query_pos
    if window is not None:
        mask &= keys > query_pos - window
    return mask
