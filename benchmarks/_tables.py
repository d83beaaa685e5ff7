"""The markdown table every benchmark prints: one header row, then a row per dict."""

from __future__ import annotations

import json
from pathlib import Path


def markdown(columns: list[str], rows: list[dict]) -> str:
    """``rows`` under a header of ``columns`` (each row holds every column)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_table(out: Path, name: str, columns: list[str], rows: list[dict]) -> str:
    """The table of ``rows`` into ``out/NAME.md``, the rows into ``out/NAME.json``; printed and returned."""
    table = markdown(columns, rows)
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return table
