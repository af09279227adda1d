"""The default model, SmolLM2-135M-Instruct (a Q4_1 GGUF file), against transformers on the same
file: the tokenizer built from its metadata (the ``smollm`` pre-tokenizer) and the chat template
give transformers' ids; Octavo's int4 kernels, reading the Q4_1 blocks as stored, with float
activations (``quantized_activations="float"``) give transformers' logits on the dequantized weights
(float32) to float32 rounding of 30 layers, and the same greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from octavo import LLM, SamplingParams
from octavo.assets import HELDOUT_SAMPLE_PATH
from octavo.tokenizer import Tokenizer
from tests.checkpoint.conftest import TOKENIZER_CORPUS, octavo_logits
from tests.worker.runner_utils import hf_logits

# Octavo multiplies the 4-bit values by their scales and adds the minimums inside the kernel, in float32;
# transformers multiplies by the dequantized float32 weight. The sums run in another order, so the logits
# (magnitudes up to ~30) differ by float32 rounding carried through 30 layers: measured max 2e-4.
LOGIT_ATOL = 2e-3
NEW_TOKENS = 24
PAD = 2  # the file's padding token (<|im_end|>)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "import numpy as np\n\n",
    "Water boils at a temperature of",
    "Q: What is 12 times 12?\nA:",
    "The best way to learn a new language is",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
]
MIXED_TEXT = [
    "Prices: 12345.678 dollars, 1e-9, 2024-01-01T00:00:00Z, 0x1F",
    "    indented\tand\t\ttabbed\n\n\n  trailing   ",
    "ünïcödé, 日本語, Ελληνικά, emoji 😀🚀",
    "def f(x):\n    return x**2 + 10_000  # comment\n",
    "I'm sure they'll've said: \"don't\" — ok?!",
    *TOKENIZER_CORPUS,
]


@pytest.fixture(scope="module")
def hf(smollm2: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


def test_tokenizer_gives_transformers_ids(smollm2, hf):
    ours, theirs = Tokenizer(smollm2), hf[1]
    texts = [*MIXED_TEXT, HELDOUT_SAMPLE_PATH.read_text()]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"}],
])
def test_chat_template_gives_transformers_ids(smollm2, hf, messages):
    ours = Tokenizer(smollm2)
    ids = ours.encode(ours.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert ids == hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_q4_1_blocks_run_on_the_int4_kernels_with_transformers_logits(smollm2, hf):
    prompt = Tokenizer(smollm2).encode(HELDOUT_SAMPLE_PATH.read_text()[:400], add_special_tokens=False)
    got, tokens = octavo_logits(smollm2, prompt=prompt, num_blocks=32, quantized_activations="float")
    torch.testing.assert_close(got, hf_logits(hf[0], tokens), atol=LOGIT_ATOL, rtol=0)


def test_greedy_tokens_match_transformers(smollm2, hf):
    model, tokenizer = hf
    llm = LLM(smollm2, dtype="float32", quantized_activations="float")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert [list(o.prompt_token_ids) for o in outs] == prompts
    # One left-padded batch through generate, as a user of transformers runs several prompts.
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    for prompt, out, row in zip(PROMPTS, outs, ref[:, width:].tolist()):
        assert list(out.outputs[0].token_ids) == row, prompt


def test_it_answers_sensibly(smollm2):
    llm = LLM(smollm2)  # the default: bfloat16 activations, rounded to int8 at decode, on the int4 kernels
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # at <|im_end|>, not at the length limit
