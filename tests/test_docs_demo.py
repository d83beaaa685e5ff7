"""`make demo` and the documented commands that reuse its runs (the "demo" unit of tests/doc_commands.py): the
warm-up, both RL runs and the report it is made of are found done, the resume, evaluation, conversion and report of
its trained policy use its runs. The other documented commands run in tests/test_docs_commands.py, in another
worker and working directory (tests/docs_workspace.py)."""

from __future__ import annotations

import json

import pytest

from tests.doc_commands import DocCommand, match_rule
from tests.docs_workspace import COMMANDS, DocsWorkspace, check_command, param, unit_commands, workspace_fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def docs_cwd(tmp_path_factory):
    """One mirror of the repo root for `make demo` and the commands of its unit, in order."""
    yield from workspace_fixture(tmp_path_factory, "demo")


@pytest.mark.multiproc
def test_make_demo(docs_cwd: DocsWorkspace) -> None:
    """`make demo`, the README's first command, run for real as a user runs it, first in the workspace: warm-up,
    GRPO at v=4 and v=1, report. Every stage exits 0; the first RL run is off-policy (v = 4) and the second on-policy
    (v = 1); each is evaluated before and after on the 20 held-out questions neither stage trains on, and raises
    greedy accuracy there by at least 0.2 (the warm-up's teacher gave a + b + 1 more often than a + b: seed 1234
    starts at 0.50 and ends at 0.80 after either run, measured 2026-11-26); the trained policy is exported as HF
    weights and the report names both runs' accuracies."""
    cmd = next(c for c in COMMANDS if c.text == "make demo")
    outcome = docs_cwd.execute(cmd, match_rule(cmd))
    assert outcome.ok, outcome.report()
    for name, v in (("tiny-cpu", 4), ("tiny-cpu-v1", 1)):
        run = docs_cwd.root / "runs" / name
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        versions = sorted({r["policy_version"] for r in records})
        assert versions == list(range(0, len(records), v)), (name, versions)  # refreshed every v steps
        start, end = records[0]["eval_start_accuracy"], records[-1]["eval_accuracy"]
        assert end >= start + 0.2, f"{name}: greedy held-out accuracy {start} -> {end}: RL gained less than 0.2"
        assert records[-1]["eval_version"] == len(records)  # the trained policy itself was evaluated
        assert f"greedy held-out accuracy {start:.3f} (step 0) -> {end:.3f} (step {len(records)})" in outcome.output
        assert (run / "hf" / "model.safetensors").exists()
    assert (docs_cwd.root / "runs" / "tiny-cpu" / "report.png").exists()
    assert "Traceback" not in outcome.output


@pytest.mark.parametrize("cmd", [param(c) for c in unit_commands("demo")])
def test_documented_command(cmd: DocCommand, docs_cwd: DocsWorkspace) -> None:
    check_command(cmd, docs_cwd)
