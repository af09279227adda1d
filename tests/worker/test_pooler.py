"""The worker's Pooler keeps a running state per request, so a prompt pooled
in any split of chunks, beside other requests in the same steps, gives the
vector of the whole prompt pooled at once."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from octavo.core.step_state import ScheduledRow
from octavo.pooling import POOLING_TYPES, PoolerConfig
from octavo.worker.pooler import Pooler

HIDDEN = 8


def _whole(kind: str, rows: torch.Tensor) -> torch.Tensor:
    """The reference: every row of one prompt pooled in one go."""
    n = rows.shape[0]
    weights = torch.arange(1, n + 1, dtype=rows.dtype)
    return {
        "last": rows[-1], "mean": rows.mean(dim=0), "cls": rows[0], "max": rows.max(dim=0).values,
        "mean_sqrt_len_tokens": rows.sum(dim=0) / math.sqrt(n),
        "weightedmean": (rows * weights[:, None]).sum(dim=0) / weights.sum(),
    }[kind]


def _row(rid: str, length: int, start: int, count: int) -> ScheduledRow:
    request = SimpleNamespace(request_id=rid, num_prompt_tokens=length)
    return ScheduledRow(request=request, start_pos=start, num_tokens=count, block_tables=[[]], sample=False)


def _run_chunks(pooler: Pooler, prompts: dict[str, torch.Tensor], chunk: int) -> dict[str, list[float]]:
    """Every prompt advanced by ``chunk`` positions a step, all in each step's one hidden tensor."""
    done: dict[str, list[float]] = {}
    start = 0
    while any(start < p.shape[0] for p in prompts.values()):
        rows, firsts, pieces = [], [], []
        for rid, prompt in prompts.items():
            if start < prompt.shape[0]:
                piece = prompt[start : start + chunk]
                rows.append(_row(rid, prompt.shape[0], start, piece.shape[0]))
                firsts.append(sum(p.shape[0] for p in pieces))
                pieces.append(piece)
        done.update(pooler.pool(rows, firsts, torch.cat(pieces), lambda x: x))
        start += chunk
    return done


@pytest.mark.parametrize("kind", POOLING_TYPES)
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunks_pool_as_the_whole_prompt(kind, chunk):
    torch.manual_seed(0)
    prompts = {"a": torch.randn(7, HIDDEN), "b": torch.randn(1, HIDDEN), "c": torch.randn(11, HIDDEN)}
    pooler = Pooler(PoolerConfig(kind, normalize=False, hidden_size=HIDDEN))
    got = _run_chunks(pooler, prompts, chunk)
    assert sorted(got) == sorted(prompts)
    for rid, prompt in prompts.items():
        torch.testing.assert_close(torch.tensor(got[rid]), _whole(kind, prompt), rtol=1e-5, atol=1e-5)
    assert pooler._partial == {}  # nothing kept for requests that finished


@pytest.mark.parametrize("kind", POOLING_TYPES)
def test_a_prompt_recomputed_from_the_start_forgets_its_first_try(kind):
    """After preemption a request computes its prompt again from position 0;
    what its first, unfinished try kept must not count."""
    torch.manual_seed(1)
    prompt = torch.randn(6, HIDDEN)
    pooler = Pooler(PoolerConfig(kind, normalize=False, hidden_size=HIDDEN))
    stale = torch.randn(6, HIDDEN) * 10  # larger than the prompt's rows: a max or sum kept would show
    assert pooler.pool([_row("a", 6, 0, 4)], [0], stale[:4], lambda x: x) == {}
    got = _run_chunks(pooler, {"a": prompt}, 4)
    torch.testing.assert_close(torch.tensor(got["a"]), _whole(kind, prompt), rtol=1e-5, atol=1e-5)
