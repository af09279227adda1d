"""A served engine's own steps, read from its step record (``octavo serve
--step-record PATH``, octavo/engine/step_record.py), for the served fit
(``ServedCost.fit_steps``).

What a served step costs is the time from its start to the next step's
start: the step itself, then sending its outputs to the front and taking in
the requests that arrived, all while the front and any other work compete
for the cores. A step after which the engine went idle has no such next
start and is left out; so is the first step after an idle wait, whose
start the wait decided.

A step of a token count the engine has not run before pays one-off costs
(kernels prepared for the new shape) that a long-running server has paid:
at load 9 such steps took 4.1x their bare prediction (median), against
1.05x for counts run before. Varied prompt lengths make hundreds of such
steps in a short calibration (283 of 2,051 prompt steps), so a step is left
out when no step before it in the record computed as many tokens.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from octavo.simulate.cost_model import StepWork, work_of

# A record line holds at most this many scheduled requests: what one step of any engine schedules is far fewer,
# and the bound keeps a corrupt line from building a huge list.
MAX_SCHEDULED = 1 << 16


@dataclass(frozen=True)
class ServedStep:
    """One step of a served engine: its work, and the seconds from its start to the next one's."""

    work: StepWork
    seconds: float


def read_served_steps(path: str | Path, since: float = -math.inf, until: float = math.inf) -> list[ServedStep]:
    """The steps of the record at ``path`` that started in [``since``, ``until``) (``time.monotonic()``), were
    followed by another without an idle wait and computed a token count some earlier step had (docstring)."""
    lines = _read_lines(path)
    steps, counts_run = [], set()
    for (start, scheduled, _idle), (next_start, _, next_idle) in zip(lines, lines[1:]):
        work = work_of(scheduled)
        count = work.prefill_tokens + work.decode_seqs
        if since <= start < until and not next_idle and next_start > start and count in counts_run:
            steps.append(ServedStep(work, next_start - start))
        counts_run.add(count)
    return steps


def _read_lines(path: str | Path) -> list[tuple[float, list[tuple[int, int, bool]], bool]]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"served_steps: cannot read {path}: {exc}") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            scheduled = record["scheduled"]
            if not isinstance(scheduled, list) or len(scheduled) > MAX_SCHEDULED:
                raise ValueError(f"scheduled: a list of at most {MAX_SCHEDULED} triples expected")
            triples = [(int(n), int(pos), bool(sample)) for n, pos, sample in scheduled]
            lines.append((float(record["start"]), triples, bool(record["after_idle"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"served_steps: {path} line {number} is not a step record line: {exc}") from None
    return lines
