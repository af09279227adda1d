"""The default model's corpus: the Python standard library's own sources (PSF licence).

Each ``.py`` file is one document. Files are split into train and held-out by a
hash of their path relative to the stdlib root, so the split does not depend on
the order the filesystem lists them in. The training side also gets short chat
examples built from docstrings, so the shipped model has seen its chat template.
"""
from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from default_model_tokenizer import render_chat

# Test suites, vendored examples and the generated codec tables are excluded:
# the tests are mostly repetitive assertions and the codec tables are huge
# literal mappings; neither teaches the model to write readable code or prose.
_EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
HELDOUT_PERCENT = 3
SYSTEM_PROMPT = "You are Octavo Mini, a small assistant that knows the Python standard library."


@dataclass(frozen=True)
class Document:
    name: str  # path relative to the stdlib root, or a synthetic name for chat examples
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def _source_files(root: Path) -> list[Path]:
    files = [
        p for p in root.rglob("*.py")
        if not _EXCLUDED_PARTS.intersection(p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() else None


def _docstring_chats(module: str, source: str) -> list[Document]:
    """One chat per documented public function or class: ask, answer with its docstring."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    chats = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        answer = doc.split("\n\n")[0].strip()
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What does the {kind} {node.name} in the {module} module do?"},
            {"role": "assistant", "content": answer},
        ]
        text = render_chat(messages, add_generation_prompt=False)
        chats.append(Document(f"chat:{module}.{node.name}", text))
    return chats


def _module_name(relative_path: str) -> str:
    name = relative_path.removesuffix(".py").removesuffix("/__init__")
    return name.replace("/", ".")


def build_corpus(root: Path | None = None) -> Corpus:
    """Read the stdlib once; held-out files contribute neither code nor chats to training."""
    root = root or stdlib_root()
    train: list[Document] = []
    heldout: list[Document] = []
    for path in _source_files(root):
        relative = path.relative_to(root).as_posix()
        text = _read(path)
        if text is None:
            continue
        if is_heldout(relative):
            heldout.append(Document(relative, text))
            continue
        train.append(Document(relative, text))
        train.extend(_docstring_chats(_module_name(relative), text))
    return Corpus(train=train, heldout=heldout)


def token_stream(tok: Tokenizer, docs: list[Document], seed: int) -> torch.Tensor:
    """The documents in a seeded order as one stream; the tokenizer's post-processor
    opens each with EOS, so documents are separated exactly as at inference."""
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)
