from __future__ import annotations

import json
import random

import pytest
import torch

from tests.checkpoint.gguf_writer import reference_folder, write_gguf
from tests.checkpoint.hostile_files import ValidModel, valid_model
from tests.model_factory import make_tiny_model
from tests.worker.runner_utils import Blocks, make_request, make_runner, step

PROMPT = [random.Random(7).randrange(5, 512) for _ in range(24)]
# GGUF files stored as floats: transformers' logits on the same values, to float32 rounding.
FLOAT_ATOL = 1e-4
# Block-quantized layers on the int kernels against transformers on the dequantized weights.
QUANT_ATOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: a second intra-op thread only slows them down on busy shared cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """files(arch, matrix_type, types=None, split_kv_b=True, **config_overrides) -> (gguf path, reference
    folder), written once each (``split_kv_b``: DeepSeek's layout, tests/checkpoint/gguf_writer.py)."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(arch: str, matrix_type: str, types=None, split_kv_b: bool = True, **overrides):
        key = (arch, matrix_type, json.dumps(types, sort_keys=True), json.dumps(overrides, sort_keys=True), split_kv_b)
        if key not in made:
            folder = make_tiny_model(root / "hf", arch, **overrides)
            name = f"{len(made)}-{arch}-{matrix_type}"
            path = write_gguf(folder, root / f"{name}.gguf", matrix_type, types=types,
                              sliding_window=arch == "mistral", split_kv_b=split_kv_b)
            made[key] = path, reference_folder(folder, root / f"{name}-ref", matrix_type, types)
        return made[key]

    return get


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> ValidModel:
    """The valid tiny model (folder and GGUF file) the hostile files are made from."""
    return valid_model(tmp_path_factory.mktemp("valid"))


def octavo_logits(model, prompt=PROMPT, decode=(7, 99), dtype="float32", **kwargs) -> tuple[torch.Tensor, list[int]]:
    """Octavo's logits at every prompt position (one prefill) and after each
    of ``decode`` (one decode step each), with the token ids they score."""
    runner = make_runner(model, dtype=dtype, **kwargs)
    blocks = Blocks(runner)
    req = make_request("a", list(prompt))
    got = [runner.execute_logits(step(blocks.chunk(req, 0, len(prompt))))["a"]]
    for token in decode:
        req.append_output_token(token)
        got.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    return torch.cat(got), req.all_token_ids


# Text with what SentencePiece vocabularies get wrong when converted carelessly:
# runs of spaces, leading/trailing spaces, tabs and newlines, accents, CJK,
# emoji and other characters outside the vocabulary (byte fallback), digits,
# chat markers inside text.
TOKENIZER_CORPUS = [
    "Hello world",
    " leading space",
    "trailing space ",
    "  two  spaces   three",
    "\ttab\nnewline\n\nblank line",
    "héllo wörld naïve café",
    "你好，世界 こんにちは",
    "emoji 🙂🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "x<|im_start|>user\nhi<|im_end|>\n y",
    "numbers 0 12 345 6789",
    "def add(a, b):\n    return a + b\n",
    "",
    " ",
]


def train_sentencepiece(folder, model_type: str = "bpe", vocab_size: int = 512) -> None:
    """A SentencePiece model trained on a small text, as Llama's is set up
    (identity normalization, spaces kept, digits split, byte fallback),
    with a user-defined and a control piece: folder/tokenizer.model."""
    import sentencepiece as spm

    from tests.model_factory import _CORPUS

    lines = _CORPUS.splitlines() + TOKENIZER_CORPUS
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 3), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size,
        model_type=model_type, byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<|im_start|>"], control_symbols=["<|im_end|>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
