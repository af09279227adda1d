"""Rank octavo-mini-draft's tokens by their use in the default models' training split (the held-out files
excluded), for its cut LM head (``speculative_draft_vocab``, octavo/spec_decode/draft_vocab.py). Its default
head size, 1024: the whole head, on the held-out files, proposed 46 distinct tokens, none ranked past 220.

    python tools/default_model_draft_vocab.py --draft octavo/assets/octavo-mini-draft
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_corpus import build_corpus  # noqa: E402

from octavo.spec_decode.draft_vocab import count_tokens, write_ranks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, required=True, help="the draft model's folder")
    parser.add_argument("--head-size", type=int, default=1024, help="the head size it runs with by default")
    args = parser.parse_args()
    tok = Tokenizer.from_file(str(args.draft / "tokenizer.json"))
    corpus = build_corpus()
    counts = count_tokens(lambda text: tok.encode(text, add_special_tokens=False).ids,
                          (d.text for d in corpus.train), tok.get_vocab_size())
    path = write_ranks(args.draft, counts, f"the default models' training split ({len(corpus.train)} documents)",
                       args.head_size)
    print(f"{path}: {sum(counts)} tokens counted, {sum(c > 0 for c in counts)} of {len(counts)} token ids used")


if __name__ == "__main__":
    main()
