"""The engine under each CPU target this machine can execute (forced as
OCTAVO_CPU_TARGET would): bf16 greedy output equals transformers' in bf16,
and the layers run the kernels of that target. A CI machine without AMX runs
every AMX-independent target; the others skip naming the missing feature."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.kernels import build, cpu_features
from octavo.kernels.bf16_linear import bf16_linear_kernel
from octavo.kernels.cpu_features import BY_NAME, TARGETS, cpu_info
from tests.engine.conftest import assert_no_leak, random_prompts
from tests.model_factory import PAD_ID, load_hf_model

NEW_TOKENS = 12


@pytest.fixture
def forced_target(monkeypatch, tmp_path):
    """Force a target for one test: the chosen target and the loaded
    libraries are forgotten before and after; the measured table goes to a
    fresh folder."""
    def force(name: str):
        target = BY_NAME[name]
        if not cpu_info().can_run(target):
            pytest.skip(f"this CPU cannot run {name}: lacks {', '.join(cpu_info().missing(target))}")
        monkeypatch.setenv("OCTAVO_CPU_TARGET", name)
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")  # oneDNN is initialised already in this process
        monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
        cpu_features.cpu_target.cache_clear()
        build.clear_loaded()
        return target

    yield force
    cpu_features.cpu_target.cache_clear()
    build.clear_loaded()


def hf_greedy_bf16(folder, prompts: list[list[int]]) -> list[list[int]]:
    model = load_hf_model(folder).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():  # one prompt at a time: no padding in the reference's sums
        for p in prompts:
            gen = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD_ID)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("target_name", [t.name for t in TARGETS if t.arch in ("x86_64", "any")])
def test_bf16_greedy_matches_transformers_under_target(model_dir, forced_target, target_name):
    target = forced_target(target_name)
    folder = model_dir("llama", hidden_size=64, intermediate_size=160)
    llm = LLM(folder, dtype="bfloat16", num_blocks=64)
    model = llm.engine.executor.worker.runner.model
    names = {m.linear_method.kernel_name(m) for m in model.modules() if hasattr(m, "linear_method")}
    assert names
    if target.name == "amx":
        assert all(n.startswith("amx") for n in names)
    else:
        isa = bf16_linear_kernel(target).isa
        assert all(n.startswith(f"rows {isa}") for n in names)
    prompts = random_prompts([3, 17, 40])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_bf16(folder, prompts)
    assert_no_leak(llm)
