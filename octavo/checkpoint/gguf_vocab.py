"""A GGUF file's tokenizer: its vocabulary metadata as a ``tokenizers`` object.

llama.cpp's converter stores two kinds of vocabulary, told apart by
``tokenizer.ggml.model``:

- "llama": SentencePiece pieces with scores and types (Llama 1/2, Mistral),
  built like a tokenizer.model (octavo/checkpoint/sentencepiece.py);
- "gpt2": byte-level BPE tokens and merges (Llama 3, Qwen2/3, most recent
  models). What splits text into words before BPE (the pre-tokenizer) is
  not stored as a rule but as a name, ``tokenizer.ggml.pre``, that llama.cpp
  maps to its own regular expressions; the names the models Octavo runs use
  are mapped here to the expressions of those models' tokenizer.json. An
  unknown name is a ValueError (an approximate split would change token
  ids silently); ``--tokenizer`` can name the model's Hugging Face folder instead.

Tokens of type CONTROL become special tokens, USER_DEFINED ones plain added
tokens, as the converter derived them from tokenizer.json.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from octavo.checkpoint.gguf_file import GgufFile, list_of
from octavo.checkpoint.sentencepiece import CONTROL, MODEL_BPE, NORMAL, USER_DEFINED, SpmVocab, build_tokenizer

# GPT-2's split, also written as tokenizers' ByteLevel(use_regex=True).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _ByteLevelSplit:
    """How a "gpt2" vocabulary's text is split into words, per ``tokenizer.ggml.pre``."""

    regex: Optional[str]  # None: GPT-2's own (ByteLevel's built-in regex)
    nfc: bool = False  # Qwen2 normalizes to NFC first
    ignore_merges: bool = False  # Llama 3 takes a word that is a token whole, before any merge
    single_digits: bool = False  # SmolLM (StarCoder's split): every digit is a word of its own first


_PRE_TOKENIZERS = {
    "default": _ByteLevelSplit(None),
    "gpt-2": _ByteLevelSplit(None),
    "llama-bpe": _ByteLevelSplit(_LLAMA3_SPLIT, ignore_merges=True),
    "llama3": _ByteLevelSplit(_LLAMA3_SPLIT, ignore_merges=True),
    "qwen2": _ByteLevelSplit(_QWEN2_SPLIT, nfc=True),
    "smollm": _ByteLevelSplit(None, single_digits=True),
}


def end_token_ids(file: GgufFile) -> tuple[int, ...]:
    """The tokens that end a generation: EOS, and the end-of-turn and
    end-of-message tokens when the file names them (llama.cpp stops on them too)."""
    found = (file.get(f"tokenizer.ggml.{name}_token_id", kind=int) for name in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(i for i in found if i is not None))


def gguf_tokenizer(file: GgufFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer of ``file`` and tokenizer_config.json's fields as its
    metadata gives them: bos_token, eos_token, unk_token, pad_token (texts),
    add_bos_token, chat_template."""
    kind = file.get("tokenizer.ggml.model", kind=str)
    tokens = file.get("tokenizer.ggml.tokens", kind=list_of(str))
    if kind is None or not tokens:
        raise ValueError(f"{file.path} has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens); "
                         "pass --tokenizer with the model's Hugging Face folder")
    types = _per_token(file, "token_type", int, NORMAL, len(tokens))
    ids = {name: file.get(f"tokenizer.ggml.{name}_token_id", kind=int) for name in ("bos", "eos", "unknown", "padding")}
    if kind == "llama":
        scores = [float(s) for s in _per_token(file, "scores", float, 0.0, len(tokens))]
        tok = build_tokenizer(SpmVocab(
            tokens, scores, types, model_type=MODEL_BPE,
            add_dummy_prefix=file.get("tokenizer.ggml.add_space_prefix", True, bool),
            unk_id=ids["unknown"], bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["padding"],
        ), str(file.path))
    elif kind == "gpt2":
        tok = _byte_level(file, list(tokens), types)
    else:
        raise ValueError(f"{file.path}: tokenizer.ggml.model {kind!r} is not supported; supported: llama "
                         "(SentencePiece), gpt2 (byte-level BPE); or pass --tokenizer with a Hugging Face folder")

    def text(token_id: Optional[int]) -> Optional[str]:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    config = {
        "bos_token": text(ids["bos"]),
        "eos_token": text(ids["eos"]),
        "unk_token": text(ids["unknown"]),
        "pad_token": text(ids["padding"]),
        # llama.cpp's default when the file does not say: SentencePiece vocabularies start with BOS.
        "add_bos_token": file.get("tokenizer.ggml.add_bos_token", kind == "llama", bool),
        "chat_template": file.get("tokenizer.chat_template", kind=str),
    }
    return tok, {k: v for k, v in config.items() if v is not None}


def _per_token(file: GgufFile, name: str, kind: type, default: Any, count: int) -> list[Any]:
    """``tokenizer.ggml.<name>``, one ``kind`` per token (``default`` for each when absent)."""
    values = file.get(f"tokenizer.ggml.{name}", kind=list_of(kind))
    if values is None:
        return [default] * count
    if len(values) != count:
        raise ValueError(f"{file.path}: metadata 'tokenizer.ggml.{name}' has {len(values)} entries for {count} tokens")
    return values


def _byte_level(file: GgufFile, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = file.get("tokenizer.ggml.pre", "default", str)
    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        raise ValueError(f"{file.path}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}; or pass --tokenizer with the model's "
                         "Hugging Face folder")
    merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges", [], list_of(str))]
    if any(len(m) != 2 for m in merges):
        raise ValueError(f"{file.path}: tokenizer.ggml.merges holds an entry that is not two tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split.ignore_merges))
    except Exception as exc:  # tokenizers raises plain Exception for a merge of tokens not in the vocabulary
        raise ValueError(f"{file.path}: metadata 'tokenizer.ggml.merges' does not fit the tokens: {exc}") from None
    if split.nfc:
        tok.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split.single_digits else []
    if split.regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split.regex), behavior="isolated", invert=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok
