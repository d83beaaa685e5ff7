"""The README is read in ten minutes, and the docs keep their shape (issue 48; imports nothing heavy, < 1 s).

- README.md has at most 400 lines; measurement logs live in docs/benchmarks.md, architecture in docs/design.md.
- README.md, docs/cli.md, docs/benchmarks.md and docs/design.md: no line outside a table is wider than 120 columns
  (a Markdown table row cannot be wrapped, so its cells are held instead: none over 200 characters).
- Every table of docs/benchmarks.md follows, under its heading, the command that measured it; a table of figures
  (every table but a `| flag |` one) also gives the date it was measured.
- Nothing the product ships or tests points outside the repository (the workspace's shared notes or its checkouts).
- No wheel is tracked, and `*.whl` is ignored.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.doc_commands import COMMAND_START

REPO = Path(__file__).resolve().parents[1]  # not tests.helpers: that imports torch, and this test needs none
README_MAX_LINES = 400
MAX_COLUMNS = 120
MAX_CELL = 200
SHAPED = ("README.md", "docs/cli.md", "docs/benchmarks.md", "docs/design.md")
# outside the repository: the workspace's shared folder (its notes, tools, design) and its absolute checkouts
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])shared/(?:notes|tools|DESIGN)|(?<![\w}.])/work/(?:main|wt|shared)\b")
PRODUCT = ("megatron_offgrpo", "checkpoint_tools", "benchmarks", "launch", "configs", "docs", "tests")
DATE = re.compile(r"\b20\d\d-\d\d-(\d\d|DD)\b")


def _cells(row: str) -> list[str]:
    """The cells of a table row (``\\|`` is a character of a cell, not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def shape_problems(rel: str, text: str) -> list[str]:
    """Lines over MAX_COLUMNS outside tables and table cells over MAX_CELL, as ``file:line: what``."""
    problems = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            problems += [f"{rel}:{no}: a table cell of {len(c)} characters (> {MAX_CELL}): {c[:60]}..."
                         for c in _cells(line) if len(c) > MAX_CELL]
        elif len(line) > MAX_COLUMNS:
            problems.append(f"{rel}:{no}: {len(line)} columns (> {MAX_COLUMNS})")
    return problems


def table_problems(rel: str, text: str) -> list[str]:
    """Each table's section (from the heading above it to the table) must show a command, and a date unless it is a
    table of flags."""
    problems, lines = [], text.splitlines()
    section_start = 0
    for i, line in enumerate(lines):
        if line.startswith("#"):
            section_start = i
        starts_table = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
        if not starts_table:
            continue
        before = "\n".join(lines[section_start:i])
        spans = re.findall(r"`([^`\n]+)`", before) + re.findall(r"```\w*\n(.*?)```", before, re.S)
        if not any(COMMAND_START.match(s.strip()) for span in spans for s in span.splitlines()):
            problems.append(f"{rel}:{i + 1}: a table with no command between its heading and itself")
        if _cells(line)[0] != "flag" and not DATE.search(before):
            problems.append(f"{rel}:{i + 1}: a table of figures with no date (YYYY-MM-DD) above it")
    return problems


def test_readme_is_read_in_ten_minutes():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (> {README_MAX_LINES})"


@pytest.mark.parametrize("rel", SHAPED)
def test_lines_and_table_cells_are_short(rel):
    problems = shape_problems(rel, (REPO / rel).read_text())
    assert not problems, "\n".join(problems)


def test_every_benchmark_table_says_how_and_when_it_was_measured():
    problems = table_problems("docs/benchmarks.md", (REPO / "docs" / "benchmarks.md").read_text())
    assert not problems, "\n".join(problems)


def test_nothing_points_outside_the_repository():
    here = Path(__file__).resolve()
    files = [REPO / "README.md", REPO / "Makefile", REPO / "Dockerfile", REPO / "pyproject.toml"]
    for top in PRODUCT:
        files += [p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh", ".sbatch")]
    found = [f"{p.relative_to(REPO)}:{no}: {m.group(0)}" for p in files if p.resolve() != here
             for no, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             for m in OUTSIDE.finditer(line)]
    assert not found, "say it inside the repository (docs/design.md) instead:\n" + "\n".join(found)


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout")
def test_no_wheel_is_tracked():
    tracked = subprocess.run(["git", "ls-files", "*.whl"], cwd=REPO, capture_output=True, text=True, check=True)
    assert not tracked.stdout.strip(), f"wheels tracked: {tracked.stdout.split()}"
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert "*.whl" in ignored, ".gitignore does not ignore *.whl"


@pytest.mark.parametrize("text, expected", [
    ("a" * 121, "121 columns"),
    ("| " + "x" * 201 + " | y |", "a table cell of 201 characters"),
])
def test_the_shape_check_catches_a_wide_line_and_a_long_cell(text, expected):
    assert any(expected in p for p in shape_problems("x.md", text))


def test_the_table_check_catches_a_table_without_command_or_date():
    text = "## Speed\nmeasured once\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert len(table_problems("x.md", text)) == 2
    ok = "## Speed\n`python benchmarks/x.py` (2026-11-27)\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert table_problems("x.md", ok) == []


def test_the_outside_pattern_catches_pointers_and_spares_lookalikes():
    assert OUTSIDE.search("See `../shared/DESIGN.md`") and OUTSIDE.search("(``shared/notes/moe-on-cpu.md``)")
    assert OUTSIDE.search("cd /work/main && make")
    assert not OUTSIDE.search("runs ``BASE/work/main.py`` as __main__") and not OUTSIDE.search("{base}/work/main.py")
    assert not OUTSIDE.search("under DIR/shared or DIR/split")
