"""Byte-level BPE tokenizer for the default model, saved as a Hugging Face tokenizer folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"  # also bos and pad: every document starts after one
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
END_OF_TURN = "<|end|>"
MODEL_MAX_LENGTH = 512

# Roles other than system/user/assistant are refused rather than rendered,
# because the model has only ever seen these three markers. The template writes
# the BOS itself, as chat callers encode its output without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise(message: str) -> None:
    raise ValueError(message)


_ENV = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
_ENV.globals["raise_exception"] = _raise
_TEMPLATE = _ENV.from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The chat template as transformers renders it, minus the BOS: the text is meant to be
    encoded with special tokens, so the post-processor adds the BOS exactly once."""
    return _TEMPLATE.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token="")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # Long runs of '#' or '=' in banner comments would otherwise take whole entries.
        max_token_length=16,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # The BOS is part of the tokenizer itself, so transformers and Octavo
    # encode a prompt to the same ids without consulting add_bos_token.
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
