"""Octavo's offline ``LLM.generate`` as a peer: all requests submitted at once,
batched continuously by the engine."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.report import PeerResult
from benchmarks.workload import Workload

if TYPE_CHECKING:
    from octavo.engine.stats import EngineStats


def engine_options(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """LLM's keyword arguments (the dtype aside) from the options benchmarks.throughput.add_common_args defines."""
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "attention_backend": args.attention_backend,
            "linear_backend": args.linear_backend, "fused_ops": not args.no_fused_ops, "device": args.device,
            "enforce_eager": args.enforce_eager, "quantization": args.quantization, **overrides}


class OctavoPeer:
    name = "octavo"

    def __init__(self, model: Path, dtype: str, **engine_args: Any) -> None:
        from octavo import LLM

        self.model_path = model
        self.engine_args = engine_args
        self.llm = LLM(model=str(model), dtype=dtype, **engine_args)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> OctavoPeer:
        """Built from the options benchmarks.throughput.add_common_args defines."""
        return cls(args.model, args.dtype, **engine_options(args, **overrides))

    def stats(self) -> EngineStats:
        return self.llm.engine.get_stats()

    def generate(self, workload: Workload) -> list[Any]:
        from octavo import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        outputs = self.llm.generate(workload.prompts, params, use_tqdm=False)
        for out, want in zip(outputs, workload.output_lens):
            got = len(out.outputs[0].token_ids)
            if got != want:
                raise RuntimeError(f"request {out.request_id}: {got} tokens generated, {want} requested")
        return outputs

    def start_decoding(self, prompts: list[list[int]], steps: int) -> list[str]:
        """Add the prompts (room for ``steps`` more tokens each, greedy, no
        outputs before the end) and step the engine until every one is
        prefilled and decoding. Returns their request ids."""
        from octavo import SamplingParams

        engine = self.llm.engine
        # Room for the tokens the first-prefilled prompts decode while the rest prefill.
        params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True, output_kind="final_only")
        ids = [f"decode-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, prompt, params)
        scheduler = engine.scheduler
        while scheduler.num_waiting or not all(r.num_output_tokens for r in scheduler.running):
            engine.step()
        if scheduler.num_running != len(prompts):
            raise RuntimeError(f"{scheduler.num_running} of {len(prompts)} running: the KV cache is too small")
        return ids

    def stop_decoding(self, ids: list[str]) -> None:
        engine = self.llm.engine
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()

    def steady_decode_rate(self, prompts: list[list[int]], steps: int) -> float:
        """Decode tokens/s with every prompt decoding in every timed step: all
        are prefilled first, then ``steps`` engine steps are timed (one new
        token per sequence each), then the requests are aborted. No prefill
        and no ragged end (requests finishing in waves) in the timing."""
        engine = self.llm.engine
        ids = self.start_decoding(prompts, steps)
        start_tokens, start = engine.get_stats().generation_tokens, time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
        tokens = engine.get_stats().generation_tokens - start_tokens
        self.stop_decoding(ids)
        if tokens != steps * len(prompts):
            raise RuntimeError(f"{tokens} tokens in {steps} steps of {len(prompts)} sequences: not all decoded")
        return tokens / elapsed

    def warmup(self) -> None:
        self.generate(Workload("warmup", [[1, 2, 3, 4]] * 2, [2, 2], "warmup"))

    def run(self, workload: Workload) -> PeerResult:
        start = time.perf_counter()
        self.generate(workload)
        elapsed = time.perf_counter() - start
        return PeerResult(
            peer=self.name, model=self.model_path.name, num_requests=len(workload.prompts),
            prompt_tokens=workload.num_prompt_tokens, output_tokens=workload.num_output_tokens,
            elapsed_s=elapsed, notes="continuous batching, paged KV cache",
            extra={k: v for k, v in self.engine_args.items() if v is not None},
        )
