"""A model's tokenizer behind a small API: a Hugging Face folder
(tokenizer.json or tokenizer.model, with tokenizer_config.json) or a GGUF
file (octavo/checkpoint/tokenizer_files.py)."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

import jinja2

from octavo.chat_template import compile_template, render_conversation
from octavo.checkpoint.tokenizer_files import load_tokenizer_files

_DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _token_text(value: Any) -> Optional[str]:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        files = load_tokenizer_files(path)
        self._tok = files.tokenizer
        config = files.config
        self.chat_template: Optional[str] = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values())))
        if self.chat_template is None:
            self.chat_template = files.jinja_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # What transformers passes templates as its special_tokens_map.
        self.special_tokens = {
            name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = {
            tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: it releases the GIL while it works, so a
        # huge prompt tokenized in a thread does not stall the server's event
        # loop (7.9 MB: encode holds the GIL 6 s, encode_batch at most 0.13 s).
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.bos_token_id is not None:
            ids = self._one_bos(ids)
        return ids

    def _one_bos(self, ids: list[int]) -> list[int]:
        """The tokenizer's BOS rule on ids encoded with special tokens.

        tokenizer.json's post-processor decides (as transformers does); a
        config with add_bos_token but a post-processor that adds none (older
        Llama folders: the flag was applied by the tokenizer class) gets it
        here. A text that already starts with BOS (a rendered chat template, a
        prompt decoded from ids) keeps one, not two: a doubled BOS only
        shifts every position and changes what the model sees."""
        bos = self.bos_token_id
        if self.add_bos_token and (not ids or ids[0] != bos):
            return [bos] + ids
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            return ids[1:]
        return ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry as the vocabulary spells
        it: at least the bytes of text any one token stands for (a byte-level
        BPE spells one byte as one character of one or two bytes; SentencePiece
        spells text as it is, a space as the 3-byte "▁"). Added tokens included."""
        return max(len(token.encode("utf-8")) for token in self._tok.get_vocab(with_added_tokens=True))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json document (grammar libraries build their vocabulary from it)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        timeout_s: float = 60.0,
        *,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        documents: Optional[list[dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text as transformers renders it; ``kwargs`` are extra
        template variables (e.g. ``enable_thinking``). ``ValueError`` when the
        template is invalid, fails or runs over ``timeout_s``."""
        source = chat_template or self.chat_template or _DEFAULT_CHAT_TEMPLATE
        template = self.compile_chat_template(source)
        return render_conversation(
            template, source, timeout_s, messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            variables={"bos_token": "", "eos_token": "", **self.special_tokens, **kwargs},
        )

    def compile_chat_template(self, source: Optional[str] = None) -> Any:
        """The compiled template (default: the model's); ``ValueError`` with
        Jinja's message and line when it does not compile."""
        try:
            return compile_template(source or self.chat_template or _DEFAULT_CHAT_TEMPLATE)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template is not valid Jinja: {exc.message} (line {exc.lineno})") from None
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template is not valid Jinja: {exc}") from None

