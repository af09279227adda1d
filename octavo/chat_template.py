"""Chat templates: compiled once (bounded cache), rendered in a sandbox with a deadline.

The environment is the one transformers renders with, so a model's published
template gives the same prompt here as in ``apply_chat_template``: trim_blocks
and lstrip_blocks, the ``loopcontrols`` extension (``{% break %}``), a
``{% generation %}`` block (transformers marks assistant tokens with it; here
it renders its body), ``raise_exception``, ``strftime_now``, and a ``tojson``
that does not escape HTML and takes ``indent``/``separators``/``sort_keys``
(Jinja's own escapes ``<`` as ``\u003c`` and would change every tool
schema's text). The variables follow transformers too: messages without
their None-valued keys, ``tools``, ``documents``, the special tokens,
``continue_final_message`` (see ``render_conversation``).

Templates are Jinja programs. The model's own is trusted, but a server may
also accept templates from requests, and any template can loop for long or
build huge strings. Jinja's sandbox blocks unsafe attributes; on top of it:
- a deadline checked at every call, attribute/item lookup, binary operator,
  every 256th item of ``range`` and every output piece, because a thread
  cannot be killed: the template itself must notice that its time is up;
- ``*``, ``+`` and ``**`` refuse results beyond ``MAX_CHARS`` ("x" * 10**9 would
  allocate a gigabyte in one operation, before any deadline check);
- rendered output beyond ``MAX_CHARS`` is refused.
The compiled-template cache is an LRU of ``CACHE_SIZE`` entries: unique
request templates would otherwise grow it without bound (~10 KB each).
"""
from __future__ import annotations

import contextvars
import datetime
import functools
import json
import time
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

CACHE_SIZE = 64
MAX_CHARS = 16 * 2**20
_RANGE_CHECK_EVERY = 256

_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("octavo_template_deadline", default=float("inf"))


def _tick() -> None:
    if time.monotonic() > _DEADLINE.get():
        raise jinja2.TemplateError("the chat template ran past its time limit")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
    separators: Optional[tuple[str, str]] = None, sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names: an attribute such as
    ``__class__`` set on it would reach Python internals past the sandbox."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace attribute must not start with '_': {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _range(*args: int) -> Any:
    for i, value in enumerate(jinja2.sandbox.safe_range(*args)):
        if i % _RANGE_CHECK_EVERY == 0:
            _tick()
        yield value


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


class _DeadlineSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*" and isinstance(left, int) and not isinstance(left, bool):
            left, right = right, left  # 3 * "x" is "x" * 3
        if operator == "*" and isinstance(right, int) and _size(left) * right > MAX_CHARS:
            raise jinja2.TemplateError(f"the chat template built a value over {MAX_CHARS} items")
        if operator == "+" and _size(left) + _size(right) > MAX_CHARS:
            raise jinja2.TemplateError(f"the chat template built a value over {MAX_CHARS} items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise jinja2.TemplateError("the chat template raised a number to a power over 64")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=CACHE_SIZE)
def compile_template(source: str) -> jinja2.Template:
    """``jinja2.TemplateError`` when ``source`` is not a valid template."""
    env = _DeadlineSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, range=_range, namespace=_Namespace
    )
    return env.from_string(source)


def render(template: jinja2.Template, timeout_s: float, variables: dict[str, Any]) -> str:
    """Render within ``timeout_s`` seconds; ``ValueError`` when the template
    fails, runs too long, recurses too deep or writes too much."""
    token = _DEADLINE.set(time.monotonic() + timeout_s)
    try:
        parts, total = [], 0
        for piece in template.generate(**variables):
            total += len(piece)
            if total > MAX_CHARS:
                raise jinja2.TemplateError(f"the chat template wrote over {MAX_CHARS} characters")
            _tick()
            parts.append(piece)
        return "".join(parts)
    except (jinja2.TemplateError, RecursionError) as exc:
        raise ValueError(f"chat template failed: {exc}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError) as exc:
        # A template's own bugs (tojson of an undefined value, 1 / 0, a bad
        # index) are its failure, reported like the others.
        raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _DEADLINE.reset(token)


# Keys a message's reasoning comes under; templates read ``reasoning_content``
# (Qwen3, DeepSeek) or ``thinking`` (gpt-oss): each gets the value under every name.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message for continue_final_message; the space tells
# whether the template trimmed the message (then the cut trims too).
_CONTINUE_MARK = "OCTAVO_CONTINUE_FINAL "


def render_conversation(
    template: jinja2.Template,
    source: str,
    timeout_s: float,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: Optional[list[dict[str, Any]]] = None,
    documents: Optional[list[dict[str, Any]]] = None,
    variables: Optional[dict[str, Any]] = None,
) -> str:
    """The prompt for ``messages`` as transformers' ``apply_chat_template``
    renders it. ``continue_final_message`` leaves the last message open (no
    end-of-turn after it) so the model continues it; ``source`` is the
    template's text, which must read the message's ``content``.
    ``ValueError`` naming the problem otherwise."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if not messages:
        raise ValueError("messages must not be empty")
    chat = [_normalized(m) for m in messages]
    final = ""
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ValueError("continue_final_message needs text content in the final message")
        if "content" not in source:
            raise ValueError("continue_final_message: this chat template does not render message content")
        chat[-1]["content"] = final + _CONTINUE_MARK
    text = render(template, timeout_s, {
        **(variables or {}),
        "messages": chat,
        "tools": tools,
        "documents": documents,
        "add_generation_prompt": add_generation_prompt,
    })
    if not continue_final_message:
        return text
    mark = _CONTINUE_MARK.strip()
    if final.strip() not in text or mark not in text:
        raise ValueError("continue_final_message: the chat template does not render the final message as it is")
    cut = text.rindex(mark)
    return text[:cut] if text.startswith(_CONTINUE_MARK, cut) else text[:cut].rstrip()


def _normalized(message: dict[str, Any]) -> dict[str, Any]:
    # Templates test keys with `is defined` / `in`: a None value would render as "None".
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out
