"""Hostile model files (tests/checkpoint/hostile_files.py) are each refused
with one ValueError naming the file, the field and the value, before what
they declare is allocated; the valid model they are made from loads, so
each refusal is the one change's doing (test_hostile_files_serve.py: the
same through `octavo serve`)."""
from __future__ import annotations

import pytest

from octavo.model.config import load_arch_config
from octavo.model.loader import load_model
from octavo.tokenizer import Tokenizer
from tests.checkpoint.hostile_files import CASES

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
