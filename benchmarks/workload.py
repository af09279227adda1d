"""Seeded synthetic workloads: prompts as token ids plus a fixed output length each.

Outputs are forced to their length (``ignore_eos``), so every engine does the
same amount of work whatever its random weights predict.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class LengthDist:
    """A lognormal length with the given median, clipped to [low, high]."""

    median: int
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        return max(self.low, min(self.high, round(rng.lognormvariate(math.log(self.median), self.sigma))))

    def describe(self) -> str:
        return f"lognormal(median={self.median}, sigma={self.sigma}) clipped to [{self.low}, {self.high}]"


# ShareGPT-like: chat prompts cluster around a hundred tokens with a long tail;
# answers are a little longer and rarely beyond a few hundred tokens.
SHAREGPT_INPUT = LengthDist(median=100, sigma=1.0, low=4, high=1024)
SHAREGPT_OUTPUT = LengthDist(median=128, sigma=0.8, low=4, high=512)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    description: str

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError("output_lens must have one entry per prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (for quick or expensive peers)."""
        return Workload(self.name, self.prompts[:n], self.output_lens[:n], self.description)

    def summary(self) -> dict[str, object]:
        ins = sorted(len(p) for p in self.prompts)
        outs = sorted(self.output_lens)
        return {
            "name": self.name,
            "description": self.description,
            "num_requests": len(self.prompts),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "median_prompt_len": ins[len(ins) // 2],
            "median_output_len": outs[len(outs) // 2],
            "max_seq_len": self.max_seq_len,
        }


def ordinary_token_ids(model: Path) -> list[int]:
    """Every id of the model's vocabulary except the tokenizer's special tokens,
    so a random prompt never contains an EOS or a chat marker."""
    from tokenizers import Tokenizer

    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    special = {i for i, t in Tokenizer.from_file(str(model / "tokenizer.json")).get_added_tokens_decoder().items()
               if t.special}
    return [i for i in range(vocab_size) if i not in special]


def _random_ids(rng: random.Random, n: int, token_ids: Sequence[int]) -> list[int]:
    return [rng.choice(token_ids) for _ in range(n)]


def sharegpt_like(num_requests: int, token_ids: Sequence[int], seed: int = 0,
                  inputs: LengthDist = SHAREGPT_INPUT, outputs: LengthDist = SHAREGPT_OUTPUT) -> Workload:
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompts.append(_random_ids(rng, inputs.sample(rng), token_ids))
        output_lens.append(outputs.sample(rng))
    desc = f"inputs {inputs.describe()}, outputs {outputs.describe()}, uniform random token ids, seed {seed}"
    return Workload("sharegpt-like", prompts, output_lens, desc)


def shared_prefix(num_requests: int, token_ids: Sequence[int], prefix_len: int = 512, suffix_low: int = 16,
                  suffix_high: int = 64, output_len: int = 32, seed: int = 0) -> Workload:
    """One long common system prompt followed by a short unique question each."""
    if num_requests < 1 or prefix_len < 1:
        raise ValueError("num_requests and prefix_len must be >= 1")
    rng = random.Random(seed)
    prefix = _random_ids(rng, prefix_len, token_ids)
    prompts = [prefix + _random_ids(rng, rng.randint(suffix_low, suffix_high), token_ids)
               for _ in range(num_requests)]
    desc = (f"shared prefix of {prefix_len} tokens + unique suffix uniform in [{suffix_low}, {suffix_high}], "
            f"{output_len} output tokens each, seed {seed}")
    return Workload("shared-prefix", prompts, [output_len] * num_requests, desc)
