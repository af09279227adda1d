"""Adding a model family: a file with its model class and one ``register_model`` call.

The toy here is a "parallel block" decoder (GPT-J's layout: attention and the MLP read the same
normed input and both add to the residual stream), which no built-in family has. It is written
against the seams only (CausalLM, the Attention and GatedMLP layers) and registered from this
file; the engine then serves it with the paged cache, batching and chunked prefill, and its greedy
tokens and logits match a plain full-recompute implementation of the same network."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

from octavo import LLM, SamplingParams
from octavo.attention.base import AttentionMetadata
from octavo.attention.kv_quant import LayerKVCache
from octavo.model.backends import ModelBackends
from octavo.model.config import ArchConfig
from octavo.model.layers.attention import Attention, AttentionOptions
from octavo.model.layers.mlp import GatedMLP
from octavo.model.layers.norm import RMSNorm
from octavo.model.models.causal_lm import CausalLM
from octavo.model.registry import register_model
from tests.model_factory import write_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB, THETA = 64, 4, 2, 16, 96, 2, 512, 10000.0


class ParallelBlockLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backends.ops)
        self.self_attn = Attention(arch, layer_idx, backends, f"{prefix}.self_attn", AttentionOptions())
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, False, backends, f"{prefix}.mlp")
        self.rope_index = 0

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        stream = h if residual is None else h + residual
        normed = self.input_layernorm(stream)
        return self.self_attn(normed, cos, sin, kv_cache, meta) + self.mlp(normed), stream


class ToyParallelForCausalLM(CausalLM):
    def make_layer(self, arch: ArchConfig, layer_idx: int, backends: ModelBackends) -> nn.Module:
        return ParallelBlockLayer(arch, layer_idx, backends)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def w(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": 1 + w(HIDDEN),
           "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": 1 + w(HIDDEN),
                f"{p}.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
                f"{p}.mlp.gate_proj.weight": w(INTER, HIDDEN),
                f"{p}.mlp.up_proj.weight": w(INTER, HIDDEN),
                f"{p}.mlp.down_proj.weight": w(HIDDEN, INTER)}
    return out


def _reference_logits(weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """The same network computed over the whole sequence at once, no cache: [len, vocab]."""
    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * F.rms_norm(x, (x.shape[-1],), eps=1e-6)

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    n = len(tokens)
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    h = weights["model.embed_tokens.weight"][tokens]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        x = norm(h, weights[f"{p}.input_layernorm.weight"])
        q = rotate((x @ weights[f"{p}.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), cos, sin)
        k = rotate((x @ weights[f"{p}.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), cos, sin)
        v = (x @ weights[f"{p}.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True).transpose(0, 1).reshape(n, HEADS * HEAD_DIM)
        mlp = (F.silu(x @ weights[f"{p}.mlp.gate_proj.weight"].T) * (x @ weights[f"{p}.mlp.up_proj.weight"].T)
               ) @ weights[f"{p}.mlp.down_proj.weight"].T
        h = h + attn @ weights[f"{p}.self_attn.o_proj.weight"].T + mlp
    return norm(h, weights["model.norm.weight"]) @ weights["lm_head.weight"].T


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    register_model("ToyParallelForCausalLM", ToyParallelForCausalLM)
    folder = tmp_path_factory.mktemp("toy-parallel")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["ToyParallelForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": THETA, "hidden_act": "silu", "torch_dtype": "float32", "eos_token_id": 0,
    }))
    save_file(_weights(), str(folder / "model.safetensors"))
    write_tokenizer(folder, VOCAB)
    return folder


@pytest.mark.parametrize("chunk", [256, 8])  # whole prompts in one step; chunked prefill beside decodes
def test_a_registered_family_runs_through_the_engine_as_written(toy_folder, chunk):
    llm = LLM(str(toy_folder), dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=chunk)
    prompts = [[5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11], [300, 2, 2, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    weights = _weights()
    for prompt, out in zip(prompts, outputs):
        tokens = list(prompt)
        completion = out.outputs[0]
        for step, token in enumerate(completion.token_ids):
            logits = _reference_logits(weights, tokens)[-1]
            assert token == int(logits.argmax()), f"step {step} of {prompt}"
            chosen = completion.logprobs[step]
            assert chosen.token_id == token and chosen.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=2e-4)
            tokens.append(token)
