"""A rank that cannot start names the cause to the ``LLM(...)`` caller at
tensor- and pipeline-parallel size 2, every time: the rank exits right after
it sends its error, and the executor must not report the exit instead.
Repeated, since seeing the exit before the report is a race."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from octavo import LLM
from tests.model_factory import make_tiny_model

TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}
MISSING = "model.layers.1.mlp.down_proj.weight"


def _copy(tmp: Path, name: str) -> Path:
    # intermediate_size 96: 48 inputs per rank to down_proj at TP=2.
    folder = tmp / name
    shutil.copytree(make_tiny_model(tmp, "qwen2", intermediate_size=96), folder)
    return folder


def _assert_named(folder: Path, starts: int, match: str, **options: object) -> None:
    for _ in range(starts):
        with pytest.raises(ValueError, match=match):
            LLM(folder, dtype="float32", num_blocks=12, threads_per_worker=1, **options)


@pytest.mark.parametrize("parallel,starts", [(TP2, 10), (PP2, 3)])
def test_a_missing_tensor_is_named(tmp_path, parallel, starts):
    folder = _copy(tmp_path, "missing")
    tensors = load_file(folder / "model.safetensors")
    del tensors[MISSING]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _assert_named(folder, starts, f"missing tensors \\['{MISSING}'\\]", **parallel)


# A group that divides the whole layer's inputs (96) but not a rank's share (48) at TP=2.
@pytest.mark.parametrize("parallel,group,inputs", [(TP2, 32, 48), (PP2, 64, 96)])
def test_a_group_size_that_does_not_divide_is_named(tmp_path, parallel, group, inputs):
    folder = make_tiny_model(tmp_path, "qwen2", intermediate_size=96)
    match = f"quantization_group_size {group} does not divide the in-features {inputs} of model.layers"
    _assert_named(folder, 2, match, quantization="int4", quantization_group_size=group, **parallel)


@pytest.mark.parametrize("parallel", [TP2, PP2])
def test_an_unsupported_option_is_named(tmp_path, parallel):
    folder = _copy(tmp_path, "relu2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "relu2"}))
    _assert_named(folder, 2, "hidden_act 'relu2' is not supported", **parallel)
