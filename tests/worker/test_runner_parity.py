"""ModelRunner logits vs transformers on the same weights and tokens (float32, < 1e-4)."""
from __future__ import annotations

import copy

import pytest
import torch

from octavo.kernels.amx_linear import amx_linear_kernel
from octavo.model.layers.moe import FusedMoE
from tests.model_factory import VARIANTS

from .runner_utils import Blocks, hf_logits, make_request, make_runner, step

TOL = 1e-4
ALL = sorted(VARIANTS)
# The native kernels (decode attention over the block tables, fused norms,
# SiLU, rotary, and in bf16 the AMX kernel for few-row matmuls where the CPU
# has it), and plain torch ops throughout (gather + SDPA, F.linear).
BACKENDS = {"native": {"attention_backend": "native", "fused_ops": True, "linear_backend": "auto"},
            "torch": {"attention_backend": "torch", "fused_ops": False, "linear_backend": "torch"}}


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 512, (length,), generator=gen).tolist()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"max abs diff {diff}"


@pytest.mark.parametrize("name", ALL)
def test_whole_prompt(name, variant, hf_model):
    runner = make_runner(variant(name))
    blocks = Blocks(runner)
    prompt = _prompt(40, seed=1)
    req = make_request("a", prompt)
    logits = runner.execute_logits(step(blocks.chunk(req, 0, len(prompt))))["a"]
    _assert_close(logits, hf_logits(hf_model(name), prompt))


@pytest.mark.parametrize("name", ALL)
def test_chunked_prefill(name, variant, hf_model):
    runner = make_runner(variant(name))
    blocks = Blocks(runner)
    prompt = _prompt(40, seed=2)
    req = make_request("a", prompt)
    pieces = [
        runner.execute_logits(step(blocks.chunk(req, start, min(16, len(prompt) - start), sample=False)))["a"]
        for start in range(0, len(prompt), 16)
    ]
    _assert_close(torch.cat(pieces), hf_logits(hf_model(name), prompt))


@pytest.mark.parametrize("name", ALL)
def test_prefix_already_cached(name, variant, hf_model):
    """Request b reuses a's first two blocks and computes only its own suffix."""
    runner = make_runner(variant(name))
    blocks = Blocks(runner)
    shared = _prompt(32, seed=3)
    a = make_request("a", shared + _prompt(9, seed=4))
    b = make_request("b", shared + _prompt(13, seed=5))
    runner.execute_logits(step(blocks.chunk(a, 0, a.num_prompt_tokens)))
    blocks.share(a, b, 2)
    logits = runner.execute_logits(step(blocks.chunk(b, 32, b.num_prompt_tokens - 32)))["b"]
    _assert_close(logits, hf_logits(hf_model(name), b.prompt_token_ids)[32:])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2_sliding"])
def test_block_sizes(name, block_size, backend, variant, hf_model):
    """Whole prompt, then a 2nd chunk reading the 1st from the cache, then decodes."""
    runner = make_runner(variant(name), block_size=block_size, num_blocks=128, **BACKENDS[backend])
    blocks = Blocks(runner)
    tokens = _prompt(45, seed=6)
    req = make_request("a", tokens[:30])
    first = runner.execute_logits(step(blocks.chunk(req, 0, 20, sample=False)))["a"]
    second = runner.execute_logits(step(blocks.chunk(req, 20, 10)))["a"]
    decodes = []
    for t in tokens[30:]:
        req.append_output_token(t)
        decodes.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    _assert_close(torch.cat([first, second, *decodes]), hf_logits(hf_model(name), tokens))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", ALL)
def test_mixed_batch(name, backend, variant, hf_model):
    """One execute holding a fresh prefill, a second prefill chunk and two decodes."""
    runner = make_runner(variant(name), **BACKENDS[backend])
    blocks = Blocks(runner)
    a = make_request("a", _prompt(25, seed=7))
    b = make_request("b", _prompt(30, seed=8))
    c = make_request("c", _prompt(20, seed=9))
    d = make_request("d", _prompt(33, seed=10))
    warm = runner.execute_logits(
        step(blocks.chunk(b, 0, 16, sample=False), blocks.chunk(c, 0, 20), blocks.chunk(d, 0, 33))
    )
    for r in (c, d):
        r.append_output_token(int(warm[r.request_id][-1].argmax()))
    mixed = runner.execute_logits(
        step(
            blocks.chunk(c, c.num_tokens - 1, 1),
            blocks.chunk(a, 0, 25),
            blocks.chunk(d, d.num_tokens - 1, 1),
            blocks.chunk(b, 16, 14),
        )
    )
    ref = hf_model(name)
    _assert_close(mixed["a"], hf_logits(ref, a.all_token_ids))
    _assert_close(mixed["b"], hf_logits(ref, b.all_token_ids)[16:])
    _assert_close(mixed["c"], hf_logits(ref, c.all_token_ids)[-1:])
    _assert_close(mixed["d"], hf_logits(ref, d.all_token_ids)[-1:])


def test_copy_on_write_partial_block(variant, hf_model):
    """b shares a's full block and a copy of a's partly filled one, then diverges."""
    runner = make_runner(variant("llama"))
    blocks = Blocks(runner)
    shared = _prompt(20, seed=11)
    a = make_request("a", shared + _prompt(6, seed=12))
    b = make_request("b", shared + _prompt(10, seed=13))
    runner.execute_logits(step(blocks.chunk(a, 0, 20, sample=False)))
    (table_a,) = blocks.tables["a"]  # llama: one KV cache group
    partial = table_a[1]
    copy = blocks.take()
    blocks.tables["b"] = [[table_a[0], copy]]
    # a then overwrites its own partial block: b must not see those tokens.
    out = runner.execute_logits(
        step(blocks.chunk(a, 20, 6), blocks.chunk(b, 20, 10), copies=[(partial, copy)])
    )
    ref = hf_model("llama")
    _assert_close(out["a"], hf_logits(ref, a.all_token_ids)[20:])
    _assert_close(out["b"], hf_logits(ref, b.all_token_ids)[20:])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("prompt_len", [32, 80])
def test_bfloat16_matches_transformers_in_bfloat16(backend, prompt_len, variant, hf_model):
    """Both paths round where transformers rounds: prefill, then decodes that
    read the bf16 cache, against transformers run in bf16 itself. 80 prompt
    tokens: on x86 CPUs without AMX the prefill attends in float32
    (attention/prefill.py)."""
    runner = make_runner(variant("llama"), dtype="bfloat16", **BACKENDS[backend])
    linears = [m for m in runner.model.modules() if hasattr(m, "linear_method")]
    amx_expected = backend == "native" and amx_linear_kernel() is not None
    assert len(linears) == 2 * 4 + 1  # q/k/v, o, gate/up, down per layer, and the lm_head
    assert all(m.linear_method.kernel_name(m).startswith("amx") == amx_expected for m in linears)
    blocks = Blocks(runner)
    tokens = _prompt(prompt_len + 8, seed=11)
    req = make_request("a", tokens[:prompt_len])
    got = [runner.execute_logits(step(blocks.chunk(req, 0, prompt_len)))["a"]]
    for t in tokens[prompt_len:]:
        req.append_output_token(t)
        got.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    ref = hf_logits(copy.deepcopy(hf_model("llama")).to(torch.bfloat16), tokens)
    ours = torch.cat(got)
    assert (ours - ref).abs().max().item() < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9  # random weights: near-ties


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", ["gemma2", "phi4_mini"])
def test_gemma_and_phi_in_bfloat16(name, backend, variant, hf_model):
    """Gemma 2's bf16 paths (the soft cap on bf16 scores in the kernel's
    vdpbf16ps path and the torch one, the (1 + w) norms rounded once, the
    embedding scale rounded to bf16) and Phi-4-mini's (partial rotary in
    torch ops) against transformers in bf16. Bound: transformers' own bf16
    logits differ from its float32 ones by up to 0.054 here; ours from its
    bf16 ones by up to 0.063 (measured)."""
    runner = make_runner(variant(name), dtype="bfloat16", **BACKENDS[backend])
    blocks = Blocks(runner)
    tokens = _prompt(40, seed=11)
    req = make_request("a", tokens[:32])
    got = [runner.execute_logits(step(blocks.chunk(req, 0, 32)))["a"]]
    for t in tokens[32:]:
        req.append_output_token(t)
        got.append(runner.execute_logits(step(blocks.chunk(req, req.num_tokens - 1, 1)))["a"])
    ref = hf_logits(copy.deepcopy(hf_model(name)).to(torch.bfloat16), tokens)
    ours = torch.cat(got)
    assert (ours - ref).abs().max().item() < 0.1
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def _moe_logits(runner, lengths: dict[str, int], tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Every position's logits: the prompts prefilled in one step, then three decode steps of all of them."""
    blocks = Blocks(runner)
    requests = {rid: make_request(rid, tokens[rid][:n]) for rid, n in lengths.items()}
    out = runner.execute_logits(step(*(blocks.chunk(r, 0, r.num_tokens) for r in requests.values())))
    got = {rid: [out[rid]] for rid in requests}
    for i in range(3):
        for rid, r in requests.items():
            r.append_output_token(tokens[rid][lengths[rid] + i])
        out = runner.execute_logits(step(*(blocks.chunk(r, r.num_tokens - 1, 1) for r in requests.values())))
        for rid in requests:
            got[rid].append(out[rid])
    return {rid: torch.cat(logits) for rid, logits in got.items()}


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_mixtures_of_experts_in_bfloat16(name, variant, hf_model):
    """bf16 experts prepacked after loading (the AMX kernel for up to 64 rows an expert, all experts in one
    call, where the CPU has it; oneDNN beyond): four prompts of 24-150 tokens prefilled in one step
    (Mixtral's 4 experts then take ~160 rows each, Qwen3-MoE's 8 ~80), then decode steps of all four (8 rows
    over the experts, past the few-row kernels' 4 an expert). Against ``linear_backend torch`` (``F.linear``
    per expert on the plain weights), the rest alike: within bf16 rounding everywhere. Against transformers
    in bf16: its own rounding flips a token's expert at near-ties (the tiny Qwen3-MoE: ~5% of positions,
    the same on the torch path), so most positions within bf16 rounding and the same argmax."""
    lengths = {"a": 24, "b": 40, "c": 100, "d": 150}
    tokens = {rid: _prompt(n + 3, seed=20 + n) for rid, n in lengths.items()}
    runner = make_runner(variant(name), dtype="bfloat16", **BACKENDS["native"])
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    amx_expected = amx_linear_kernel() is not None
    assert experts and all(m.weight_method.kernel_name(m).startswith("amx") == amx_expected for m in experts)
    ours = _moe_logits(runner, lengths, tokens)
    plain_backends = {**BACKENDS["native"], "linear_backend": "torch"}
    plain = _moe_logits(make_runner(variant(name), dtype="bfloat16", **plain_backends), lengths, tokens)
    reference = copy.deepcopy(hf_model(name)).to(torch.bfloat16)
    for rid in lengths:
        assert (ours[rid] - plain[rid]).abs().max().item() < 0.05, rid
        ref = hf_logits(reference, tokens[rid])
        assert ((ours[rid] - ref).abs().amax(-1) < 0.1).float().mean().item() >= 0.9, rid
        assert (ours[rid].argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9, rid
