"""A draft model's LM head cut to the tokens a corpus uses most (``speculative_draft_vocab``).

A small draft's LM head is most of its bytes (octavo-mini-draft: 8192 x 128, 1.05M of its 1.44M parameters),
and every proposal step reads it whole. Proposals are only guesses that the target verifies one by one, so a
head over the N most used tokens changes no output: it never proposes a token outside them, where the whole
head's argmax might have been right, and that is all it loses. Random requests draw their proposals from the
cut head's distribution (q is zero outside it), and rejection sampling is exact for any q.

The ranking sits beside the draft's weights in ``token_ranks.json`` (in its folder, or a GGUF file's): every
token id of the vocabulary once, most used first, with its count over a corpus, and the head size its writer
chose (``head_size``), which a draft model runs with unless ``speculative_draft_vocab`` says otherwise.
``python -m octavo.spec_decode.draft_vocab DRAFT --head-size N FILE...`` writes it from text files;
tools/default_model_draft_vocab.py from the default models' training split for octavo-mini-draft, whose whole
head, on held-out text, proposed 46 distinct tokens, none ranked past 220: its file names 1024.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Iterable, Optional

from octavo.checkpoint.bounds import read_json_file
from octavo.checkpoint.paths import model_path

RANKS_FILE = "token_ranks.json"


def count_tokens(encode: Callable[[str], list[int]], texts: Iterable[str], vocab_size: int) -> list[int]:
    """How often each token id occurs in the encodings of ``texts``."""
    counts = [0] * vocab_size
    for text in texts:
        for token in encode(text):
            counts[token] += 1
    return counts


def ranks_path(model: str | Path) -> Path:
    """Where the ranking of the draft model ``model`` (a folder or a GGUF file) lives."""
    path = model_path(model)
    return (path if path.is_dir() else path.parent) / RANKS_FILE


def write_ranks(model: str | Path, counts: list[int], source: str, head_size: Optional[int] = None) -> Path:
    """Write ``model``'s ranking: token ids by falling count (ties by id), with their counts, and the head
    size the draft runs with by default (None: the whole vocabulary)."""
    order = sorted(range(len(counts)), key=lambda t: (-counts[t], t))
    path = ranks_path(model)
    ranks = {"source": source, "head_size": head_size, "token_ids": order, "counts": [counts[t] for t in order]}
    path.write_text(json.dumps(ranks) + "\n")
    return path


def head_tokens(folder: str, size: Optional[int], vocab_size: int) -> Optional[list[int]]:
    """The tokens of the draft model in ``folder``'s LM head, ascending (so that ties between logits go to the
    lower id, as over the whole head): its ``size`` most used; with ``size`` None, as many as its ranking's
    ``head_size`` names (none without a ranking file); None: the whole vocabulary (``size`` 0, or no size
    named). ValueError naming ``speculative_draft_vocab`` or the ranking file's field when the file is
    missing or malformed."""
    path = ranks_path(folder)
    if size is None and not path.is_file():
        return None
    if size is not None and size > vocab_size:
        raise ValueError(f"speculative_draft_vocab {size} is more than the draft's vocabulary of {vocab_size} tokens")
    if size == 0:
        return None
    if not path.is_file():
        raise ValueError(f"speculative_draft_vocab needs {path}: the draft's token ids ranked by use "
                         f"(python -m octavo.spec_decode.draft_vocab {folder} FILE... writes it)")
    ranks = read_json_file(path)
    if not isinstance(ranks, dict):
        raise ValueError(f"{path}: expected an object with token_ids (speculative_draft_vocab)")
    if size is None:
        size = ranks.get("head_size")
        if size is None:
            return None
        if not isinstance(size, int) or not 0 < size <= vocab_size:
            raise ValueError(f"{path}: head_size must be a token count from 1 to {vocab_size}, got {size!r}")
    ids = ranks.get("token_ids")
    if not isinstance(ids, list) or len(ids) < size:
        raise ValueError(f"{path}: token_ids must be a list of at least {size} token ids (speculative_draft_vocab)")
    kept = ids[:size]
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in kept) or len(set(kept)) != size:
        raise ValueError(f"{path}: token_ids must hold distinct token ids below the vocabulary size {vocab_size}")
    return sorted(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description="Rank a draft model's tokens by their use in text files.")
    parser.add_argument("draft", help="the draft model's folder (its tokenizer; the ranking is written there)")
    parser.add_argument("files", nargs="+", type=Path, help="text files to count tokens in")
    parser.add_argument("--head-size", type=int, help="the head size the draft runs with by default "
                        "(default: the whole vocabulary unless speculative_draft_vocab says otherwise)")
    args = parser.parse_args()
    from octavo.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.draft)
    counts = count_tokens(lambda text: tokenizer.encode(text, add_special_tokens=False),
                          (f.read_text(encoding="utf-8", errors="replace") for f in args.files), tokenizer.vocab_size)
    path = write_ranks(args.draft, counts, f"{len(args.files)} text files", args.head_size)
    print(f"{path}: {sum(counts)} tokens counted, {sum(c > 0 for c in counts)} of {len(counts)} token ids used")


if __name__ == "__main__":
    main()
