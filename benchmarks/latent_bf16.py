"""Latent attention in bfloat16: the absorbed decode against decompressed attention and against transformers.

    python -m benchmarks.latent_bf16                      # DeepSeek-V3's tiny variant end to end
    python -m benchmarks.latent_bf16 --variant deepseek_v2_lite --skip-model

Decode rows attend in latent space (the query through W_UK, the output through W_UV); transformers, like
Octavo's prefill, decompresses every cached latent into per-head keys and values. In bfloat16 the two round
at different places.

One layer first, at DeepSeek-V2-Lite's sizes (16 heads, a 512 + 64 latent, random weights, benchmarks/
latent_decode.py): each path's output in bfloat16 against the exact one (decompressed in float32 from the
same bfloat16 weights, latents and queries), its largest and its root-mean-square error as fractions of the
exact output's root mean square, beside the floor: the exact output rounded to bfloat16.

Then a tiny random DeepSeek model (tests/model_factory.py), 16 prompts x 32 greedy tokens, against transformers
in float32 on the same tokens (its own greedy output, teacher-forced): the largest logit difference of
Octavo's decode steps (absorbed), of Octavo's prefill of the same positions (decompressed) and of transformers
in bfloat16; and greedy agreement with transformers in bfloat16 and in float32 (positions where both chose the
same token, sequences identical throughout). ``--dense`` makes every layer's MLP dense: a router's near-ties
otherwise turn any rounding into another choice of experts.
"""
from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.latent_decode import cached_contexts, latent_layer, latent_queries
from benchmarks.options import int_list
from benchmarks.report import load_avg, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="deepseek_v3", help="a DeepSeek variant of tests/model_factory.py")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dense", action="store_true", help="every layer's MLP dense (no router)")
    parser.add_argument("--contexts", type=int_list, default=[256, 2048], help="the layer's cached tokens per row")
    parser.add_argument("--skip-model", action="store_true", help="the one-layer measurement only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result: dict[str, Any] = {"layer": [_layer_error(context) for context in args.contexts]}
    for row in result["layer"]:
        print(row)
    if not args.skip_model:
        result.update(_model_agreement(args))
        for key, value in result.items():
            if key != "layer":
                print(f"{key}: {value}")
    write_json(args.json, {**result, "args": vars(args), "load": load_avg()})


def _layer_error(context: int, rows: int = 4, block_size: int = 16) -> dict[str, Any]:
    layer, backend = latent_layer(torch.bfloat16)
    exact_layer, exact_backend = latent_layer(torch.float32)
    for exact, rounded in zip(exact_layer.parameters(), layer.parameters()):
        exact.data.copy_(rounded.data.float())
    q_nope, q_rope = latent_queries(layer, rows, torch.bfloat16)
    torch.manual_seed(1)  # the same block tables for both
    cache, decode_meta, chunks = cached_contexts(layer, backend, context, rows, block_size, torch.bfloat16)
    torch.manual_seed(1)
    exact_cache, _, exact_chunks = cached_contexts(exact_layer, exact_backend, context, rows, block_size,
                                                   torch.float32)
    exact_cache.data.copy_(cache.data.float())

    def decompressed(net: Any, kv: Any, prefills: list[Any], qn: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        return torch.cat([net.decompressed_prefill(qn[c.q_start:c.q_end], qr[c.q_start:c.q_end], None, kv, c)
                          for c in prefills]).float()

    with torch.inference_mode():
        ref = decompressed(exact_layer, exact_cache, exact_chunks, q_nope.float(), q_rope.float())
        outs = {"absorbed": layer.absorbed_decode(q_nope, q_rope, cache, decode_meta).float(),
                "decompressed": decompressed(layer, cache, chunks, q_nope, q_rope)}
    scale = ref.pow(2).mean().sqrt().item()
    # What rounding the exact output to bfloat16 alone costs: no bfloat16 path can do better.
    row: dict[str, Any] = {"context": context,
                           "floor_rms": (ref.bfloat16().float() - ref).pow(2).mean().sqrt().item() / scale}
    for name, out in outs.items():
        err = out - ref
        row[f"{name}_max"] = err.abs().max().item() / scale
        row[f"{name}_rms"] = err.pow(2).mean().sqrt().item() / scale
    return row


def _model_agreement(args: argparse.Namespace) -> dict[str, Any]:
    from octavo import LLM, SamplingParams
    from tests.model_factory import VARIANTS, load_hf_model, make_tiny_model
    from tests.worker.runner_utils import Blocks, make_request, make_runner, step

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randrange(4, 40))] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        arch, overrides = VARIANTS[args.variant]
        dense = {"first_k_dense_replace": 2} if args.dense else {}
        folder = make_tiny_model(tmp, arch, **{**overrides, **dense})
        hf = {dtype: load_hf_model(folder, dtype) for dtype in (torch.float32, torch.bfloat16)}
        greedy = {dtype: [_hf_greedy(model, p, args.new_tokens) for p in prompts] for dtype, model in hf.items()}
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        llm = LLM(folder, dtype="bfloat16")
        ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = make_runner(folder, dtype="bfloat16", num_blocks=64)
        worst = {"absorbed": 0.0, "decompressed": 0.0, "transformers_bf16": 0.0}
        for i, prompt in enumerate(prompts):
            tokens = prompt + greedy[torch.float32][i]
            with torch.inference_mode():
                ref = hf[torch.float32](torch.tensor([tokens])).logits[0].float()
                hf_bf16 = hf[torch.bfloat16](torch.tensor([tokens])).logits[0].float()
            decoded = slice(len(prompt), len(tokens))  # positions whose logits a decode step gives
            blocks = Blocks(runner)
            whole = make_request(f"whole{i}", tokens)
            prefilled = runner.execute_logits(step(blocks.chunk(whole, 0, len(tokens))))[f"whole{i}"]
            req = make_request(f"step{i}", prompt)
            runner.execute_logits(step(blocks.chunk(req, 0, len(prompt))))
            steps = []
            for token in tokens[len(prompt):]:
                req.append_output_token(token)
                steps.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))[f"step{i}"])
            absorbed, target = torch.cat(steps), ref[decoded]
            for name, got in (("absorbed", absorbed), ("decompressed", prefilled[decoded]),
                              ("transformers_bf16", hf_bf16[decoded])):
                worst[name] = max(worst[name], (got.float() - target).abs().max().item())
    return {"max_logit_diff_vs_fp32": worst, "logit_std": ref.std().item(),
            "agreement_with_transformers_bf16": _agreement(ours, greedy[torch.bfloat16]),
            "agreement_with_transformers_fp32": _agreement(ours, greedy[torch.float32]),
            "transformers_bf16_vs_fp32": _agreement(greedy[torch.bfloat16], greedy[torch.float32])}


def _hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return {"tokens": same / sum(map(len, a)), "sequences": sum(p == q for p, q in zip(a, b)) / len(a)}


if __name__ == "__main__":
    main()
