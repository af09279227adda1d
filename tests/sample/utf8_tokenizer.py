"""A tiny byte-level BPE tokenizer trained on text full of multi-byte characters.

Merges happen on bytes, so some tokens end in the middle of a UTF-8
character (é is 2 bytes, 中 3, 😀 4): exactly what an incremental
detokenizer must handle. The corpus also has JSON so grammars find
multi-character tokens for it.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from octavo.tokenizer import Tokenizer

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_end|>"]
EOS_ID = 1
IM_END_ID = 3

CORPUS = [
    "Le café est très bon, déjà prêt à emporter. Crème brûlée et thé glacé!",
    "中文分词很有意思。我们喜欢自然语言处理和机器学习。你好，世界！",
    "Emoji time 😀😃🎉🚀 and hearts ❤️💙 with flags 🇫🇷🇯🇵 everywhere 👍",
    'JSON: {"name": "octavo", "age": 42, "ok": true, "tags": ["fast", "small"], "v": null}',
    "The quick brown fox jumps over the lazy dog. Stop here, or STOP there; the end.",
    "Mixed: naïve façade – “quotes” — ÅÄÖ ñ ü ß, 日本語のテキスト, 한국어 텍스트 🍣",
]


def write_utf8_tokenizer(folder: str | Path, vocab_size: int = 420) -> Path:
    """Write tokenizer.json + tokenizer_config.json under ``folder``; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 8, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def load_utf8_tokenizer(folder: str | Path) -> Tokenizer:
    return Tokenizer(write_utf8_tokenizer(folder))
