"""llama.cpp (through llama-cpp-python) as a peer.

Offline, the high-level ``Llama`` API holds one sequence: requests run one
after another (prefill in ``n_batch`` chunks, then one token per decode
call). That is its offline behaviour; llama.cpp batches several sequences
only in its server (see benchmarks/online.py).
"""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.report import PeerResult
from benchmarks.workload import Workload


def gguf_path(model: Path) -> Path:
    """Where tools/make_bench_models.py --gguf puts the converted checkpoint."""
    path = model / "model-bf16.gguf"
    if not path.is_file():
        raise ValueError(
            f"no {path.name} in {model}: run tools/make_bench_models.py --gguf --llama-cpp-src <llama.cpp source>"
        )
    return path


class LlamaCppPeer:
    name = "llamacpp"

    def __init__(self, model: Path, n_ctx: int, threads: int, n_batch: int = 512) -> None:
        from llama_cpp import Llama

        self.model_path = model
        self.n_batch = n_batch
        self.llm = Llama(model_path=str(gguf_path(model)), n_ctx=n_ctx, n_batch=n_batch,
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    def _generate(self, prompt: list[int], output_len: int) -> None:
        made = 0
        # top_k=1 with temp=0 is llama.cpp's greedy sampler; EOS is not checked
        # here, so the generator runs for exactly output_len tokens.
        for _ in self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            made += 1
            if made == output_len:
                break

    def warmup(self) -> None:
        self._generate([1, 2, 3, 4], 2)

    def generate(self, workload: Workload) -> None:
        for prompt, n in zip(workload.prompts, workload.output_lens):
            self._generate(prompt, n)

    def run(self, workload: Workload) -> PeerResult:
        start = time.perf_counter()
        self.generate(workload)
        elapsed = time.perf_counter() - start
        return PeerResult(
            peer=self.name, model=self.model_path.name, num_requests=len(workload.prompts),
            prompt_tokens=workload.num_prompt_tokens, output_tokens=workload.num_output_tokens,
            elapsed_s=elapsed, notes=f"llama-cpp-python Llama API, one sequence at a time, n_batch={self.n_batch}",
        )
