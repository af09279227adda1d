"""Reading the deployment artefacts under deploy/ for the tests: YAML documents and the commands they run."""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Iterator, Sequence

import yaml

from octavo.entrypoints.cli import autoscale_config, build_parser, gateway_config
from octavo.entrypoints.engine_args import engine_config_from_args
from tests.deploy.monitoring import DEPLOY

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_objects(folder: Path = DEPLOY / "k8s") -> Iterator[tuple[Path, dict]]:
    """Every Kubernetes object of the manifests (kustomization files and Helm values are not objects)."""
    for path in sorted(folder.rglob("*.yaml")):
        for doc in yaml_documents(path):
            if "kind" in doc and doc.get("kind") != "Kustomization":
                yield path, doc


def dockerfile_instructions(stage: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined; only `stage`'s when given."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    result: list[tuple[str, str]] = []
    current = None
    for line in lines:
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else None
        if stage is None or current == stage:
            result.append((keyword.upper(), rest.strip()))
    return result


def exec_form(arguments: str) -> list[str]:
    """A JSON-array instruction argument (ENTRYPOINT ["a", "b"]) as a list."""
    return yaml.safe_load(arguments)


def octavo_args(command: Sequence[str]) -> argparse.Namespace:
    """Parse a container command line the way `octavo` would; argparse errors become ValueError."""
    words = list(command)
    if words[:1] == ["octavo"]:
        words = words[1:]
    try:
        return build_parser().parse_args(words)
    except SystemExit as exc:  # argparse reports a bad command line by exiting (its message is on stderr)
        raise ValueError(f"`octavo {shlex.join(words)}` does not parse") from exc


def check_octavo_command(command: Sequence[str]) -> None:
    """Build the validated settings the command would run with (not the server itself)."""
    args = octavo_args(command)
    if args.command == "serve":
        engine_config_from_args(args)
    elif args.command == "gateway":
        gateway_config(args)
    elif args.command == "autoscale":
        autoscale_config(args)
    else:
        raise ValueError(f"unexpected octavo command {args.command!r}")
