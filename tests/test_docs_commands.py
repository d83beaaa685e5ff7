"""Docs are tests: every command README.md, docs/*.md and the configs/*.yaml headers show is extracted when the tests
are collected (tests/doc_commands.py) and checked the way its rule in ``RULES`` says, so a command that drifts from
the code fails CI with its source line, its exit code and the end of its output.

The commands run in two units, each in order in a working directory of its own (tests/docs_workspace.py), so that
the suite's two workers share them: this file runs the "rest" unit (everything that neither needs nor makes `make
demo`'s runs: the MoE runs, the torchrun and fleet runs on a 2-step warm-up, every dry and help check) and checks
the rule table itself; tests/test_docs_demo.py runs `make demo` and the commands that reuse its runs.
"""

from __future__ import annotations

import pytest

from tests.doc_commands import GENERATED_DOCS, RULES, UNITS, DocCommand, command_unit, match_rule, unit_of
from tests.docs_workspace import (COMMANDS, DocsWorkspace, check_command, param, provider_of, unit_commands,
                                  workspace_fixture)
from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def docs_cwd(tmp_path_factory):
    """One mirror of the repo root for every command of the "rest" unit, in order."""
    yield from workspace_fixture(tmp_path_factory, "rest")


@pytest.mark.parametrize("cmd", [param(c) for c in unit_commands("rest")])
def test_documented_command(cmd: DocCommand, docs_cwd: DocsWorkspace) -> None:
    check_command(cmd, docs_cwd)


def test_every_needed_state_is_made_in_its_unit() -> None:
    """Each unit makes what its commands need: a state one unit's command needs is provided by a command of the
    same unit (the two units run in different workers and directories), and both units have commands."""
    units = {command_unit(c) for c in COMMANDS}
    assert units == set(UNITS), units
    for cmd in COMMANDS:
        rule = match_rule(cmd)
        for state in rule.needs if rule else ():
            provider = provider_of(state, unit_of(rule))
            assert provider is not None, f"{cmd.id}: needs {state!r}, made by no command of its unit {unit_of(rule)}"
            assert unit_of(provider[1]) == unit_of(rule)


def test_every_source_shows_commands() -> None:
    """The extraction sees every file it reads (a parser that silently found nothing would pass everything)."""
    sources = {c.path for c in COMMANDS}
    expected = {"README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
                *(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml"))} - set(GENERATED_DOCS)
    assert expected <= sources, f"no command extracted from {sorted(expected - sources)}"
    ids = [c.id for c in COMMANDS]
    assert len(ids) == len(set(ids)), "two commands share an id"


def test_rule_table_is_closed() -> None:
    """Every state a rule needs is provided by a rule, and every mode is known."""
    provided = {r.provides for r in RULES if r.provides}
    for rule in RULES:
        assert rule.mode in ("run", "run-shortened", "dry", "help", "skip", "none"), rule
        assert set(rule.needs) <= provided, f"{rule.pattern}: needs {set(rule.needs) - provided}, nobody provides it"
        assert rule.mode == "run-shortened" or not rule.append, f"{rule.pattern}: appends only when shortened"


@pytest.mark.parametrize("text, path, expected", [
    ("offgrpo fleet start --model m --no-such-flag 2", "README.md", "--no-such-flag: not a flag of `offgrpo fleet"),
    ("... rollout.no_such_key=1", "configs/tiny-cpu.yaml", "unknown config key 'rollout.no_such_key'"),
    ("offgrpo eval --config configs/tiny-cpu.yaml --engine vllm optim.no_such_key=1", "README.md", "optim.no_such_key"),
    ("offgrpo fleet start --model m --cpu-bind everywhere", "README.md", "--cpu-bind everywhere: not one of"),
    ('pip install --constraint c.txt -e ".[plot,no-such-extra]"', "README.md", "extra 'no-such-extra' is not one of"),
    ("pip install --no-such-flag torch", "README.md", "--no-such-flag: not a flag of `pip install`"),
    ("python benchmarks/async_rollout.py --set optim.no_such_key=1", "docs/benchmarks.md", "optim.no_such_key"),
    ("podman run --rm --init -v r:/r img offgrpo train --config configs/tiny-cpu.yaml optim.no_such_key=1",
     "docs/install.md", "optim.no_such_key"),
    ("launch/build_image.sh --no-such-flag", "README.md", "--no-such-flag: not a flag of `launch/build_image.sh`"),
])
def test_dry_checks_catch_drift(text: str, path: str, expected: str, docs_cwd: DocsWorkspace) -> None:
    """The dry checks themselves: a made-up flag, recipe key or choice is reported (no command is run)."""
    problems = docs_cwd.dry(DocCommand(path, 1, 1, text))
    assert any(expected in p for p in problems), problems


def test_unknown_command_has_no_rule() -> None:
    assert match_rule(DocCommand("README.md", 1, 1, "frobnicate --all")) is None
