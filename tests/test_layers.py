"""The layering of ../shared/DESIGN.md, checked on the source: every import
between octavo's folders is one the design allows, and the allowed graph has
no cycle, so no import can run upward.

The design's table lists the layers top to bottom by role; the imports that
role implies are written out here, one line per layer, because a plain rank
order is not the import order (models call into ``attention/`` and
``distributed/``, which the table lists above ``model/``; ``octavo serve``
starts the HTTP front, listed above the CLI)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "octavo"
ROOT = "<root>"  # tokenizer.py, config.py, sampling_params.py, outputs.py, ...: shared by the layers

ALLOWED: dict[str, set[str]] = {
    # Fronts talk to engines only: the engine's async client (ZMQ) or HTTP.
    "server": {"engine", "openai", ROOT},
    # The gateway validates with the replicas' request models and hashes prompts as the prefix cache does.
    "gateway": {"openai", "core.prefix_hash", ROOT},
    # The OpenAI API's bodies and errors, shared by both fronts: torch-free and engine-free.
    "openai": set(),
    "autoscale": {ROOT},
    # The capacity simulator drives the real scheduler, the gateway's routing policies and the autoscaler's policy.
    "simulate": {"core", "gateway", "autoscale", ROOT},
    # The CLI and LLM(...) build one EngineConfig; `octavo serve` starts the server.
    "entrypoints": {"engine", "server", "gateway", "autoscale", "simulate", "assets", ROOT},
    # Scheduler + executor; grammars compile and generation_config.json is read here, and the
    # model path is checked (checkpoint/paths.py) before anything starts.
    "engine": {"core", "executor", "sample", "model", "checkpoint", ROOT},
    "core": {ROOT},
    "executor": {"worker", "distributed", "core.outputs", ROOT},
    # The step contract (core/outputs.py, and core/step_state.py: the rank's half
    # of the request state the step deltas update) is the only part of core a rank reads.
    "worker": {"core.outputs", "core.step_state", "model", "checkpoint", "attention", "quant", "sample", "spec_decode",
               "distributed", "kernels", ROOT},
    # The proposer reads the rank's request state (core/step_state.py), as the sampler does; the
    # draft-model proposer lays out its draft's steps (attention), samples its proposals (sample) and
    # checks the draft against the target (model config, checkpoint paths).
    "spec_decode": {"core.step_state", "attention", "model", "sample", "checkpoint", ROOT},
    # GGUF metadata and vocabularies are read through checkpoint/ (torch-free, shared with the tokenizer).
    "model": {"attention", "quant", "distributed", "kernels", "checkpoint", ROOT},
    "attention": {"kernels"},
    "quant": {"distributed", "kernels", ROOT},
    # The sampler reads the rank's request state; the grammar bitmask travels in the step contract,
    # filled by grammars of the structured-output seam.
    "sample": {"core.outputs", "core.step_state", "core.structured_output", ROOT},
    "distributed": set(),
    "kernels": set(),
    "assets": set(),
    # Checkpoint files read without torch (GGUF, SentencePiece): below the package root's tokenizer.
    "checkpoint": set(),
    ROOT: {"checkpoint"},
}

def _layer(module: str) -> str:
    """octavo.engine.llm_engine -> engine; octavo.config -> ROOT."""
    parts = module.split(".")
    if len(parts) == 1 or (PACKAGE / f"{parts[1]}.py").is_file():
        return ROOT
    return parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every octavo module ``path`` imports, at any depth (TYPE_CHECKING too:
    a type-only import is still a dependency of the design)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "octavo" or m.startswith("octavo.")}


def _edges() -> list[tuple[str, str]]:
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _module_name(path)
        if src == "octavo":
            continue  # the package __init__ re-exports the public API (LLM lazily)
        for dst in sorted(_imports(path)):
            if dst != "octavo" and _layer(dst) != _layer(src):
                edges.append((src, dst))
    return edges


def _entry(src: str, dst: str) -> str | None:
    """The entry of ALLOWED that lets ``src`` import ``dst``: the most specific
    one ("core.outputs" before "core"), None when there is none."""
    target = dst.split(".", 1)[1] if _layer(dst) != ROOT else ROOT
    matches = [a for a in ALLOWED[_layer(src)] if target == a or target.startswith(a + ".")]
    return max(matches, key=len, default=None)


def _allowed(src: str, dst: str) -> bool:
    return _entry(src, dst) is not None


def test_every_folder_has_a_place_in_the_design():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders <= set(ALLOWED), f"add {sorted(folders - set(ALLOWED))} to ALLOWED (and to DESIGN.md)"
    # A layer without a folder is a rule about nothing.
    assert set(ALLOWED) - {ROOT} <= folders, f"no folder for {sorted(set(ALLOWED) - {ROOT} - folders)} in ALLOWED"


def test_no_import_runs_upward():
    bad = [f"{src} -> {dst}" for src, dst in _edges() if not _allowed(src, dst)]
    assert not bad, "imports against the layering of DESIGN.md:\n" + "\n".join(bad)


def test_every_allowed_import_is_used():
    """An allowed edge that no module needs only widens what a layer may
    import without anyone noticing: the graph says what is, no more."""
    used = {(_layer(src), _entry(src, dst)) for src, dst in _edges()}
    unused = [f"{layer} -> {entry}" for layer, entries in ALLOWED.items() for entry in sorted(entries)
              if (layer, entry) not in used]
    assert not unused, "allowed but imported by no module (remove from ALLOWED):\n" + "\n".join(unused)


def test_the_allowed_graph_has_no_cycle():
    """With no cycle, the layers have an order in which every allowed import points down."""
    graph = {layer: {a.split(".")[0] for a in deps} - {layer} for layer, deps in ALLOWED.items()}
    done: set[str] = set()

    def visit(layer: str, path: tuple[str, ...]) -> None:
        if layer in path:
            pytest.fail("cycle: " + " -> ".join(path[path.index(layer):] + (layer,)))
        if layer in done:
            return
        for dep in graph.get(layer, ()):
            visit(dep, path + (layer,))
        done.add(layer)

    for layer in graph:
        visit(layer, ())


def test_the_checker_itself():
    """TYPE_CHECKING imports count; the rules tell the step contract from the rest of core."""
    assert "octavo.tokenizer" in _imports(PACKAGE / "sample" / "llguidance_backend.py")  # type-only there
    assert _allowed("octavo.sample.llguidance_backend", "octavo.tokenizer")
    assert not _allowed("octavo.sample.llguidance_backend", "octavo.engine.detokenizer")
    assert not _allowed("octavo.server.streams", "octavo.core.outputs")
    assert _allowed("octavo.worker.model_runner", "octavo.core.outputs")
    assert not _allowed("octavo.worker.model_runner", "octavo.core.scheduler")
