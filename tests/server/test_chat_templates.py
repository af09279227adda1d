"""Chat templates from requests: refused unless trusted, sandboxed with a time
limit, and compiled into a bounded cache."""
from __future__ import annotations

import openai
import pytest

from octavo import chat_template
from octavo.tokenizer import Tokenizer

HI = [{"role": "user", "content": "hi"}]
TEMPLATE = "PREFIX{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def test_request_templates_are_refused_by_default(server):
    client = server.openai()
    for extra, param in (({"chat_template": TEMPLATE}, "chat_template"),
                         ({"chat_template_kwargs": {"chat_template": TEMPLATE}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, extra_body=extra)
        err = exc.value.body
        assert err["param"] == param and "--trust-request-chat-template" in err["message"], err


def test_trusted_request_template_is_used(tuned_server):
    with tuned_server.http() as http:
        expected = http.post("/tokenize", json={"prompt": "PREFIX[hi]", "add_special_tokens": False}).json()["count"]
        for extra in ({"chat_template": TEMPLATE}, {"chat_template_kwargs": {"chat_template": TEMPLATE}}):
            r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == expected
        r = http.post("/v1/chat/completions", json={"messages": HI, "chat_template": "{% for %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("source,words", [
    ("{{ 'x' * 10**9 }}", "over"),
    ("{{ 3 * 'ab' * 100000000 }}", "over"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "time limit"),
])
def test_sandbox_refuses_abuse(model_path, source, words):
    tok = Tokenizer(model_path)
    with pytest.raises(ValueError, match=words):
        tok.apply_chat_template(HI, chat_template=source, timeout_s=0.5)


def test_template_cache_is_bounded(model_path):
    tok = Tokenizer(model_path)
    chat_template.compile_template.cache_clear()
    for i in range(1000):
        assert tok.apply_chat_template(HI, chat_template=f"{i}:{{{{ messages[0]['content'] }}}}") == f"{i}:hi"
    info = chat_template.compile_template.cache_info()
    assert info.currsize == chat_template.CACHE_SIZE == 64 and info.misses == 1000
