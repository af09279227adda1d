"""Embedding models through the offline API, judged against transformers'
AutoModel ``last_hidden_state`` pooled with torch (tests/model_factory.py)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.pooling import PoolingParams
from tests.model_factory import hf_embeddings, make_sentence_transformers_model, make_tiny_model

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n" * 6]
# (folder kind, arch, pooling, normalize): the headless checkpoint is read as
# embed/last/normalized by --task auto; the sentence-transformers folders by their modules.
CASES = [
    ("headless", "qwen3", "last", True),
    ("st", "llama", "mean", True),
    ("st", "qwen3", "cls", False),
    ("st", "llama", "last", False),
]


def _folder(tmp, kind, arch, pooling, normalize):
    if kind == "headless":
        return make_tiny_model(tmp, arch, headless=True)
    return make_sentence_transformers_model(tmp, pooling, normalize, arch=arch)


def _max_diff(vectors, reference) -> float:
    return max((torch.tensor(v) - torch.tensor(r)).abs().max().item() for v, r in zip(vectors, reference))


@pytest.mark.parametrize("kind,arch,pooling,normalize", CASES)
def test_embeddings_match_transformers(tmp_path_factory, kind, arch, pooling, normalize):
    """A batch of varied lengths, the longest over the step's token budget
    (chunked prefill: mean sums across chunks, last takes the final chunk's
    row), then the same prompts again (prefix-cache hits for last pooling,
    none for mean and cls): within 1e-4 of transformers, no block leaked."""
    folder = _folder(tmp_path_factory.mktemp("emb"), kind, arch, pooling, normalize)
    llm = LLM(folder, dtype="float32", num_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.pooler_config.pooling_type == pooling and llm.engine.pooler_config.normalize == normalize
    prompts = [llm.get_tokenizer().encode(t) for t in TEXTS]
    assert max(map(len, prompts)) > 32
    reference = hf_embeddings(folder, prompts, pooling, normalize)
    kv = llm.engine.scheduler.kv_cache_manager
    for _ in range(2):
        outs = llm.embed(prompts, use_tqdm=False)
        assert [len(o.embedding) for o in outs] == [64] * len(prompts)
        assert _max_diff([o.embedding for o in outs], reference) < 1e-4
        assert kv.num_free_blocks == kv.num_total_blocks
    if pooling == "last":
        assert kv.prefix_cache_hits > 0
    else:
        assert kv.prefix_cache_hits == 0
    if normalize:
        assert all(abs(math.hypot(*o.embedding) - 1) < 1e-5 for o in outs)


def test_mean_pooling_survives_preemption(tmp_path_factory):
    """A more urgent request preempts one whose prompt is mostly computed; the
    preempted one recomputes from position 0 and pools anew (its partial sum
    dropped), and both match transformers."""
    folder = make_sentence_transformers_model(tmp_path_factory.mktemp("emb"), "mean", arch="llama")
    llm = LLM(folder, dtype="float32", num_blocks=16, block_size=8, max_num_batched_tokens=48)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(TEXTS[2])
    assert len(prompt) > 2 * 48 and len(prompt) <= 16 * 8  # three chunks; two such prompts do not fit at once
    other = prompt[::-1]
    engine.add_request("late", prompt, PoolingParams(), priority=1)
    engine.step()
    engine.add_request("urgent", other, PoolingParams(), priority=0)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0
    reference = hf_embeddings(folder, [prompt, other], "mean", True)
    assert _max_diff([outs["late"].embedding, outs["urgent"].embedding], reference) < 1e-4
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_matryoshka_dimensions_are_cut_and_normalized_again(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("emb"), "qwen3", headless=True, matryoshka_dimensions=[16, 32])
    llm = LLM(folder, dtype="float32", num_blocks=32)
    prompt = llm.get_tokenizer().encode(TEXTS[1])
    (full,) = hf_embeddings(folder, [prompt], "last", False)
    (out,) = llm.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)
    expected = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=-1)
    assert (torch.tensor(out.embedding) - expected).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="dimensions must be one of 16, 32"):
        llm.embed(prompt, PoolingParams(dimensions=20), use_tqdm=False)


def test_one_task_per_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emb")
    embedder = LLM(make_tiny_model(tmp, "qwen3", headless=True), dtype="float32", num_blocks=16)
    with pytest.raises(ValueError, match="serves embeddings"):
        embedder.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="^dimensions is not supported"):
        embedder.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)
    out = embedder.embed("Hello", use_tqdm=False)[0]
    assert out.embedding  # still serving
    # Finished because its vector is, as vLLM's pooling requests: "stop", not a length limit.
    assert out.outputs[0].finish_reason == "stop"
    causal = make_tiny_model(tmp, "qwen3")
    generator = LLM(causal, dtype="float32", num_blocks=16)
    with pytest.raises(ValueError, match="not embeddings"):
        generator.embed("Hello", use_tqdm=False)
    # A causal checkpoint served for embeddings: its lm_head is not read.
    as_embedder = LLM(causal, dtype="float32", num_blocks=16, task="embed", pooling_type="mean")
    ids = as_embedder.get_tokenizer().encode(TEXTS[1])
    got = as_embedder.embed(ids, use_tqdm=False)[0].embedding
    assert _max_diff([got], hf_embeddings(causal, [ids], "mean", True)) < 1e-4


def test_bad_embedding_folders_fail_at_start(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emb")
    headless = make_tiny_model(tmp, "qwen3", headless=True)
    with pytest.raises(ValueError, match="task generate needs a language-model head"):
        LLM(headless, task="generate", num_blocks=16)
    with pytest.raises(ValueError, match="speculative decoding does not apply"):
        LLM(headless, speculative_method="ngram", num_blocks=16)
    folder = make_sentence_transformers_model(tmp, "mean")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        LLM(folder, num_blocks=16)
