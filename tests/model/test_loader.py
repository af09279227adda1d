"""Loading safetensors folders: formats, dtypes, and the errors users see."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo.model.dtypes import resolve_dtype
from octavo.model.loader import load_model
from tests.model_factory import make_tiny_model


@pytest.fixture()
def llama_copy(variant, tmp_path):
    """A private copy of the tiny llama checkpoint that a test may damage."""
    dst = tmp_path / "model"
    shutil.copytree(variant("llama"), dst)
    return dst


def test_loads_every_tensor_by_name(variant):
    folder = variant("llama")
    model, arch = load_model(folder)
    stored = load_file(folder / "model.safetensors")
    ours = _unfused_state_dict(model)
    assert set(ours) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(ours[name], tensor), name
    assert arch.architecture == "LlamaForCausalLM"


def _unfused_state_dict(model):
    """The model's tensors under the checkpoint's names: fused projections
    (q/k/v, gate/up) split back into their parts."""
    out = dict(model.state_dict())
    for part, (fused, shard_id) in model.packed_modules_mapping.items():
        for name in [n for n in out if f".{fused}." in n]:
            module_name = name.rsplit(".", 1)[0]
            index = shard_id if isinstance(shard_id, int) else "qkv".index(shard_id)
            pieces = out[name].split(model.get_submodule(module_name).output_sizes)
            out[name.replace(f".{fused}.", f".{part}.")] = pieces[index]
    return {n: t for n, t in out.items() if not any(f".{f}." in n for f, _ in model.packed_modules_mapping.values())}


def test_tied_embeddings_share_one_tensor(variant):
    model, _ = load_model(variant("llama_tied"))
    assert "lm_head.weight" not in load_file(variant("llama_tied") / "model.safetensors")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    (llama_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, llama_copy / file)
        weight_map.update({n: file for n in part})
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = load_model(llama_copy)
    ours = _unfused_state_dict(model)
    assert all(torch.equal(ours[n], t) for n, t in tensors.items())


def test_dtype_auto_follows_the_checkpoint(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3", dtype="bfloat16")
    model, arch = load_model(folder, dtype="auto")
    assert arch.dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model32, _ = load_model(folder, dtype="float32")
    assert {p.dtype for p in model32.parameters()} == {torch.float32}
    assert resolve_dtype("auto", None) == torch.float32
    assert resolve_dtype("half", "bfloat16") == torch.float16


def test_unknown_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_folder_without_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights in .*model.safetensors.*pytorch_model.bin"):
        load_model(llama_copy)


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_unknown_architecture(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*supported: .*LlamaForCausalLM"):
        load_model(llama_copy)


def test_missing_and_unexpected_tensors_are_named(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, llama_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]") as err:
        load_model(llama_copy)
    assert "model.layers.1.mlp.extra.weight" in str(err.value)


def test_wrong_shape_is_named(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, llama_copy / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(llama_copy)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", None)


def test_phi3_fused_checkpoint_tensors_load_whole(variant):
    """Phi-3 stores qkv_proj and gate_up_proj fused: split into q, k, v and
    gate, up at load, they come back equal to the stored tensors."""
    folder = variant("phi3")
    stored = load_file(folder / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored and "model.layers.0.mlp.gate_up_proj.weight" in stored
    model, _ = load_model(folder)
    ours = model.state_dict()
    assert set(ours) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(ours[name], tensor), name


def test_phi3_fused_tensor_of_the_wrong_size_names_it(variant, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(variant("phi3"), dst)
    tensors = load_file(dst / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=f"{name}.*expected 128"):
        load_model(dst)
