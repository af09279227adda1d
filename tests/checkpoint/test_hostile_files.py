"""Hostile model files (tests/checkpoint/hostile_files.py) are each refused
with one ValueError naming the file, the field and the value, before what
they declare is allocated; the valid model they are made from loads, so
each refusal is the one change's doing (test_hostile_files_serve.py: the
same through `octavo serve`)."""
from __future__ import annotations

import json
import shutil

import pytest

from octavo.checkpoint.bounds import MAX_CONTEXT
from octavo.model.config import load_arch_config
from octavo.model.loader import load_model
from octavo.tokenizer import Tokenizer
from tests.checkpoint.hostile_files import CASES
from tests.worker.runner_utils import make_runner

READERS = {"config": load_arch_config, "tokenizer": Tokenizer, "model": load_model}


def test_the_valid_model_loads(valid):
    for path in (valid.folder, valid.gguf):
        load_model(path)
        assert Tokenizer(path).encode("hello")


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_a_hostile_file_is_one_value_error_naming_file_field_and_value(case, valid, tmp_path):
    path = case.build(tmp_path, valid)
    with pytest.raises(ValueError) as raised:
        READERS[case.reader](path)
    message = str(raised.value)
    assert str(path) in message and "\n" not in message, message
    for word in case.words:
        assert word in message, (word, message)


def test_a_context_at_the_bound_allocates_for_the_pool_not_the_context(valid, tmp_path):
    """A config may declare a context of MAX_CONTEXT; what the runner records for decode steps (a block
    table per recorded batch) is sized by the longest sequence the pool can hold: sized by the context,
    it took 2 GiB for 2^24 positions."""
    folder = tmp_path / "long"
    shutil.copytree(valid.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_CONTEXT}))
    runner = make_runner(folder, num_blocks=9)
    assert runner.max_model_len == MAX_CONTEXT
    assert runner._graphs is not None and runner._graphs.max_model_len == 9 * 16
