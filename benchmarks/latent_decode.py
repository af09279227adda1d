"""Decode attention of one multi-head latent attention layer (DeepSeek-V2-Lite's shape: 16 heads,
a 512 + 64 latent, keys of 128 + 64, values of 128), random weights: the engine's way, the query
absorbed into the latent space and the backend's decode reading the cached latents in place,
against decompressing every row's cached context through kv_b_proj each step (what a decode step
would cost without absorption), and the absorbed decode's per-head products by torch.bmm on views of
kv_b_proj's weight instead of the experts kernel on its per-head copies (bf16: latent_up_projection.py).
Timed in turns; the outputs are checked equal first.

    python -m benchmarks.latent_decode --contexts 256,2048 --rows 4 --dtype bfloat16
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks.options import int_list
from benchmarks.report import load_avg, print_table, write_json
from benchmarks.turns import in_turns

V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "num_attention_heads": 16,
           "num_hidden_layers": 27, "intermediate_size": 10944, "vocab_size": 102400, "kv_lora_rank": 512,
           "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "n_shared_experts": 2,
           "first_k_dense_replace": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int_list, default=[256, 2048], help="tokens cached per decode row")
    parser.add_argument("--rows", type=int, default=4, help="decode rows in the step")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--backend", default="auto", help="attention backend (auto: native on CPU)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    layer, backend = latent_layer(dtype, args.backend)
    q_nope, q_rope = latent_queries(layer, args.rows, dtype)
    n = args.rows
    load_start = load_avg()
    results = []
    for context in args.contexts:
        cache, decode_meta, chunks = cached_contexts(layer, backend, context, n, args.block_size, dtype)

        def absorbed() -> torch.Tensor:
            return layer.absorbed_decode(q_nope, q_rope, cache, decode_meta)

        def absorbed_bmm() -> torch.Tensor:
            heads, layer.kv_b_proj.prepared = layer.kv_b_proj.prepared, None
            try:
                return absorbed()
            finally:
                layer.kv_b_proj.prepared = heads

        def decompressed() -> torch.Tensor:
            return torch.cat([layer.decompressed_prefill(q_nope[c.q_start:c.q_end], q_rope[c.q_start:c.q_end],
                                                         None, cache, c) for c in chunks])

        with torch.inference_mode():
            diff = (absorbed().float() - decompressed().float()).abs().max().item()
            median = in_turns({"absorbed": absorbed, "absorbed_bmm": absorbed_bmm, "decompressed": decompressed},
                              args.repeats)
        results.append({"context": context, "absorbed_ms": median["absorbed"] * 1e3,
                         "absorbed_bmm_ms": median["absorbed_bmm"] * 1e3,
                         "decompressed_ms": median["decompressed"] * 1e3,
                         "speedup": median["decompressed"] / median["absorbed"], "max_abs_diff": diff})
    load = f"load {load_start} -> {load_avg()}"
    print_table(results, ["context", "absorbed_ms", "absorbed_bmm_ms", "decompressed_ms", "speedup", "max_abs_diff"],
                title=f"latent decode attention, one layer, {n} rows, {args.dtype}, {backend.name} backend "
                      f"({args.threads} threads, median of {args.repeats}, in turns; {load})")
    write_json(args.json, {"benchmark": "latent_decode", "args": vars(args), "results": results})


def latent_layer(dtype: torch.dtype, backend_name: str = "auto", seed: int = 0) -> tuple[Any, Any]:
    """(a LatentAttention layer of DeepSeek-V2-Lite's shape with weights drawn from N(0, 0.02), its backend)."""
    from octavo.attention.registry import select_attention_backend
    from octavo.model.backends import ModelBackends
    from octavo.model.config import parse_arch_config
    from octavo.model.layers.latent_attention import LatentAttention
    from octavo.model.loader import default_dtype

    backend = select_attention_backend(backend_name, torch.device("cpu"), dtype, dtype, {None})
    with default_dtype(dtype):
        layer = LatentAttention(parse_arch_config(V2_LITE), 1, ModelBackends(attention=backend),
                                "model.layers.1.self_attn")
    torch.manual_seed(seed)
    for param in layer.parameters():
        param.data.normal_(0, 0.02)
    layer.kv_b_proj.finish_loading()  # as the loader does: the per-head copies decode reads (bf16)
    return layer, backend


def latent_queries(layer: Any, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (q_nope, q_rope) of ``rows`` decode rows."""
    return (torch.randn(rows, layer.num_heads, layer.nope_dim).to(dtype),
            torch.randn(rows, layer.num_heads, layer.rope_dim).to(dtype))


def cached_contexts(layer: Any, backend: Any, context: int, rows: int, block_size: int,
                    dtype: torch.dtype) -> tuple[Any, Any, list[Any]]:
    """(a cache of random latents holding ``rows`` contexts of ``context`` tokens in scattered blocks, the
    metadata of a decode step of those rows, the same rows as prefill chunks over their cached contexts)."""
    from octavo.attention.base import StepLayout

    cpu = torch.device("cpu")
    blocks = -(-context // block_size)
    cache = backend.allocate_cache(layer.kv_cache_spec(block_size, dtype), rows * blocks, cpu)
    cache.data.normal_()
    table = torch.randperm(rows * blocks).view(rows, blocks)  # scattered blocks, as a busy pool has them
    last = context - 1
    slots = table[:, last // block_size] * block_size + last % block_size

    def layout(decodes: int) -> StepLayout:
        return StepLayout(block_size, decodes, list(range(rows)), [1] * rows, [context] * rows, [blocks] * rows,
                          table, slots, cpu)

    return cache, backend.build_metadata(layout(rows)), backend.build_metadata(layout(0)).prefills


if __name__ == "__main__":
    main()
