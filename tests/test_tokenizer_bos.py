"""The BOS rule of Tokenizer.encode: the post-processor decides, add_bos_token fills in, never two."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from octavo.tokenizer import Tokenizer
from tests.model_factory import BOS_ID, write_tokenizer


@pytest.fixture
def folder(tmp_path):
    write_tokenizer(tmp_path)  # a fresh folder per test: _set edits it
    return tmp_path


def _set(folder, *, post_processor: bool, add_bos_token: bool) -> Tokenizer:
    doc = json.loads((folder / "tokenizer.json").read_text())
    if not post_processor:
        doc["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["add_bos_token"] = add_bos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder)


def test_post_processor_bos_matches_transformers(folder):
    tok = _set(folder, post_processor=True, add_bos_token=False)
    hf = AutoTokenizer.from_pretrained(folder)
    for text in ("hello world", "x"):
        assert tok.encode(text) == hf(text).input_ids and tok.encode(text)[0] == BOS_ID
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
        assert BOS_ID not in tok.encode(text, add_special_tokens=False)


def test_text_that_starts_with_bos_keeps_one(folder):
    tok = _set(folder, post_processor=True, add_bos_token=False)
    plain = tok.encode("hello", add_special_tokens=False)
    # A prompt decoded from ids that began with BOS (lm-eval's untokenized requests do this).
    text = tok.decode([BOS_ID] + plain, skip_special_tokens=False)
    assert tok.encode(text) == [BOS_ID] + plain
    assert tok.encode(text, add_special_tokens=False) == [BOS_ID] + plain


def test_add_bos_token_without_post_processor(folder):
    tok = _set(folder, post_processor=False, add_bos_token=True)
    plain = tok.encode("hello", add_special_tokens=False)
    assert plain and plain[0] != BOS_ID
    assert tok.encode("hello") == [BOS_ID] + plain
    assert tok.encode(tok.decode([BOS_ID] + plain, skip_special_tokens=False)) == [BOS_ID] + plain
    tok = _set(folder, post_processor=False, add_bos_token=False)
    assert tok.encode("hello") == plain
