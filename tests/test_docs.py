"""docs/CONFIGURATION.md is generated from the config dataclasses and the CLI parsers: it must be current."""
from __future__ import annotations

from pathlib import Path

from octavo.entrypoints.cli import build_parser, subparser
from octavo.entrypoints.docs import render
from octavo.entrypoints.engine_args import config_fields

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONFIGURATION.md"


def test_configuration_reference_is_up_to_date():
    assert DOC.read_text() == render(), (
        "docs/CONFIGURATION.md is out of date: run `python -m octavo.entrypoints.docs > docs/CONFIGURATION.md`"
    )


def test_every_option_is_in_the_reference():
    text = render()
    flags = [cf.flag for cf in config_fields() if cf.name != "model"]
    for command in ("serve", "run-batch", "generate"):
        flags += [a.option_strings[0] for a in subparser(build_parser(), command)._actions if a.option_strings]
    missing = [f for f in flags if f"`{f}`" not in text and f not in ("-h", "--help")]
    assert not missing, missing
