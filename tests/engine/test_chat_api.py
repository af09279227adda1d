"""LLM.chat renders conversations as transformers does, template variables included."""
from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from octavo import LLM, SamplingParams

QWEN3 = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
ASK = [{"role": "user", "content": "Name a colour."}]
PARTIAL = ASK + [{"role": "assistant", "content": "A nice colour is"}]


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", num_blocks=64)


@pytest.mark.parametrize("messages,kw", [
    (ASK, {"chat_template_kwargs": {"enable_thinking": False}}),
    (ASK, {}),
    (PARTIAL, {"continue_final_message": True, "add_generation_prompt": False}),
])
def test_chat_prompt_is_transformers_rendering(llm, folder, messages, kw):
    out = llm.chat(messages, SamplingParams(max_tokens=1), chat_template=QWEN3, use_tqdm=False, **kw)[0]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    hf_kw = {k: v for k, v in kw.items() if k != "chat_template_kwargs"} | kw.get("chat_template_kwargs", {})
    hf_kw.setdefault("add_generation_prompt", True)
    expected = hf.apply_chat_template(messages, chat_template=QWEN3, tokenize=True, return_dict=False, **hf_kw)
    assert out.prompt_token_ids == expected
