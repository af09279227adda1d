"""Quest's accuracy where the default model retrieves: a pass key in repeated filler, scored under teacher forcing.

    python -m benchmarks.needle --contexts 4096,8192 --top-pages 32,64,128,192,248

The prompt, plain text (no chat template): a line asking the reader to remember a pass key, one short passage
repeated, the pass-key sentences at each of ``--depths`` of the filler (on a passage's boundary), then "What is the
pass key? The pass key". ``--keys`` pass keys (five digits, one token each for this tokenizer) at each depth. The
answer is forced: each request is decoded greedily under a regex constraint to " is NNNNN" (teacher forcing: the
logprobs are the raw model's, taken before the constraint's mask). Each of the answer's six tokens (" " and the
digits) comes from a decode step, where Quest chooses the pages it reads; so does the prompt's last token, which
a prefix-cached pass computes alone (``Scorer``). The answer's last digit ends the sequence at most ``--contexts``
tokens in, and less than a block short of it.

One engine for every mode (``Scorer``): dense, then Quest at each ``--top-pages`` K (pages of 16 tokens, the first
among them, and ``--recent-pages`` R more; a K that reads every page is left out). Per mode and context:

- exact: the cases whose every answer token is the model's greedy choice (rank 1 under teacher forcing: greedy
  decoding from the prompt writes the pass key), and how many of them differ from dense's;
- the answer's logprob: the sum of its six tokens' logprobs; against dense, the largest absolute and relative
  change over the cases, and the largest change of any one token's logprob;
- within 1%: every case's answer logprob within 1% of dense's; the smallest such K is printed. pages_read:
  K + R of the context's pages;
- a row of dense with the prompt's last token prefilled with the rest rather than decoded alone: how far the
  answer moves between two dense computations, the floor under which a change says nothing.

Each context's cases are prefilled once, nearly all of the time: at 1 thread and load 11-18 on 2 cores, 6, 7
and 16 minutes for the 15 cases at 1k, 2k and 4k; a mode's pass then takes seconds.
"""
from __future__ import annotations

import argparse
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.report import load_avg, print_table, write_json
from benchmarks.sparse_attention import mode_name

# Written for this check: plain sentences the model has no reason to recall, one passage repeated.
FILLER = " The river runs to the sea. The hills stand still. The wind moves the grass. Day comes and night follows."
INTRO = "A pass key is hidden in the long text below. Remember it: you will be asked for it at the end."
QUESTION = " What is the pass key? The pass key"
# The question's last word, forced with the answer so that the answer's first token comes from a decode step.
FORCED_HEAD = " is"
BLOCK_SIZE = 16
# Quest's K must keep the answer's logprob within this share of dense's on every case.
TOLERANCE = 0.01


@dataclass
class PassKey:
    depth: float
    key: str
    prompt: list[int]
    forced: list[int]  # FORCED_HEAD then the answer, as the tokenizer writes them after the prompt
    answer_tokens: int  # the last ones of ``forced``


def pass_key(tokenizer: Any, context: int, depth: float, seed: int) -> PassKey:
    """The case of ``seed``'s pass key at ``depth`` of the filler (0: right after the opening line, 1: right
    before the question), at most ``context`` tokens from the opening line to the answer's last token (fewer by
    up to a block: the prompt is one token longer than a multiple of the block size, see ``Scorer``)."""
    key = str(random.Random(seed).randrange(10000, 100000))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    intro, passage, question = encode(INTRO), encode(FILLER), encode(QUESTION)
    needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
    answer = encode(f" {key}")
    forced = encode(f"{FORCED_HEAD} {key}")
    if forced[-len(answer):] != answer:
        raise ValueError(f"the tokenizer writes{FORCED_HEAD!r} and the answer together otherwise than apart")
    room = context - len(intro) - len(needle) - len(question) - len(forced)
    room -= (context - len(forced) - 1) % BLOCK_SIZE  # the prompt: a multiple of the block size and one token
    if room < len(passage):
        raise ValueError(f"context {context} leaves no room for the filler: at least "
                         f"{context - room + len(passage)} tokens")
    filler = (passage * (room // len(passage) + 1))[:room]
    at = round(room * depth / len(passage)) * len(passage)
    at = min(at, room // len(passage) * len(passage))
    return PassKey(depth, key, intro + filler[:at] + needle + filler[at:] + question, forced, len(answer))


@dataclass
class Scored:
    """One case decoded in one mode: its answer tokens' logprobs and ranks under teacher forcing."""

    case: PassKey
    logprobs: list[float]
    ranks: list[int]

    @property
    def total(self) -> float:
        return sum(self.logprobs)

    @property
    def exact(self) -> bool:
        return all(rank == 1 for rank in self.ranks)


class Scorer:
    """One engine serving Quest for every mode. Prefill, dense in every mode, is nearly all of the work, and only
    decode differs: so each mode's pass asks for the same prompts again and finds them in the prefix cache (their
    K/V and key bounds), and sets the page budget of the engine's Quest backend before it. Dense is a budget of
    every page, where the backend hands each decode row to the native kernel unchanged. Each prompt is one token
    longer than a multiple of the block size, so that a pass computes its last token alone, by a decode step, and
    then forces the answer one decode step a token."""

    def __init__(self, model: str, cases: Sequence[PassKey], recent_pages: int, **engine: Any) -> None:
        from octavo import LLM

        self.cases = cases
        longest = max(len(c.prompt) + len(c.forced) for c in cases)
        self.dense_pages = -(-longest // BLOCK_SIZE)
        # Every case's blocks stay cached from one pass to the next: K/V and key bounds, with room to spare.
        memory = len(cases) * (self.dense_pages + 1) * BLOCK_SIZE * 32 * 1024
        self.llm = LLM(model, max_model_len=longest, max_num_seqs=len(cases), sparse_attention="quest",
                       sparse_top_pages=self.dense_pages, sparse_recent_pages=recent_pages,
                       kv_cache_memory_bytes=memory, enforce_eager=True, **engine)
        # Steps run eagerly (enforce_eager): a recorded step would keep the budget it was recorded with.
        self.quest = self.llm.engine.executor.worker.runner.backends.attention
        # The prefill, into the prefix cache. Its prompts' last tokens are prefilled with the rest: against the
        # passes after it, what computing one token by decode rather than prefill moves the answer by, densely.
        self.prefilled = self._force(self.dense_pages)

    def score(self, top_pages: Optional[int]) -> list[Scored]:
        """Every case forced through its answer with Quest reading ``top_pages`` (None: every page)."""
        hits = self.llm.engine.scheduler.prefix_cache_hits
        scored = self._force(self.dense_pages if top_pages is None else top_pages)
        missed = sum(len(c.prompt) - 1 for c in self.cases) - (self.llm.engine.scheduler.prefix_cache_hits - hits)
        if missed:
            raise RuntimeError(f"{missed} prompt tokens were not found in the prefix cache: they were prefilled "
                               f"again, and a prompt's last rows densely")
        return scored

    def _force(self, top_pages: int) -> list[Scored]:
        from octavo import SamplingParams
        from octavo.sampling_params import StructuredOutputParams

        self.quest.top_pages = top_pages
        tokenizer = self.llm.get_tokenizer()
        params = [SamplingParams(temperature=0.0, max_tokens=len(c.forced), logprobs=0, structured_outputs=
                                 StructuredOutputParams(regex=re.escape(tokenizer.decode(c.forced))))
                  for c in self.cases]
        outputs = self.llm.generate([c.prompt for c in self.cases], params, use_tqdm=False)
        scored = []
        for case, output in zip(self.cases, outputs):
            completion = output.outputs[0]
            if list(completion.token_ids) != case.forced:
                raise RuntimeError(f"the constraint wrote {list(completion.token_ids)}, not the answer's tokens "
                                   f"{case.forced}: the answer cannot be scored token by token")
            answer = completion.logprobs[-case.answer_tokens:]
            scored.append(Scored(case, [lp.logprob for lp in answer], [lp.rank for lp in answer]))
        return scored

def comparison(context: int, mode: str, scored: Sequence[Scored], dense: Sequence[Scored]) -> dict[str, Any]:
    """A mode's row at one context, against dense's scores of the same cases."""
    changes = [s.total - d.total for s, d in zip(scored, dense)]
    relative = [abs(c) / abs(d.total) for c, d in zip(changes, dense)]
    tokens = [abs(a - b) for s, d in zip(scored, dense) for a, b in zip(s.logprobs, d.logprobs)]
    return {"context": context, "mode": mode, "exact": f"{sum(s.exact for s in scored)}/{len(scored)}",
            "exact_differs": sum(s.exact != d.exact for s, d in zip(scored, dense)),
            "answer_logprob": sum(s.total for s in scored) / len(scored),
            "max_change": max(abs(c) for c in changes), "max_rel_change_pct": 100 * max(relative),
            "max_token_change": max(tokens), "within_1pct": max(relative) < TOLERANCE}


def smallest_within(rows: Sequence[dict[str, Any]], context: int, top_pages: Sequence[int],
                    recent: int) -> Optional[int]:
    """The smallest K of ``top_pages`` within the tolerance on every case at ``context``, None if none is."""
    passing = [k for k in top_pages for r in rows
               if r["context"] == context and r["mode"] == mode_name((k, recent)) and r["within_1pct"]]
    return min(passing, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or GGUF file (default: the default model)")
    parser.add_argument("--contexts", default="8192", help="comma-separated tokens from the opening to the answer")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="comma-separated places of the needle, 0..1")
    parser.add_argument("--keys", type=int, default=5, help="pass keys at each depth")
    parser.add_argument("--top-pages", default="32,64,128,256",
                        help="comma-separated sparse_top_pages to measure (empty: dense alone)")
    parser.add_argument("--recent-pages", type=int, default=2, help="sparse_recent_pages (the engine's default)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each engine")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from octavo.entrypoints.engine_args import resolve_model_path
    from octavo.tokenizer import Tokenizer

    model = resolve_model_path(args.model)
    tokenizer = Tokenizer(model)
    top_pages = [int(k) for k in args.top_pages.split(",") if k]
    load_start, start = load_avg(), time.perf_counter()
    rows: list[dict[str, Any]] = []
    cases_out: list[dict[str, Any]] = []  # every case's answer, per mode: which ones a mode misses
    for context in (int(c) for c in args.contexts.split(",")):
        cases = [pass_key(tokenizer, context, float(depth), seed)
                 for depth in args.depths.split(",") for seed in range(args.keys)]
        scorer = Scorer(model, cases, args.recent_pages, dtype=args.dtype, threads_per_worker=args.threads)
        dense = scorer.score(None)
        pages = scorer.dense_pages
        floor = comparison(context, "dense, last prompt token prefilled", scorer.prefilled, dense)
        rows.append({**floor, "pages_read": f"{pages}/{pages}"})
        print(rows[-1], flush=True)
        # A budget of every page but the recent ones or more reads the context whole: dense exactly.
        for top in [None] + [k for k in top_pages if k + args.recent_pages < pages]:
            scored = dense if top is None else scorer.score(top)
            row = comparison(context, mode_name(None if top is None else (top, args.recent_pages)), scored, dense)
            row["pages_read"] = f"{pages if top is None else top + args.recent_pages}/{pages}"
            rows.append(row)
            cases_out += [{"context": context, "mode": row["mode"], "depth": one.case.depth, "key": one.case.key,
                           "logprobs": one.logprobs, "ranks": one.ranks} for one in scored]
            print(row, flush=True)
        scorer.llm.shutdown()
    print_table(rows, ["context", "mode", "pages_read", "exact", "exact_differs", "answer_logprob", "max_change",
                       "max_rel_change_pct", "max_token_change", "within_1pct"],
                title=f"pass key at depths {args.depths}, {args.keys} keys each, {Path(model).name} {args.dtype}, "
                      f"answer teacher-forced, {args.threads} thread(s)")
    for context in sorted({r["context"] for r in rows}) if top_pages else []:
        chosen = smallest_within(rows, context, top_pages, args.recent_pages)
        print(f"{context} tokens: the smallest K within {TOLERANCE:.0%} of dense's answer logprob on every case: "
              f"{chosen}")
    print(f"load {load_start} -> {load_avg()}, {time.perf_counter() - start:.0f} s")
    write_json(args.json, {"benchmark": "needle", "args": vars(args), "results": rows, "cases": cases_out})


if __name__ == "__main__":
    main()
