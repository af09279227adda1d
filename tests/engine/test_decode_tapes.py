"""The engine with kernel tapes (the CPU default for decode steps, octavo/worker/kernel_tape.py) generates what
the eager engine does, through decode batches that shrink across the recorded sizes (padded rows included) and
a prefix-cache hit, and leaks no KV block; for a model whose layers are kernels (Llama) and one with torch ops
in between (Gemma 2)."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.worker.decode_graphs import capture_sizes
from octavo.worker.kernel_tape import TAPE_MAX_BATCH
from tests.engine.conftest import assert_no_leak, random_prompts


# Gemma 2: its (1 + w) norms, soft caps and scaled embeddings are torch ops in the tape, not kernels.
@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("gemma2", "float32")])
def test_engine_with_tapes_generates_what_the_eager_engine_does(model_dir, arch, dtype):
    folder = model_dir(arch)
    # Five requests stopping at different lengths: decode batches of 5 (padded to 8), 4, 3 (padded), 2 and 1;
    # the repeat of the first prompt hits the prefix cache.
    prompts = random_prompts([5, 17, 9, 30, 12]) + random_prompts([5])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (3, 6, 9, 12, 16, 7)]
    results = {}
    for eager in (False, True):
        llm = LLM(folder, dtype=dtype, num_blocks=64, enforce_eager=eager)
        runner = llm.engine.executor.worker.runner
        assert (runner._graphs is None) == eager
        # What the engine tells of them (a simulator's cost model prices a decode step at its padded size).
        sizes = capture_sizes(min(llm.engine.config.scheduler.max_num_seqs, TAPE_MAX_BATCH))
        assert llm.engine.executor.model_info.decode_batch_sizes == (() if eager else tuple(sizes))
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        if not eager:  # sizes 8, 4, 2 and 1 each ran more than one step: recorded, then replayed
            assert runner._graphs.recorded_sizes == [1, 2, 4, 8]
        assert_no_leak(llm)
    for (taped, taped_lp), (eager, eager_lp) in zip(results[False], results[True]):
        assert taped == eager
        # Padded batches may round their products differently from the unpadded eager ones.
        torch.testing.assert_close(taped_lp, eager_lp, rtol=0, atol=1e-4 if dtype == "float32" else 0.05)
