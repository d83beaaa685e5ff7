"""The whole repository is ruff-clean under the rules of ``[tool.ruff]`` in pyproject.toml (< 1 s, imports nothing).

ruff is in the ``dev`` extra, so ``make test`` (and CI) always runs this; the test skips only where ruff is not
installed. To see or fix findings locally: ``.venv/bin/python -m ruff check .`` (``--fix`` for the safe fixes).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]  # not tests.helpers: that imports torch, and this test needs none


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format=concise", str(REPO)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"
