"""llama.cpp's speculative decoding (llama-server ``--model-draft``, and its
n-gram mode ``--spec-type ngram-simple``) on octavo-mini + octavo-mini-draft,
batch 1, the prompts sent as token ids (the GGUF keeps the ids).

The per-token time is llama-server's own ``timings.predicted_per_token_ms``
(the generation phase only, like Octavo's TPOT), so HTTP costs do not count.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.online import running_server
from octavo.assets import MINI_DRAFT_MODEL_PATH, MINI_MODEL_PATH

_TOOLS = Path(__file__).resolve().parents[2] / "tools" / "make_bench_models.py"


def gguf_pair(out: Path, llama_cpp_src: Path) -> tuple[Path, Path]:
    """bf16 GGUFs of the shipped model and draft, converted from copies in ``out``."""
    spec = importlib.util.spec_from_file_location("make_bench_models", _TOOLS)
    tools = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(tools)
    paths = []
    for folder in (MINI_MODEL_PATH, MINI_DRAFT_MODEL_PATH):
        copy = out / folder.name
        if not copy.is_dir():
            shutil.copytree(folder, copy)
        paths.append(tools.convert_to_gguf(copy, llama_cpp_src))
    return paths[0], paths[1]


def _server_cmd(server: Path, target: Path, port: int, threads: int, extra: list[str]) -> list[str]:
    return [str(server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "--parallel", "1", "-c", "2048", "--alias", "octavo-mini", *extra]


def _generate(base_url: str, prompt: list[int], n: int) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "repeat_penalty": 1.0}
    reply = httpx.post(f"{base_url}/completion", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()["timings"]


def run_llama_server_pair(args: argparse.Namespace, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """One row per (workload, mode): the median per-token ms over
    ``args.repeats`` passes over the prompts. The three servers (plain, draft
    model, n-gram) run side by side and take the requests in turn, so load on
    a shared machine hits each alike."""
    out = Path(tempfile.gettempdir()) / "octavo-spec-gguf"
    out.mkdir(exist_ok=True)
    target, draft = gguf_pair(out, args.llamacpp_src)
    k = str(args.adaptive_k)
    modes = {
        "none": [],
        f"draft k={k}": ["-md", str(draft), "--spec-draft-n-max", k, "--spec-draft-n-min", "0",
                         "-td", str(args.threads), "-tbd", str(args.threads)],
        f"ngram k={k}": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", k],
    }
    urls = {mode: f"http://127.0.0.1:{18431 + i}" for i, mode in enumerate(modes)}
    per_token: dict[tuple[str, str], list[float]] = {(w, m): [] for w in prompts for m in modes}
    with contextlib.ExitStack() as stack:
        for i, (mode, extra) in enumerate(modes.items()):
            cmd = _server_cmd(args.llamacpp_server, target, 18431 + i, args.threads, extra)
            stack.enter_context(running_server(cmd, urls[mode], out / f"llama-server-{i}.log", 120, args.threads))
        for url in urls.values():
            _generate(url, prompts["heldout"][0], 16)  # warm-up
        for _ in range(args.repeats):
            for workload, batch in prompts.items():
                for prompt in batch:
                    for mode, url in urls.items():
                        per_token[(workload, mode)].append(
                            _generate(url, prompt, args.output_len)["predicted_per_token_ms"]
                        )
    rows = [{"workload": w, "config": m, "TPOT ms": statistics.median(v)} for (w, m), v in per_token.items()]
    base = {r["workload"]: r["TPOT ms"] for r in rows if r["config"] == "none"}
    for r in rows:
        r["TPOT speed-up"] = base[r["workload"]] / r["TPOT ms"]
    return rows
