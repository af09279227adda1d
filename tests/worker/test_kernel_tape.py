"""Kernel tapes: a recorded CPU step replays its native kernel calls and its torch ops on whatever the static
inputs hold at replay; it refuses steps a replay cannot repeat, and a replayed kernel that fails fails the step.
(tests/engine/test_decode_tapes.py: the engine with tapes against the eager engine.)"""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from octavo.kernels.fused_ops import fused_ops
from octavo.worker.decode_graphs import StepRefused
from octavo.worker.kernel_tape import KernelReplayError, record_tape


def test_replay_recomputes_kernels_and_torch_ops_from_the_static_inputs():
    ops = fused_ops(required=True)
    table, weight = torch.randn(50, 32), torch.randn(32)
    ids = torch.zeros(4, dtype=torch.int64)

    def step() -> torch.Tensor:
        h = F.embedding(ids, table) * 2.0  # torch ops: recomputed and copied into the recorded output
        return ops.rms_norm(h, weight, 1e-6)  # a native kernel: called again with the recorded pointers

    tape, out = record_tape(step)
    assert (tape.num_kernel_calls, tape.num_torch_ops) == (1, 2)
    assert tape.nbytes >= 3 * 4 * 32 * 4  # embedding, product and norm outputs, float32
    for seed in range(3):
        ids.copy_(torch.randint(0, 50, (4,), generator=torch.Generator().manual_seed(seed)))
        tape.replay()
        want = ops.rms_norm(F.embedding(ids, table) * 2.0, weight, 1e-6)
        assert torch.equal(out, want)


def test_ops_that_may_alias_are_replayed_when_they_copied():
    # ``to`` and ``contiguous`` return their input when nothing changes and a copy otherwise: the recording
    # must tell which happened (a rotary table is ``positions.float()``).
    positions = torch.tensor([3, 5])

    def step() -> torch.Tensor:
        same = positions.to(torch.int64)  # its input: nothing to replay
        return same.float().cos().to(torch.float32)

    tape, out = record_tape(step)
    assert tape.num_torch_ops == 2  # float() and cos(); to(int64) and to(float32) returned their inputs
    positions.copy_(torch.tensor([7, 9]))
    tape.replay()
    assert torch.equal(out, torch.tensor([7.0, 9.0]).cos())


def test_in_place_ops_run_again_on_every_replay():
    counter = torch.zeros(3)

    def step() -> torch.Tensor:
        counter.add_(1.0)
        return counter + 0.5

    tape, out = record_tape(step)
    tape.replay()
    tape.replay()
    assert counter.tolist() == [3.0, 3.0, 3.0] and out.tolist() == [3.5, 3.5, 3.5]


@pytest.mark.parametrize("step", [lambda x: x * x.sum().item(), lambda x: x + torch.rand(3), lambda x: x.nonzero(),
                                  lambda x: x + torch.tensor([1.0, 2.0, 3.0])],
                         ids=["item", "random", "data-dependent shape", "tensor from Python values"])
def test_steps_a_replay_cannot_repeat_are_refused(step):
    x = torch.ones(3)
    with pytest.raises(StepRefused):
        record_tape(lambda: step(x))


def test_a_failing_kernel_on_replay_fails_the_step():
    ops = fused_ops(required=True)
    heads, kv_heads, dim = 2, 1, 8
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.ones(1, dim), torch.zeros(1, dim)
    k_cache, v_cache = torch.zeros(4, kv_heads, dim), torch.zeros(4, kv_heads, dim)
    slots = torch.tensor([2])
    tape, _ = record_tape(lambda: (ops.rotary_write_kv(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots),
                                   qkv)[1])
    slots.fill_(9)  # outside the cache: the kernel refuses, as it does eagerly
    with pytest.raises(KernelReplayError, match="octavo_rotary_write_kv returned -2"):
        tape.replay()
