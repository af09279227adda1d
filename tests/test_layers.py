"""The layering of docs/ARCHITECTURE.md, checked on the source: every import
between octavo's folders is one the document's table allows, every allowed
import is used, and the allowed graph has no cycle, so no import can run upward.

The table lists the layers by role; the imports each may make are written in
it, one row per layer, because a plain rank order is not the import order
(models call into ``attention/`` and ``distributed/``; ``octavo serve``
starts the HTTP front from the CLI)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "octavo"
DESIGN = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
ROOT = "<root>"  # tokenizer.py, config.py, sampling_params.py, outputs.py, ...: shared by the layers


def _allowed_graph() -> dict[str, set[str]]:
    """The rows of the table after the "layers" marker: | layer | may import | why |."""
    text = DESIGN.read_text()
    rows = text[text.index("<!-- layers:"):].split("\n\n", 1)[0].splitlines()[3:]
    graph = {}
    for row in rows:
        layer, imports = (cell.strip().strip("`") for cell in row.strip("|").split("|")[:2])
        graph[layer] = {name.strip().strip("`") for name in re.split(r",", imports) if name.strip()}
    return graph


ALLOWED = _allowed_graph()


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
    assert folders <= set(ALLOWED), f"add {sorted(folders - set(ALLOWED))} to the table of {DESIGN.name}"
    # A layer without a folder is a rule about nothing.
    assert set(ALLOWED) - {ROOT} <= folders, f"no folder for {sorted(set(ALLOWED) - {ROOT} - folders)} in {DESIGN.name}"


def test_no_import_runs_upward():
    bad = [f"{src} -> {dst}" for src, dst in _edges() if not _allowed(src, dst)]
    assert not bad, f"imports against the layering of {DESIGN.name}:\n" + "\n".join(bad)


def test_every_allowed_import_is_used():
    """An allowed edge that no module needs only widens what a layer may
    import without anyone noticing: the graph says what is, no more."""
    used = {(_layer(src), _entry(src, dst)) for src, dst in _edges()}
    unused = [f"{layer} -> {entry}" for layer, entries in ALLOWED.items() for entry in sorted(entries)
              if (layer, entry) not in used]
    assert not unused, f"allowed but imported by no module (remove from {DESIGN.name}):\n" + "\n".join(unused)


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
