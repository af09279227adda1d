"""Every command the docs show must exist: `octavo` subcommands and their options, and the extras of install lines.

Fenced ```bash / ```sh / ```console blocks of README.md, BENCHMARKS.md and docs/*.md are read line by line
(backslash continuations joined, comments and console prompts dropped). Each `octavo ...` invocation must name a
subcommand the CLI has (`octavo simulate run|calibrate` are nested), every option it passes must be one of that
subcommand's option strings, and the whole line must parse with `build_parser()` once the brackets of optional
parts (`[MODEL]`, `[--repeats 2]`) are removed; placeholders (MODEL, /path/to/..., sk-...) parse as plain values.
`octavo gateway` and `octavo autoscale` lines must also give settings those commands accept. `pip install -e '.[X]'`
must name extras pyproject.toml defines, and no doc may install Octavo from a package index (it is not published
on one).
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from octavo.entrypoints.cli import autoscale_config, build_parser, gateway_config, subparser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.S | re.M)
# Words that only run another command: `exec octavo serve`, `env A=1 octavo ...`, `nohup octavo ...`.
WRAPPERS = {"exec", "env", "nohup", "time", "sudo"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # the joined command line, as the doc shows it

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def shell_lines() -> list[Command]:
    """The command lines of every shell block, continuations joined, comments and prompts dropped."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in FENCE.finditer(text):
            if block.group(1).lower() not in SHELL_LANGS:
                continue
            first_line = text.count("\n", 0, block.start(2)) + 1
            pending, start = "", 0
            for offset, raw in enumerate(block.group(2).splitlines()):
                line = raw.rstrip()
                if block.group(1).lower() == "console":
                    if not line.lstrip().startswith("$"):
                        continue  # output, not a command
                    line = line.lstrip()[1:]
                if not pending:
                    start = first_line + offset
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                joined = strip_comment(pending + line).strip()
                pending = ""
                if joined:
                    found.append(Command(doc.relative_to(ROOT).as_posix(), start, joined))
    return found


def strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # inside quotes or inside a word is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def segments(line: str) -> list[list[str]]:
    """The simple commands of a line (split at &&, ||, ;, |, &), each as words."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    parts: list[list[str]] = [[]]
    for word in lexer:
        if word and set(word) <= set(";&|"):
            parts.append([])
        else:
            parts[-1].append(word)
    return [p for p in parts if p]


def octavo_invocations(command: Command) -> list[list[str]]:
    """The argument lists (after `octavo`) of every `octavo` run by this line."""
    found = []
    for words in segments(command.text):
        while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] in WRAPPERS):
            words = words[1:]
        if words and (words[0] == "octavo" or words[0].endswith("/octavo")):
            found.append(words[1:])
    return found


INVOCATIONS = [(c, args) for c in shell_lines() for args in octavo_invocations(c)]


def command_parser(args: list[str]) -> tuple[argparse.ArgumentParser, list[str], str]:
    """The (sub)parser the arguments are for, the arguments left for it, and its name."""
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if not args or args[0].startswith("-"):
        return parser, args, "octavo"
    name = args[0]
    assert name in choices, f"no subcommand {name!r}; octavo has {sorted(choices)}"
    sub = subparser(parser, name)
    rest = args[1:]
    nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
    if nested and rest and not rest[0].startswith("-"):
        assert rest[0] in nested[0].choices, f"no `octavo {name} {rest[0]}`; it has {sorted(nested[0].choices)}"
        return nested[0].choices[rest[0]], rest[1:], f"{name} {rest[0]}"
    return sub, rest, name


def fill_placeholders(args: list[str]) -> list[str]:
    """The arguments with the brackets of optional parts removed (`[MODEL]`, `[--repeats 2]`): what is inside
    must exist too. A JSON list value (`'["*"]'`) keeps its brackets."""
    return [re.sub(r"(?<=[\w.])\]$", "", re.sub(r"^\[(?=[-\w/.])", "", word)) for word in args]


def test_the_docs_show_octavo_commands():
    # The test is only worth something while it finds the commands: README's first line among them.
    assert any(c.doc == "README.md" and args == ["serve"] for c, args in INVOCATIONS), INVOCATIONS[:5]
    assert len(INVOCATIONS) >= 10, [str(c) for c, _ in INVOCATIONS]


@pytest.mark.parametrize("command,args", INVOCATIONS, ids=[f"{c.doc}:{c.line}" for c, _ in INVOCATIONS])
def test_documented_octavo_command_exists(command: Command, args: list[str]):
    args = fill_placeholders(args)
    parser, rest, name = command_parser(args)
    options = {o for a in parser._actions for o in a.option_strings}
    flags = [w.split("=", 1)[0] for w in rest if re.match(r"--?[A-Za-z]", w)]
    unknown = [f for f in flags if f not in options]
    assert not unknown, f"{command}\n`octavo {name}` has no option {unknown}"
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in args or "-h" in args or "--version" in args):
            return
        pytest.fail(f"{command}\ndoes not parse as `octavo {name}` (argparse's message is above)")
    # The gateway's and the autoscaler's settings are validated without a model or the network: build them as the
    # commands do (a --config file a doc names only as an example is not there to read).
    if getattr(parsed, "config", None) is None and name in ("gateway", "autoscale"):
        try:
            gateway_config(parsed) if name == "gateway" else autoscale_config(parsed)
        except ValueError as exc:
            pytest.fail(f"{command}\n`octavo {name}` would refuse these settings: {exc}")


def test_install_lines_name_existing_extras():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    checked = 0
    for command in shell_lines():
        for words in segments(command.text):
            if words[:3] != ["pip", "install", "-e"] and words[:4] != ["python", "-m", "pip", "install"]:
                continue
            for word in words:
                match = re.fullmatch(r"\.\[([^\]]*)\]", word)
                if match:
                    checked += 1
                    named = {e.strip() for e in match.group(1).split(",")}
                    assert named <= extras, f"{command}\nno extra {sorted(named - extras)}; pyproject has {sorted(extras)}"
    assert checked, "no `pip install -e '.[extra]'` line found"


def test_octavo_is_installed_from_the_checkout_only():
    # Octavo is not published on a package index: `pip install octavo` or 'octavo[x]' would fetch something else.
    from_index = re.compile(r"pip install\s+(?:-U\s+|--upgrade\s+)?['\"]?octavo\b")
    hits = [f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"
            for doc in DOCS for n, line in enumerate(doc.read_text().splitlines(), 1) if from_index.search(line)]
    assert not hits, "install from the checkout instead (pip install -e '.[extra]'):\n" + "\n".join(hits)


def test_readme_starts_with_the_two_commands():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None
    first, second = block.group(1).splitlines()[:2]
    assert first.split(" # ")[0].strip() == "pip install -e . && octavo serve"
    assert second.split(" # ")[0].strip() == "pip install -e '.[test]' && python -m pytest"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


HELP_COMMANDS = sorted({tuple(args) for _, args in INVOCATIONS if args and args[-1] in ("--help", "-h")}
                       | {("--help",), ("serve", "--help")})


@pytest.mark.parametrize("args", HELP_COMMANDS, ids=[" ".join(a) for a in HELP_COMMANDS])
def test_help_commands_run(args: tuple[str, ...]):
    result = _run(*args)
    assert result.returncode == 0, result.stderr
    assert "usage: octavo" in result.stdout
