"""Raw parameter text typed by the tool's schema (Qwen3-Coder's XML values), as vLLM does,
except that text which is not of its type stays the text (vLLM turns a bad boolean into false)."""
from __future__ import annotations

import json

import pytest

from octavo.server.tool_parsers.typed_values import typed_value

CASES = [
    # (schema type, text, value)
    ("boolean", "True", True),
    ("boolean", "false", False),
    ("boolean", " TRUE ", True),
    ("boolean", "yes", "yes"),
    ("integer", "42", 42),
    ("integer", "-7", -7),
    ("integer", "4.5", "4.5"),
    ("integer", "forty", "forty"),
    ("integer", "1_000", "1_000"),  # Python's separator is not a number in JSON
    ("integer", "٣", "٣"),  # only ASCII digits
    ("number", "3", 3),
    ("number", "2.5", 2.5),
    ("number", "-1e3", -1000.0),
    ("number", ".5", 0.5),
    ("number", "inf", "inf"),
    ("number", "1e999", "1e999"),  # no infinity in JSON
    ("number", "NaN", "NaN"),
    ("object", '{"unit": "C", "n": [1, 2]}', {"unit": "C", "n": [1, 2]}),
    ("object", "{'unit': 'C', 'exact': True, 'x': None}", {"unit": "C", "exact": True, "x": None}),
    ("object", "[1, 2]", "[1, 2]"),
    ("object", "{1, 2}", "{1, 2}"),  # a Python set: no JSON
    ("object", "{'z': 1j}", "{'z': 1j}"),
    ("object", "{not json", "{not json"),
    ("array", '["a", "b"]', ["a", "b"]),
    ("array", "['a', 'b']", ["a", "b"]),
    ("array", "('a', 'b')", "('a', 'b')"),
    ("string", "True", "True"),
    ("string", "  42\n", "  42\n"),  # strings keep their spaces too
    ("string", "null", "null"),
    ("integer", "null", None),
    ("object", "NULL", None),
    (["integer", "null"], "null", None),
    (["integer", "null"], "12", 12),
    (["string", "integer"], "12", 12),  # the typed reading wins over the text
    (["string", "integer"], "twelve", "twelve"),
    (["boolean", "integer"], "1", 1),
    ("null", "null", None),
    ("enum-like", "7", "7"),  # not a JSON schema type: text
]


@pytest.mark.parametrize("kind,text,value", CASES)
def test_text_takes_the_schema_type(kind, text, value):
    got = typed_value(text, {"type": kind})
    assert got == value and type(got) is type(value)
    json.dumps(got, allow_nan=False)  # whatever comes back is JSON


@pytest.mark.parametrize("schema", [{}, {"description": "no type"}, {"type": {"odd": 1}}, {"type": [["x"]]}])
def test_no_usable_type_means_string(schema):
    assert typed_value("3", schema) == "3"


def test_values_beyond_the_decoders_stay_text():
    deep = "[" * 100_000 + "]" * 100_000
    assert typed_value(deep, {"type": "array"}) == deep
    huge = "9" * 5000  # past Python's digit limit for int()
    assert typed_value(huge, {"type": "integer"}) == huge
