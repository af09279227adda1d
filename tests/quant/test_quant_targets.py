"""Quantized checkpoints under each CPU target this machine can execute
(forced as OCTAVO_CPU_TARGET would): the layers multiply through the int8 /
int4 kernel built for that target (never dequantize + F.linear), and greedy
tokens equal transformers' on the dequantized weights (float activations:
the int8 rows' kernel is checked per target by tests/quant/test_qdot.py). A CI machine without
AMX or AVX-512 still runs the paths it has; the others skip naming the
missing feature."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.kernels.cpu_features import TARGETS
from octavo.kernels.quant_linear import quant_linear_kernel
from tests.engine.conftest import assert_no_leak, hf_greedy
from tests.engine.test_cpu_targets import forced_target  # noqa: F401  (a fixture)
from tests.model_factory import make_tiny_model
from tests.quant.quantized_checkpoints import Quant, write_quantized

NEW_TOKENS = 12
CASES = {"gptq4-asym-actorder": ("llama", Quant("gptq", bits=4, sym=False, act_order=True)),
         "gptq8-channel": ("qwen2", Quant("gptq", bits=8, group_size=-1))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized_targets")
    return {case: write_quantized(make_tiny_model(root / f"base-{arch}", arch), root / case, quant)
            for case, (arch, quant) in CASES.items()}


# amx is left out: it is the default target where it runs at all, covered by test_checkpoints.py.
@pytest.mark.parametrize("target_name", [t.name for t in TARGETS if t.arch in ("x86_64", "any") and t.name != "amx"])
@pytest.mark.parametrize("case", CASES)
def test_quantized_greedy_matches_transformers_under_target(checkpoints, forced_target, target_name, case):  # noqa: F811
    target = forced_target(target_name)
    folder, reference = checkpoints[case]
    llm = LLM(folder, dtype="float32", num_blocks=64, quantized_activations="float")
    model = llm.engine.executor.worker.runner.model
    names = {m.linear_method.kernel_name(m) for m in model.modules() if hasattr(m, "linear_method")}
    bits = CASES[case][1].bits
    isa = quant_linear_kernel(target).isa
    quantized = {n for n in names if f"int{bits}" in n}
    assert quantized and all(f"int{bits} fma {isa}" in n for n in quantized), names
    prompts = [[5, 17, 301], list(range(40, 57))]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, prompts, new_tokens=NEW_TOKENS)
    assert_no_leak(llm)
