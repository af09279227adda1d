"""What one long generation's outputs cost per step, early and late.

A request's output used to be rebuilt whole every step (its token and
logprob lists copied), so step k cost O(k) and a generation O(N^2); with
RequestOutputKind.DELTA (what the engine process sends) each step costs the
same. Two measurements on a tiny random model (the forward is cheap, so the
output path shows):

- in process: the time of ``RequestState.make_output`` per step, the first
  and the last 10% of the steps, for ``--kind`` cumulative / delta;
- through the engine process (``AsyncEngineClient``, the server's path):
  the wall time of the whole generation.

    python -m benchmarks.output_deltas --tokens 2000 --logprobs 5
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from octavo.config import CacheConfig, EngineConfig, ModelConfig
from octavo.engine import request_state
from octavo.engine.async_client import AsyncEngineClient
from octavo.entrypoints.llm import LLM
from octavo.sampling_params import SamplingParams
from tests.model_factory import make_tiny_model


def in_process(folder: Path, params: SamplingParams) -> dict[str, float]:
    llm = LLM(str(folder), dtype="float32", num_blocks=512, enable_prefix_caching=False)
    times: list[float] = []
    original = request_state.RequestState.make_output

    def timed(self):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = original(self)
        times.append(time.perf_counter() - start)
        return out

    request_state.RequestState.make_output = timed
    try:
        llm.engine.add_request("long", [5, 6, 7], params)
        start = time.perf_counter()
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        total = time.perf_counter() - start
    finally:
        request_state.RequestState.make_output = original
    tenth = max(1, len(times) // 10)
    return {
        "make_output_first_us": statistics.mean(times[:tenth]) * 1e6,
        "make_output_last_us": statistics.mean(times[-tenth:]) * 1e6,
        "make_output_total_ms": sum(times) * 1e3,
        "generation_s": total,
    }


async def through_engine_process(folder: Path, params: SamplingParams) -> dict[str, float]:
    config = EngineConfig(ModelConfig(str(folder), dtype="float32"), CacheConfig(num_blocks=512))
    client = await AsyncEngineClient.start(config, timeout_s=300)
    try:
        start = time.perf_counter()
        async for _ in client.generate("long", [5, 6, 7], params):
            pass
        return {"e2e_s": time.perf_counter() - start}
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--kinds", default="cumulative,delta", help="output kinds measured in process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(tmp, "llama", max_position_embeddings=args.tokens + 64)
        base = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=args.logprobs)
        for kind in args.kinds.split(","):
            result = in_process(folder, dataclasses.replace(base, output_kind=kind))
            print(f"in process, {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
        result = asyncio.run(through_engine_process(folder, base))
        print("engine process: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
