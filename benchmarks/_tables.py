"""The markdown table every benchmark prints: one header row, then a row per dict."""

from __future__ import annotations


def markdown(columns: list[str], rows: list[dict]) -> str:
    """``rows`` under a header of ``columns`` (each row holds every column)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
