"""Chat templates: compiled once (bounded cache), rendered in a sandbox with a deadline.

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
import functools
import time
from typing import Any

import jinja2
import jinja2.sandbox

CACHE_SIZE = 64
MAX_CHARS = 16 * 2**20
_RANGE_CHECK_EVERY = 256

_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("octavo_template_deadline", default=float("inf"))


def _tick() -> None:
    if time.monotonic() > _DEADLINE.get():
        raise jinja2.TemplateError("the chat template ran past its time limit")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


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
    env = _DeadlineSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _range
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
    finally:
        _DEADLINE.reset(token)
