"""The shipped test model octavo-mini: loads in transformers and Octavo, and still scores what its card says.

The constants below are copied from octavo/assets/MODEL_CARD.md, which the training run wrote
(tools/train_default_model.py); retraining the model means updating them from the new card.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from octavo import LLM, SamplingParams
from octavo.assets import (
    MINI_DRAFT_MODEL_PATH,
    MINI_MODEL_PATH,
    HELDOUT_SAMPLE_PATH,
    MODEL_CARD_PATH,
)
from octavo.tokenizer import Tokenizer

# 1.1x the perplexities measured on heldout_sample.txt when the models were trained.
TARGET_PPL_BOUND = 131.86
DRAFT_PPL_BOUND = 348.1
GOLDEN_PROMPT = "def fibonacci(n):"
# The smallest top-1/top-2 logit gap along this greedy path is 0.009, far above
# fp32 rounding differences between CPUs, so the path is stable across machines.
GOLDEN_COMPLETION = "\n\n# The first of the" + "\n#" * 12 + "\n"
GOLDEN_NEW_TOKENS = 32
WINDOW = 512
ENGINE_PROMPTS = [GOLDEN_PROMPT, "class Stack:\n    \"\"\"", "import os\n\n\ndef list_files(path):\n"]
REQUIRED_FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(MINI_MODEL_PATH, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(MINI_MODEL_PATH)


@torch.no_grad()
def _perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = torch.tensor([ids[start : start + WINDOW]])
        if chunk.shape[1] < 2:
            break
        logits = model(input_ids=chunk).logits
        nll += torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def _greedy_hf(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int) -> list[int]:
    # Stop tokens come from the shipped generation_config.json (<|endoftext|> and <|end|>).
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=new_tokens)
    return out[0, len(prompt_ids):].tolist()


def test_shipped_folders_are_complete_and_small() -> None:
    total = 0
    for folder in (MINI_MODEL_PATH, MINI_DRAFT_MODEL_PATH):
        for name in REQUIRED_FILES:
            assert (folder / name).is_file(), f"{folder.name}/{name} missing"
        total += sum(p.stat().st_size for p in folder.iterdir())
    assert total < 100 * 2**20
    # The draft must share the target's vocabulary to propose tokens for it.
    assert (MINI_MODEL_PATH / "tokenizer.json").read_bytes() == (MINI_DRAFT_MODEL_PATH / "tokenizer.json").read_bytes()
    target_weights = (MINI_MODEL_PATH / "model.safetensors").stat().st_size
    draft_weights = (MINI_DRAFT_MODEL_PATH / "model.safetensors").stat().st_size
    assert draft_weights * 3 < target_weights


def test_octavo_and_transformers_tokenizers_agree(tokenizer: Tokenizer) -> None:
    hf = AutoTokenizer.from_pretrained(MINI_MODEL_PATH)
    for text in [GOLDEN_PROMPT, "    return {'a': 1}  # ok\n\n", "Ünïcode ✓ 中文"]:
        ids = tokenizer.encode(text)
        assert ids == hf(text).input_ids
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert tokenizer.decode(ids) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ours = tokenizer.apply_chat_template(messages)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|assistant|>\n")
    chat_ids = tokenizer.encode(ours, add_special_tokens=False)
    assert chat_ids.count(tokenizer.bos_token_id) == 1 and chat_ids[0] == tokenizer.bos_token_id
    with pytest.raises(ValueError, match="role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_target_heldout_perplexity_within_card_bound(target: torch.nn.Module, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(HELDOUT_SAMPLE_PATH.read_text(encoding="utf-8"), add_special_tokens=False)
    assert len(ids) > 2000
    assert _perplexity(target, ids) < TARGET_PPL_BOUND


def test_draft_heldout_perplexity_within_card_bound(tokenizer: Tokenizer) -> None:
    draft = AutoModelForCausalLM.from_pretrained(MINI_DRAFT_MODEL_PATH, dtype=torch.float32).eval()
    ids = tokenizer.encode(HELDOUT_SAMPLE_PATH.read_text(encoding="utf-8"), add_special_tokens=False)
    assert _perplexity(draft, ids) < DRAFT_PPL_BOUND


def test_greedy_golden_completion(target: torch.nn.Module, tokenizer: Tokenizer) -> None:
    completion = _greedy_hf(target, tokenizer.encode(GOLDEN_PROMPT), GOLDEN_NEW_TOKENS)
    assert tokenizer.decode(completion) == GOLDEN_COMPLETION


def test_card_records_the_tested_numbers() -> None:
    card = MODEL_CARD_PATH.read_text()
    bounds = [float(b) for b in re.findall(r"\*\*test bound: ([0-9.]+)\*\*", card)]
    assert bounds == [DRAFT_PPL_BOUND, TARGET_PPL_BOUND]
    assert "```\n" + GOLDEN_PROMPT + GOLDEN_COMPLETION + "\n```" in card


def test_octavo_engine_greedy_matches_transformers(target: torch.nn.Module, tokenizer: Tokenizer) -> None:
    llm = LLM(model=MINI_MODEL_PATH, dtype="float32", num_blocks=64)
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0, max_tokens=GOLDEN_NEW_TOKENS), use_tqdm=False)
    for prompt, out in zip(ENGINE_PROMPTS, outs):
        assert out.prompt_token_ids == tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == _greedy_hf(target, out.prompt_token_ids, GOLDEN_NEW_TOKENS)
    assert outs[0].outputs[0].text == GOLDEN_COMPLETION

    # A chat turn is prompted exactly as transformers renders it and ends at <|end|>.
    messages = [{"role": "user", "content": "What does the function dumps in the json module do?"}]
    hf_ids = AutoTokenizer.from_pretrained(MINI_MODEL_PATH).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )["input_ids"]
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert chat.prompt_token_ids == hf_ids
    reply = chat.outputs[0].token_ids
    assert reply == _greedy_hf(target, hf_ids, 64)
    assert chat.outputs[0].finish_reason == "stop" and reply[-1] == tokenizer.encode("<|end|>", add_special_tokens=False)[0]
    stats = llm.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()
