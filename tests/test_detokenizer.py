"""IncrementalDetokenizer against whole-sequence decoding with a byte-level BPE
whose tokens split UTF-8 characters."""
from __future__ import annotations

import random

import pytest

from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.sampling_params import SamplingParams
from sample.utf8_tokenizer import CORPUS, EOS_ID, IM_END_ID, load_utf8_tokenizer

TEXTS = CORPUS + ["Un café ☕ puis 中文 et 🎉🎉 — fin."]
PROMPT = "Réponds:"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_utf8_tokenizer(tmp_path_factory.mktemp("utf8tok"))


def stream(tokenizer, ids, params, chunk_sizes=(1,), finish=True):
    """Feed ``ids`` in chunks; returns (deltas, stop string, detokenizer)."""
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas, stop, pos, i = [], None, 0, 0
    while pos < len(ids) and stop is None:
        size = chunk_sizes[i % len(chunk_sizes)]
        stop = detok.update(ids[pos:pos + size])
        deltas.append(detok.get_delta())
        pos, i = pos + size, i + 1
    if finish:
        detok.finish()
        deltas.append(detok.get_delta())
    return deltas, stop, detok


def test_fixture_really_splits_characters(tokenizer):
    ids = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("chunks", [(1,), (2,), (3, 1, 5)])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_full_decode(tokenizer, text, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, stop, detok = stream(tokenizer, ids, SamplingParams(), chunks)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_flushed_on_finish(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    # The longest prefix that ends inside the emoji.
    truncated = next(
        ids[:k] for k in range(len(ids) - 1, 0, -1) if tokenizer.decode(ids[:k]).endswith("\ufffd")
    )
    full = tokenizer.decode(truncated)
    deltas, _, _ = stream(tokenizer, truncated, SamplingParams(), finish=False)
    held = "".join(deltas)
    # The incomplete character's tokens (here " " + the emoji's first bytes) wait.
    assert full.startswith(held) and "\ufffd" not in held and held.startswith("ok")
    deltas, _, _ = stream(tokenizer, truncated, SamplingParams())
    assert "".join(deltas) == full


def _boundary_crossing_stop(tokenizer, text):
    """A substring of ``text`` (past its middle) that no single token contains."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    for start in range(len(text) // 2, len(text) - 4):
        stop = text[start:start + 4]
        if text.count(stop) == 1 and not any(stop in p for p in pieces):
            return ids, stop
    raise AssertionError("no boundary-crossing substring")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text", [TEXTS[0], TEXTS[1], TEXTS[2]])
def test_stop_string_across_token_boundaries(tokenizer, text, include):
    ids, stop_str = _boundary_crossing_stop(tokenizer, text)
    params = SamplingParams(stop=[stop_str, "never-there"], include_stop_str_in_output=include)
    deltas, stop, detok = stream(tokenizer, ids, params)
    at = text.index(stop_str)
    expected = text[: at + len(stop_str)] if include else text[:at]
    assert stop == stop_str and detok.stop_str == stop_str
    assert detok.text == expected == "".join(deltas)
    assert not any("\ufffd" in d for d in deltas)


def test_earliest_stop_string_wins_and_later_updates_are_ignored(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["lazy", "brown fox", "quick"])
    deltas, stop, detok = stream(tokenizer, ids, params, chunk_sizes=(len(ids),))
    assert stop == "quick" and detok.text == "The "
    assert detok.update(tokenizer.encode(" more", add_special_tokens=False)) is None
    assert detok.text == "The " and detok.get_delta() == ""


def test_hold_back_never_leaks_a_stop_string_prefix(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. Stop here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop_str = "the lazy cat"  # never matches, but its prefix "the lazy " does
    params = SamplingParams(stop=[stop_str])
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    sent = ""
    for t in ids:
        assert detok.update([t]) is None
        sent += detok.get_delta()
        # Everything but the last len(stop) - 1 characters has been released.
        assert sent == detok.text[: max(0, len(detok.text) - (len(stop_str) - 1))]
    detok.finish()
    assert sent + detok.get_delta() == text


def test_no_hold_back_without_stop_strings(tokenizer):
    ids = tokenizer.encode(TEXTS[4], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids)
    assert detok.get_delta() == TEXTS[4]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = (
        tokenizer.encode("Le café", add_special_tokens=False)
        + [IM_END_ID]
        + tokenizer.encode(" 中文", add_special_tokens=False)
        + [EOS_ID]
    )
    deltas, _, detok = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text == expected
    assert ("</s>" in expected) is not skip


def test_random_token_streams_match_full_decode(tokenizer):
    rng = random.Random(0)
    pool = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    for _ in range(20):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        deltas, _, _ = stream(tokenizer, ids, SamplingParams(), chunk_sizes=(rng.randint(1, 4),))
        assert "".join(deltas) == tokenizer.decode(ids)


def test_work_per_update_is_bounded(tokenizer):
    """Each token costs O(1) decoded tokens, not a re-decode of the whole output."""
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)] * 3
    detok = IncrementalDetokenizer(Counting(), tokenizer.encode(PROMPT, add_special_tokens=False), SamplingParams())
    for t in ids:
        detok.update([t])
    assert detok.text == tokenizer.decode(ids)
    assert max(decoded) <= 12
    assert sum(decoded) <= 12 * len(ids)


def test_a_whole_output_at_once_decodes_like_token_by_token(tokenizer):
    """What the engine does for final_only requests: one update with every id."""
    rng = random.Random(1)
    pool = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    for _ in range(20):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        at_once, _, _ = stream(tokenizer, ids, SamplingParams(), chunk_sizes=(len(ids),))
        one_by_one, _, _ = stream(tokenizer, ids, SamplingParams())
        assert "".join(at_once) == "".join(one_by_one) == tokenizer.decode(ids)
