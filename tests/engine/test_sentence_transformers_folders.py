"""sentence-transformers folders in both layouts its releases save: the one the
installed library (6 or later) writes itself, and the one 5 and earlier wrote
(``make_sentence_transformers_model``, as Qwen3-Embedding is published).
Octavo's embeddings are judged against the library's own ``encode``."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from octavo import LLM
from tests.model_factory import make_sentence_transformers_model, make_tiny_model

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer  # noqa: E402

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n" * 3]
# Octavo's pooling type -> the mode sentence-transformers names it by.
ST_MODE = {
    "last": "lasttoken", "mean": "mean", "cls": "cls",
    "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "weightedmean": "weightedmean",
}
# Steps this small split every text but the shortest, so vectors are pooled across chunks.
CHUNK = 8


def _saved_by_library(tmp: Path, pooling: str, normalize: bool, arch: str, chat_template: bool = False) -> Path:
    """``chat_template``: keep the tokenizer's, so that sentence-transformers 6 saves the "message"
    modality and embeds every text as a user message rendered by it."""
    base = tmp / f"base-{arch}-{int(chat_template)}"
    shutil.copytree(make_tiny_model(tmp, arch, headless=True), base, dirs_exist_ok=True)
    if not chat_template:
        tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
        tokenizer_config.pop("chat_template")
        (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    transformer = Transformer(str(base))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), ST_MODE[pooling])]
    if normalize:
        modules.append(Normalize())
    folder = tmp / f"saved-{pooling}-{int(normalize)}-{arch}-{int(chat_template)}"
    st.SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def _assert_matches_library(folder: Path, pooling: str, normalize: bool) -> None:
    llm = LLM(folder, dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK)
    assert (llm.engine.pooler_config.pooling_type, llm.engine.pooler_config.normalize) == (pooling, normalize)
    got = torch.tensor([o.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    library = st.SentenceTransformer(str(folder), device="cpu")
    assert len(library.tokenizer(TEXTS[1])["input_ids"]) > CHUNK
    reference = library.encode(TEXTS, convert_to_tensor=True)
    assert (got - reference.float()).abs().max().item() < 1e-4


# Unnormalized where the mode's divisor would vanish under normalization.
@pytest.mark.parametrize(
    "pooling,normalize,arch",
    [
        ("last", True, "qwen3"), ("mean", False, "llama"), ("cls", True, "qwen3"),
        ("max", True, "llama"), ("mean_sqrt_len_tokens", False, "qwen3"), ("weightedmean", False, "llama"),
    ],
)
def test_folder_saved_by_the_library(tmp_path, pooling, normalize, arch):
    folder = _saved_by_library(tmp_path, pooling, normalize, arch)
    # The layout of 6 and later: module paths where the classes now live, one pooling_mode name.
    types = [m["type"] for m in json.loads((folder / "modules.json").read_text())]
    assert "sentence_transformers.base.modules.transformer.Transformer" in types
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == ST_MODE[pooling]
    assert list(json.loads((folder / "sentence_bert_config.json").read_text())["modality_config"]) == ["text"]
    _assert_matches_library(folder, pooling, normalize)


@pytest.mark.parametrize("pooling,normalize", [("last", True), ("mean", False)])
def test_texts_as_chat_messages_where_the_library_makes_them(tmp_path, pooling, normalize):
    folder = _saved_by_library(tmp_path, pooling, normalize, "qwen3", chat_template=True)
    assert "message" in json.loads((folder / "sentence_bert_config.json").read_text())["modality_config"]
    llm = LLM(folder, dtype="float32", num_blocks=64)
    assert llm.engine.pooler_config.chat_prompt
    # The ids the server's /v1/embeddings and LLM.embed both make: the library's own.
    library = st.SentenceTransformer(str(folder), device="cpu")
    for text in TEXTS:
        ours = llm.engine.pooler_config.embedding_ids(llm.get_tokenizer(), text)
        assert ours == library.preprocess([text])["input_ids"][0].tolist()
    _assert_matches_library(folder, pooling, normalize)


@pytest.mark.parametrize(
    "pooling,normalize",
    [("last", True), ("mean", True), ("cls", False), ("max", False), ("mean_sqrt_len_tokens", False),
     ("weightedmean", False)],
)
def test_folder_in_the_earlier_layout(tmp_path, pooling, normalize):
    folder = make_sentence_transformers_model(tmp_path, pooling, normalize, arch="qwen3")
    assert "sentence_transformers.models.Pooling" in (folder / "modules.json").read_text()
    _assert_matches_library(folder, pooling, normalize)


# Several modes concatenate into one longer vector, which Octavo does not build.
@pytest.mark.parametrize("mode", [["mean", "cls"], ["max", "weightedmean"]])
def test_unsupported_pooling_mode_is_named(tmp_path, mode):
    folder = _saved_by_library(tmp_path, "mean", True, "qwen3")
    config = folder / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode": mode}))
    with pytest.raises(ValueError, match=re.escape(f"pooling mode {mode!r} is not supported")):
        LLM(folder, num_blocks=16)


def test_dense_module_is_named(tmp_path):
    folder = _saved_by_library(tmp_path, "mean", False, "qwen3")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.base.modules.dense.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="dense.Dense' is not supported"):
        LLM(folder, num_blocks=16)
