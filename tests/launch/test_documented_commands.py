"""Every `offgrpo fleet start ...` written in a recipe header, a doc, a launch script or the Dockerfile parses with the
real CLI parser (a recipe once said `--servers 2`, which argparse rejects)."""

from __future__ import annotations

import re
import shlex

import pytest

from megatron_offgrpo.cli.fleet import build_parser
from tests.helpers import REPO

SOURCES = [*sorted((REPO / "configs").rglob("*.yaml")), *sorted((REPO / "docs").glob("*.md")), REPO / "README.md",
           REPO / "Dockerfile", *sorted((REPO / "launch").glob("*.sh")), REPO / "megatron_offgrpo/cli/fleet.py"]
# the command and its arguments up to a comment, a closing backtick or the end of the line (not a bare mention)
COMMAND = re.compile(r"(?:offgrpo fleet|launch/fleet\.sh) start +(--[^#`\n]*)")


def documented_starts() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            following = iter(lines[number:])
            while line.endswith("\\"):  # a shell line continued on the next: its flags count too
                line = line[:-1] + " " + next(following, "").strip()
            found += [(f"{path.relative_to(REPO)}:{number}", m.group(1)) for m in COMMAND.finditer(line)]
    return found


STARTS = documented_starts()


def test_the_recipes_document_a_fleet_start():
    assert any(where.startswith("configs/") for where, _ in STARTS)


@pytest.mark.parametrize("where, args", STARTS, ids=[where for where, _ in STARTS])
def test_documented_fleet_start_parses(where, args):
    words = [w for w in shlex.split(args.replace("[", " ").replace("]", " ")) if w != "\\"]
    parsed = build_parser().parse_args(["start", *words])  # SystemExit (code 2) on an unknown or malformed flag
    assert parsed.model is not None, where
