"""Peers as each lives in a process of its own (benchmarks/peer_process.py; moe.py's, roofline.py's batch-1
decode, quantization.py's): built there from what pickles (a checkpoint folder, options, the offline workload), each with
``decode(prompt, n)`` (one greedy request of ``n`` tokens) and ``offline()`` (the offline workload at once), and
the Octavo engine's byte counts asked from the process that holds its weights."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.peers.hf import HFPeer
from benchmarks.workload import Workload
from octavo import LLM, SamplingParams
from octavo.model.layers.latent_up_projection import HeadProducts
from octavo.model.layers.moe import FusedMoE
from octavo.quant.base import LinearWeightHolder


class OctavoEngine:
    """An Octavo engine (``options``: LLM's keyword arguments; ``offline`` None: batch-1 decode only)."""

    def __init__(self, folder: Path, options: dict[str, Any], offline: Optional[Workload]) -> None:
        self.llm = LLM(str(folder), **options)
        self.workload = offline

    def _generate(self, workload: Workload) -> None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        outs = self.llm.generate(workload.prompts, params, use_tqdm=False)
        if [len(o.outputs[0].token_ids) for o in outs] != list(workload.output_lens):
            raise RuntimeError("octavo generated other lengths than asked")

    def decode(self, prompt: list[int], tokens: int) -> None:
        self._generate(Workload("decode", [prompt], [tokens], "batch-1 decode"))

    def offline(self) -> None:
        if self.workload is None:
            raise RuntimeError("this Octavo peer was built without an offline workload")
        self._generate(self.workload)

    def active_bytes(self) -> float:
        """Weight bytes one batch-1 token reads: every linear layer whole, each expert layer's top-k share."""
        runner = self.llm.engine.executor.worker.runner
        top_k = runner.arch.experts.top_k
        total = 0.0
        for module in runner.model.modules():
            if isinstance(module, FusedMoE):
                total += module.weight_method.weight_bytes(module) * top_k / module.num_experts
            elif isinstance(module, LinearWeightHolder) and isinstance(module.prepared, HeadProducts):
                # Latent attention's kv_b_proj: decode reads its per-head copies, prefill the weight as loaded.
                total += module.prepared.keys.nbytes + module.prepared.values.nbytes
            elif isinstance(module, LinearWeightHolder):
                total += module.weight_method.weight_bytes(module)
        return total

    def head_bytes(self) -> int:
        head = self.llm.engine.executor.worker.runner.model.lm_head
        return head.weight_method.weight_bytes(head)

    def latent_kv(self, config: dict[str, Any]) -> Optional[dict[str, Any]]:
        """KV bytes per token the engine keeps (its cache specs) against full K and V of every head, or None
        for a model without latent attention."""
        if "kv_lora_rank" not in config:
            return None
        specs = self.llm.engine.executor.worker.runner.kv_cache_specs
        ours = sum(spec.bytes_per_token for spec in specs)
        element = torch.empty((), dtype=specs[0].dtype).element_size()
        head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]
        full = config["num_hidden_layers"] * config["num_attention_heads"] * head * element
        return {"latent_bytes_per_token": ours, "full_kv_bytes_per_token": full, "smaller_by": 1 - ours / full}

    def close(self) -> None:
        self.llm.shutdown()


class TransformersEngine:
    """transformers in bf16: one request, or the offline workload as one static batch."""

    def __init__(self, folder: Path, offline: Workload) -> None:
        self.hf = HFPeer(folder, "bfloat16")
        self.workload = offline

    def decode(self, prompt: list[int], tokens: int) -> None:
        self.hf._run_batch([prompt], tokens)

    def offline(self) -> None:
        self.hf._run_batch(self.workload.prompts, max(self.workload.output_lens))


class LlamaCppEngine:
    """llama.cpp on one GGUF file: one sequence for batch-1 decode, and unless ``offline`` is None a batched
    context of one sequence per request (benchmarks/peers/llamacpp_batch.py)."""

    def __init__(self, folder: Path, gguf: Path, n_ctx: int, threads: int, extra_bufts: bool,
                 offline: Optional[Workload]) -> None:
        from benchmarks.peers.llamacpp import LlamaCppPeer
        from benchmarks.peers.llamacpp_batch import LlamaCppContext

        self.peer = LlamaCppPeer(folder, n_ctx, threads, gguf=gguf, extra_bufts=extra_bufts)
        self.workload = offline
        self.context = None if offline is None else LlamaCppContext(
            self.peer.llm, n_ctx=len(offline.prompts) * n_ctx, n_batch=2048, n_seq=len(offline.prompts))

    def decode(self, prompt: list[int], tokens: int) -> None:
        self.peer.generate_each([prompt], tokens)

    def offline(self) -> None:
        if self.context is None:
            raise RuntimeError("this llama.cpp peer was built without its offline context")
        self.context.generate(self.workload.prompts, self.workload.output_lens)

    def close(self) -> None:
        if self.context is not None:
            self.context.close()
