"""Published chat templates render here exactly as transformers' apply_chat_template renders them.

The corpus (tests/data/chat_templates/, sources in SOURCES.md) covers the
families users serve: Llama 3.x with tools, Qwen2.5/Qwen3 with tools and
thinking, Mistral, DeepSeek, Gemma, Phi, Hermes, Granite and Command R
(documents, loop controls), SmolLM3, gpt-oss. Every template meets every
conversation below; where transformers refuses one (Gemma has no system
role, Mistral wants alternating turns), Octavo must refuse it too.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import transformers

from octavo.tokenizer import Tokenizer
from tests.model_factory import write_tokenizer

DATA = Path(__file__).parent / "data" / "chat_templates"
TEMPLATES = sorted(DATA.glob("*.jinja"))

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (<b>celsius</b> & \"quoted\" text)",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
HI = [{"role": "user", "content": "hi"}]
CALL = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}

# name -> (messages, apply_chat_template keyword arguments)
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "single_user": ([{"role": "user", "content": "Hello there"}], {"add_generation_prompt": True}),
    "system_multi_turn": (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye <b>now</b>"},
        ],
        {"add_generation_prompt": True},
    ),
    "no_generation_prompt": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        {"add_generation_prompt": False},
    ),
    "tools_offered": (
        [{"role": "user", "content": "Weather in Zürich?"}],
        {"add_generation_prompt": True, "tools": [WEATHER_TOOL]},
    ),
    "tool_round_trip": (
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather", "content": "{\"temp\": 21}"},
        ],
        {"add_generation_prompt": True, "tools": [WEATHER_TOOL]},
    ),
    # What the server sends for an assistant turn of tool calls: empty text, arguments as an object.
    "tool_round_trip_empty_text": (
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather", "content": "{\"temp\": 21}"},
        ],
        {"add_generation_prompt": True, "tools": [WEATHER_TOOL]},
    ),
    "reasoning_history": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
            {"role": "user", "content": "3+3?"},
        ],
        {"add_generation_prompt": True},
    ),
    "thinking_off": ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": True, "enable_thinking": False}),
    "thinking_kwarg": ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": True, "thinking": True}),
    "continue_final": (
        [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}],
        {"continue_final_message": True},
    ),
    "documents": (
        [{"role": "user", "content": "What does the note say?"}],
        {"add_generation_prompt": True, "documents": [{"title": "Note", "text": "Buy <milk> & eggs."}]},
    ),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> tuple[Any, Tokenizer]:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return transformers.AutoTokenizer.from_pretrained(folder), Tokenizer(folder)


def _render_hf(hf: Any, source: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    try:
        return hf.apply_chat_template(copy.deepcopy(messages), chat_template=source, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 (any refusal: a template error, a ValueError of transformers)
        return f"<refused: {type(exc).__name__}>"


def _render_octavo(tok: Tokenizer, source: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    kwargs = dict(kwargs)
    add_generation_prompt = kwargs.pop("add_generation_prompt", False)
    try:
        return tok.apply_chat_template(
            copy.deepcopy(messages), add_generation_prompt=add_generation_prompt, chat_template=source, **kwargs
        )
    except ValueError:
        return "<refused>"


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_published_template_renders_as_transformers(tokenizers, path):
    hf, tok = tokenizers
    source = path.read_text()
    rendered = 0  # cases transformers renders (and Octavo identically)
    for name, (messages, kwargs) in CASES.items():
        expected = _render_hf(hf, source, messages, kwargs)
        got = _render_octavo(tok, source, messages, kwargs)
        if expected.startswith("<refused"):
            assert got == "<refused>", f"{name}: transformers refused ({expected}), Octavo rendered:\n{got}"
        else:
            assert got == expected, f"{name}: differs"
            rendered += 1
    # Refusals agreeing is not enough: each template must render real text
    # (the Hermes tool_use template renders only conversations with tools).
    assert rendered >= 3, f"only {rendered} cases rendered"


def test_corpus_covers_the_families():
    names = " ".join(p.stem for p in TEMPLATES)
    for family in ("Llama-3.1", "Qwen2.5", "Qwen3", "Mistral", "DeepSeek", "gemma", "Phi"):
        assert family in names


@pytest.mark.parametrize("source,expected", [
    # transformers' tojson: no HTML escaping, its keyword options.
    ("{{ {'b': '<&>', 'a': [1, 2]} | tojson }}", '{"b": "<&>", "a": [1, 2]}'),
    ("{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}", '{\n  "a": 2,\n  "b": 1\n}'),
    ("{{ [1, 'é'] | tojson(separators=(',', ':'), ensure_ascii=true) }}", '[1,"\\u00e9"]'),
    ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}", "a"),
    ("{% generation %}{{ messages[1].content }}{% endgeneration %}", "b"),
    ("{{ strftime_now('%Y') | length }}", "4"),
])
def test_template_environment(tokenizers, source, expected):
    hf, tok = tokenizers
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False, chat_template=source) == expected
    assert hf.apply_chat_template(messages, chat_template=source, tokenize=False) == expected


def test_namespace_refuses_private_names(tokenizers):
    _, tok = tokenizers
    with pytest.raises(ValueError, match="must not start with '_'"):
        tok.apply_chat_template(HI, chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(ValueError, match="must not start with '_'"):
        tok.apply_chat_template(HI, chat_template="{% set ns = namespace() %}{% set ns.__class__ = 1 %}")


@pytest.mark.parametrize("messages,kwargs,words", [
    (HI, {"continue_final_message": True, "add_generation_prompt": True}, "cannot both be set"),
    ([{"role": "user", "content": None}], {"continue_final_message": True, "add_generation_prompt": False},
     "needs text content"),
    ([], {}, "must not be empty"),
])
def test_conversation_errors_name_the_problem(tokenizers, messages, kwargs, words):
    _, tok = tokenizers
    with pytest.raises(ValueError, match=words):
        tok.apply_chat_template(messages, **kwargs)
