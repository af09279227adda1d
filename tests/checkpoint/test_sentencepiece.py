"""Folders with only a SentencePiece tokenizer.model (no tokenizer.json):
ids identical to transformers' LlamaTokenizer (BPE models, Llama's kind)
and to SentencePiece itself, decoding and streamed detokenization that
reassemble the text, and a model served from such a folder.

One difference from SentencePiece is transformers' and kept for parity: a
text that starts with a space gets no extra dummy-prefix space (so that
space does not come back when decoding)."""
from __future__ import annotations

import json
import shutil

import pytest
import sentencepiece as spm
from transformers import LlamaTokenizer

from octavo import LLM, SamplingParams
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.tokenizer import Tokenizer
from tests.checkpoint.conftest import TOKENIZER_CORPUS, train_sentencepiece
from tests.model_factory import make_tiny_model

CONFIG = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
          "chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"}


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory):
    """model_type -> a folder with tokenizer.model and tokenizer_config.json only."""
    made = {}

    def get(model_type: str):
        if model_type not in made:
            folder = tmp_path_factory.mktemp(f"spm-{model_type}")
            train_sentencepiece(folder, model_type)
            (folder / "tokenizer_config.json").write_text(json.dumps(CONFIG))
            made[model_type] = folder
        return made[model_type]

    return get


def test_bpe_ids_match_transformers_and_sentencepiece(spm_folder):
    folder = spm_folder("bpe")
    ours, hf = Tokenizer(folder), LlamaTokenizer.from_pretrained(folder)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2
    for text in TOKENIZER_CORPUS:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        # SentencePiece itself does not split out added tokens, and prefixes a leading space.
        if "<|im_" not in text and not text.startswith(" "):
            assert ids == [1] + sp.encode(text), text
            assert ours.decode(ids) == text, text
    marked = ours.encode("a<|im_end|>b", add_special_tokens=False)
    assert ours.id_to_token(marked[1]) == "<|im_end|>" and ours.decode(marked) == "ab"


def test_unigram_ids_match_sentencepiece(spm_folder):
    """Unigram models run as unigram (transformers v5's LlamaTokenizer turns them into BPE, so
    SentencePiece itself is the reference here)."""
    folder = spm_folder("unigram")
    ours = Tokenizer(folder)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    for text in TOKENIZER_CORPUS:
        if "<|im_" in text or text.startswith(" "):
            continue
        assert ours.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert ours.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_streamed_text_is_the_decoded_text(spm_folder, model_type):
    """Token by token, the detokenizer's deltas add up to the decoded text: the dummy
    prefix is dropped only at the start and multi-byte characters are never split."""
    tok = Tokenizer(spm_folder(model_type))
    prompt = tok.encode("Say:", add_special_tokens=False)
    for text in TOKENIZER_CORPUS:
        ids = tok.encode(" " + text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=False))
        pieces = []
        for token in ids:
            detok.update([token])
            pieces.append(detok.get_delta())
        detok.finish()
        pieces.append(detok.get_delta())
        assert "".join(pieces) == tok.decode(prompt + ids, skip_special_tokens=False)[len("Say:"):], text
        assert all("\ufffd" not in p for p in pieces), pieces


def test_a_model_with_only_tokenizer_model_serves_text(spm_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(make_tiny_model(tmp_path / "base", "llama"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    shutil.copy(spm_folder("bpe") / "tokenizer.model", folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    hf = LlamaTokenizer.from_pretrained(folder)
    llm = LLM(folder, dtype="float32")
    out = llm.generate(["héllo  wörld 🙂"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == hf("héllo  wörld 🙂").input_ids
    assert out.outputs[0].text == hf.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    chat = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == hf(rendered, add_special_tokens=False).input_ids


def test_a_broken_tokenizer_model_is_named(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\xff\xff\xff\xff")
    with pytest.raises(ValueError, match="tokenizer.model is not a SentencePiece model"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json or tokenizer.model in"):
        Tokenizer(tmp_path)
