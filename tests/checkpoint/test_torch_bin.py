"""pytorch_model.bin checkpoints, single and sharded: the same model as its
safetensors copy and as transformers; safetensors win when a folder has
both; broken files are errors naming them."""
from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

from octavo import LLM, SamplingParams
from octavo.model.loader import load_model
from tests.checkpoint.conftest import PROMPT, octavo_logits
from tests.engine.conftest import hf_greedy
from tests.model_factory import load_hf_model, make_tiny_model
from tests.worker.runner_utils import hf_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def safetensors_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bin"), "qwen2")


def _bin_copy(src, dst, shards: int = 1):
    """``src`` with its weights as pytorch_model.bin (``shards`` > 1: split with an index), no safetensors."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    if shards == 1:
        torch.save(tensors, dst / "pytorch_model.bin")
        return dst
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: tensors[n] for n in part}, dst / file)
        weight_map.update({n: file for n in part})
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_checkpoint_matches_safetensors_and_transformers(safetensors_model, tmp_path, shards):
    folder = _bin_copy(safetensors_model, tmp_path / "bin", shards)
    got, tokens = octavo_logits(folder)
    from_safetensors, _ = octavo_logits(safetensors_model)
    assert torch.equal(got, from_safetensors)
    torch.testing.assert_close(got, hf_logits(load_hf_model(safetensors_model), tokens), atol=1e-4, rtol=0)
    prompts = [PROMPT[:n] for n in (1, 9, 24)]
    outs = LLM(folder, dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(safetensors_model, prompts, new_tokens=16)


def test_safetensors_are_preferred_when_both_exist(safetensors_model, tmp_path):
    folder = tmp_path / "both"
    shutil.copytree(safetensors_model, folder)
    # A .bin of other values: if it were read, the weights would differ.
    torch.save({n: torch.zeros_like(t) for n, t in load_file(folder / "model.safetensors").items()},
               folder / "pytorch_model.bin")
    model, _ = load_model(folder, dtype="float32")
    assert torch.equal(model.model.norm.weight, load_file(folder / "model.safetensors")["model.norm.weight"])


def test_missing_bin_shard_is_named(safetensors_model, tmp_path):
    folder = _bin_copy(safetensors_model, tmp_path / "sharded", shards=2)
    (folder / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(ValueError, match=r"lists shards that are missing: \['pytorch_model-00002-of-00002.bin'\]"):
        load_model(folder)


def test_bin_with_code_is_refused_unrun(safetensors_model, tmp_path):
    """weights_only: a pickle that would call a function on load is an error, and the function never runs."""
    folder = _bin_copy(safetensors_model, tmp_path / "evil")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (shutil.copy, (str(folder / "config.json"), str(marker)))

    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.norm.weight": Payload()}, f, protocol=2)
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_model(folder)
    assert not marker.exists()


def test_bin_with_too_few_tensors_names_them(safetensors_model, tmp_path):
    folder = _bin_copy(safetensors_model, tmp_path / "short")
    tensors = torch.load(folder / "pytorch_model.bin", weights_only=True)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(folder)
