"""Hugging Face transformers ``generate`` as a peer: static padded batches.

Each batch is the next ``batch_size`` requests in arrival order, left-padded
to its longest prompt and decoded greedily until its longest requested output
(``min_new_tokens`` keeps EOS from ending it early). Only the requested tokens
count as output: the steps a short request spends waiting for its batch-mates
are the cost of static batching.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch

from benchmarks.report import PeerResult
from benchmarks.workload import Workload


class HFPeer:
    name = "hf"

    def __init__(self, model: Path, dtype: str, device: str = "cpu") -> None:
        import transformers

        self.model_path = model
        self.device = torch.device(device)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype)).eval().to(self.device)
        self.pad_id = self.model.config.pad_token_id or 0

    @torch.inference_mode()
    def _run_batch(self, prompts: Sequence[list[int]], output_len: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False, max_new_tokens=output_len,
            min_new_tokens=output_len, pad_token_id=self.pad_id,
        )
        if out.shape[1] != width + output_len:
            raise RuntimeError(f"generate returned {out.shape[1] - width} tokens, wanted {output_len}")

    def warmup(self) -> None:
        self._run_batch([[1, 2, 3, 4]], 2)

    def run(self, workload: Workload, batch_size: int) -> PeerResult:
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), batch_size):
            self._run_batch(workload.prompts[i:i + batch_size], max(workload.output_lens[i:i + batch_size]))
        elapsed = time.perf_counter() - start
        return PeerResult(
            peer=self.name, model=self.model_path.name, num_requests=len(workload.prompts),
            prompt_tokens=workload.num_prompt_tokens, output_tokens=workload.num_output_tokens,
            elapsed_s=elapsed, notes=f"static batches of {batch_size}, left padding, greedy",
            extra={"batch_size": batch_size},
        )

    def sweep(self, workload: Workload, batch_sizes: Sequence[int]) -> tuple[PeerResult, list[PeerResult]]:
        """Run every batch size; the best output tokens/s is HF's number."""
        runs = [self.run(workload, bs) for bs in batch_sizes]
        return max(runs, key=lambda r: r.output_tok_s), runs
