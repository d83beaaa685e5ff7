"""The shared working directory of the documented commands (tests/test_docs_commands.py, tests/test_docs_demo.py):
a temporary mirror of the repo root (symlinks to configs/, megatron_offgrpo/, launch/, ...) in which the docs'
relative paths resolve and their outputs (runs/) land, and the checks of each mode. Each of the two test files has
its own workspace and runs its own unit of commands (``doc_commands.UNITS``) in order: a command that needs another's
output (train needs a warm-up's runs/tiny-cpu-sft/hf, report a finished run, fleet status a started fleet) first
runs the documented command of its unit that produces it; a command line that ends up with the same arguments and
the same loaded recipe as one already run is not run twice.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.doc_commands import (OVERRIDE, DocCommand, Rule, command_unit, docker_inner, extract_all, extras_problems,
                                flag_problems, flag_value, help_calls, make_target_commands, match_rule, peel_env,
                                synopsis_variants, unit_of)
from tests.helpers import REPO, _free_port

COMMANDS = extract_all(REPO)
BIN = Path(sys.executable).parent  # the virtualenv's offgrpo, python, torchrun
TAIL = 30
HELP_TIMEOUT = 120


@dataclass
class Outcome:
    """What one subprocess did."""

    argv: list[str]
    env: dict[str, str]
    returncode: int | None  # None: it did not start, or it ran out of time and was killed
    output: str  # stdout and stderr together
    seconds: float
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def report(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        tail = "\n".join(self.output.rstrip().splitlines()[-TAIL:])
        code = self.returncode
        if code is None:
            code = "none, killed" if self.killed else "none, did not start"
        return (f"ran: {env + ' ' if env else ''}{shlex.join(self.argv)}  ({self.seconds:.0f} s)\n"
                f"exit code: {code}\n--- last {TAIL} lines of output ---\n{tail}")


def header(cmd: DocCommand, rule: Rule) -> str:
    return f"{cmd.id}: `{cmd.text}`  [{rule.mode}: {rule.reason}]"


class DocsWorkspace:
    """A unit's working directory: runs its commands there once each and remembers what they left behind."""

    def __init__(self, root: Path, unit: str) -> None:
        self.root, self.unit = root, unit
        for entry in REPO.iterdir():
            if entry.name not in (".git", "runs"):
                (root / entry.name).symlink_to(entry)
        self.env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
        self.cache: dict[tuple, Outcome] = {}
        self.states: dict[str, tuple] = {}  # state name -> cache key of the run that made it
        self.fleet_dirs: list[str] = []

    def run(self, argv: list[str], env: dict[str, str], timeout: float, key: tuple | None = None) -> Outcome:
        """Run ``argv`` in the workspace (once per ``key``); kill its whole process group after ``timeout`` s."""
        key = key or (tuple(argv), tuple(sorted(env.items())))
        if key in self.cache:
            return self.cache[key]
        full = {**self.env, **env}
        if argv[0] == "torchrun":  # torchrun's default port 29500 may be taken by another test on this machine
            full.setdefault("PET_MASTER_PORT", str(_free_port()))
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=self.root, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
        except OSError as exc:
            outcome = Outcome(argv, env, None, f"cannot start {argv[0]!r}: {exc}", 0.0)
        else:
            killed = False
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, killed = proc.communicate()[0] + f"\n[killed after {timeout} s]", True
            rc = None if killed else proc.returncode
            outcome = Outcome(argv, env, rc, output, time.monotonic() - start, killed)
        self.cache[key] = outcome
        return outcome

    # ---- run / run-shortened --------------------------------------------------------------------------------
    def execute(self, cmd: DocCommand, rule: Rule) -> Outcome:
        """Run a documented command as written plus the rule's appended overrides, after what it needs."""
        for state in rule.needs:
            self.ensure(state, cmd)
        env, argv = peel_env(shlex.split(cmd.text))
        argv = argv + list(rule.append)
        key = self.run_key(argv, env)
        outcome = self.run(argv, env, rule.timeout, key)
        if outcome.ok and rule.provides:
            self.states[rule.provides] = key
            if rule.provides == "demo":  # its command lines are documented too: found here, not run again
                for line in make_target_commands(self.root / "Makefile", "demo"):
                    self.cache[self.run_key(line, {})] = outcome
            if rule.provides == "fleet":
                self.fleet_dirs.append(flag_value(argv, "--state-dir") or "runs/fleet")
        if outcome.ok and rule.ends in self.states:
            self.cache.pop(self.states.pop(rule.ends), None)  # a later command that needs it starts it again
        return outcome

    def run_key(self, argv: list[str], env: dict[str, str]) -> tuple:
        """Commands with a recipe are the same run when their other arguments and the loaded config are equal
        (`train.steps=100 train.steps=2` is `train.steps=2`)."""
        recipe = flag_value(argv, "--config")
        if recipe is None:
            return (tuple(argv), tuple(sorted(env.items())))
        from megatron_offgrpo.config import load_config

        overrides = [a for a in argv if OVERRIDE.match(a)]
        try:
            config = repr(dataclasses.asdict(load_config(self.root / recipe, overrides)))
        except Exception:  # noqa: BLE001 - the command itself reports the error when it runs
            return (tuple(argv), tuple(sorted(env.items())))
        rest = tuple(a for a in argv if not OVERRIDE.match(a))
        return (rest, config, tuple(sorted(env.items())))

    def ensure(self, state: str, cmd: DocCommand) -> None:
        """Make ``state`` by running the first documented command of this unit whose rule provides it."""
        if state in self.states:
            return
        provider = provider_of(state, self.unit)
        if provider is None:
            pytest.fail(f"{cmd.id}: `{cmd.text}` needs {state!r}, and no documented command of the {self.unit!r} "
                        "unit provides it")
        outcome = self.execute(*provider)
        if not outcome.ok:
            pytest.fail(f"{cmd.id}: `{cmd.text}` needs {state!r}, whose command failed:\n"
                        f"{header(*provider)}\n{outcome.report()}")

    # ---- dry / help -------------------------------------------------------------------------------------------
    def dry(self, cmd: DocCommand) -> list[str]:
        """Problems of a command that is not run: flags, recipe keys, Makefile target, Slurm or Docker dry forms."""
        env, argv = peel_env(shlex.split(cmd.text))
        if argv[:2] in (["docker", "run"], ["podman", "run"]):
            argv = docker_inner(argv)
        if argv[0] == "...":  # a recipe header's override example
            return self.config_problems(["--config", cmd.path, *argv[1:]])
        if argv[0] == "make":
            return self.expect_ok(["make", "-n", *argv[1:]], {})
        if argv[0] == "sbatch":
            return self.slurm(argv, env)
        if argv[:2] == ["docker", "build"]:
            dockerfile = flag_value(argv, "-f", "--file") or str(Path(argv[-1]) / "Dockerfile")
            return [] if (self.root / dockerfile).is_file() else [f"{dockerfile}: no such file in the build context"]
        if argv[0] == "pip":
            import tomllib  # Python >= 3.11, as CI

            extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
            return self.static(argv) + extras_problems(argv, extras)
        return self.static(argv)

    def static(self, argv: list[str]) -> list[str]:
        """Each --help the command line reaches exits 0 and lists its flags; its recipe and overrides load."""
        problems = []
        for help_argv, args in help_calls(argv):
            outcome = self.run(help_argv, {}, HELP_TIMEOUT)
            program = shlex.join(help_argv[:-1])
            problems += flag_problems(args, outcome.output, program) if outcome.ok else [outcome.report()]
        return problems + self.config_problems(argv)

    def config_problems(self, argv: list[str]) -> list[str]:
        recipe, overrides = flag_value(argv, "--config"), [a for a in argv if OVERRIDE.match(a)]
        if recipe is None and overrides and any(a.startswith("benchmarks/") for a in argv[:2]):
            recipe = "configs/tiny-cpu.yaml"  # a benchmark's `--set KEY=VALUE` overrides its runs' tiny recipe
        if recipe is not None and not recipe.endswith((".yaml", ".yml")):  # a benchmark's HF config directory
            return [] if (REPO / recipe).is_dir() else [f"--config {recipe}: no such directory in the repository"]
        if recipe is None and not overrides:
            return []
        from megatron_offgrpo.config import load_config

        try:
            load_config(self.root / recipe if recipe else None, overrides)
        except Exception as exc:  # noqa: BLE001 - any error is the finding
            return [f"load_config({recipe!r}, {overrides}): {type(exc).__name__}: {exc}"]
        return []

    def expect_ok(self, argv: list[str], env: dict[str, str]) -> list[str]:
        outcome = self.run(argv, env, HELP_TIMEOUT)
        return [] if outcome.ok else [outcome.report()]

    def slurm(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """`sbatch [opts] SCRIPT RECIPE [k=v ...]` -> the script's DRY_RUN=1 on NODES named after --nodes."""
        script = next(i for i, tok in enumerate(argv) if tok.endswith((".sbatch", ".sh")))
        nodes = int(flag_value(argv[:script], "--nodes", "-N") or 1)
        env = {**env, "DRY_RUN": "1", "NODES": " ".join(f"node{i:02d}" for i in range(nodes))}
        args = argv[script + 1:]
        return self.expect_ok(["bash", *argv[script:]], env) + self.config_problems(["--config", *args])

    def help(self, cmd: DocCommand, rule: Rule) -> list[str]:
        """A name or synopsis: the sub-command's --help exits 0 and lists the flags shown; a script exists."""
        problems = []
        for argv in synopsis_variants(rule.help_as or cmd.text):
            if len(argv) == 1 and "/" in argv[0]:
                path = self.root / argv[0]
                if not path.is_file():
                    problems.append(f"{argv[0]}: no such file")
                elif path.suffix in (".sh", ".sbatch"):
                    problems += self.expect_ok(["bash", "-n", argv[0]], {})
            else:
                problems += self.static(argv)
        return problems

    def stop_fleets(self) -> None:
        """Teardown: stop a fleet a documented command started and none stopped."""
        for state_dir in self.fleet_dirs if "fleet" in self.states else []:
            if (self.root / state_dir / "fleet.json").exists():
                argv = ["offgrpo", "fleet", "stop", "--state-dir", state_dir]
                self.run(argv, {}, HELP_TIMEOUT, key=("teardown", state_dir))


def provider_of(state: str, unit: str) -> tuple[DocCommand, Rule] | None:
    """The first documented command of ``unit`` whose rule provides ``state``, with its rule."""
    return next(((c, r) for c in COMMANDS if (r := match_rule(c)) and r.provides == state and unit_of(r) == unit),
                None)


def check_command(cmd: DocCommand, workspace: DocsWorkspace) -> None:
    """One documented command, checked the way its rule says (the body of both files' parametrized test)."""
    rule = match_rule(cmd)
    if rule is None:
        pytest.fail(f"{cmd.id}: `{cmd.text}` matches no rule: add one to RULES in tests/doc_commands.py saying how "
                    "CI runs it (run / run-shortened / dry / help / skip) and why")
    if rule.mode == "skip":
        pytest.skip(f"{cmd.id}: {rule.reason}")
    if rule.mode in ("run", "run-shortened"):
        outcome = workspace.execute(cmd, rule)
        seen = [text for text in rule.forbid if text in outcome.output]
        if not outcome.ok or seen:
            note = f"its output says {seen}\n" if seen else ""
            pytest.fail(f"{header(cmd, rule)}\n{note}{outcome.report()}", pytrace=False)
    elif rule.mode in ("dry", "help"):
        problems = workspace.dry(cmd) if rule.mode == "dry" else workspace.help(cmd, rule)
        if problems:
            pytest.fail(header(cmd, rule) + "".join(f"\n- {p}" for p in problems), pytrace=False)
    else:
        assert rule.mode == "none", f"{rule.pattern}: unknown mode {rule.mode!r}"


def workspace_fixture(tmp_path_factory, unit: str):
    """The body of each file's module-scoped fixture: one mirror for the unit's commands, in order."""
    workspace = DocsWorkspace(tmp_path_factory.mktemp(f"docs-{unit}"), unit)
    yield workspace
    workspace.stop_fleets()
    # gigabytes of runs by the end: a failing command's output is already in its report
    shutil.rmtree(workspace.root, ignore_errors=True)


def unit_commands(unit: str) -> list[DocCommand]:
    """The unit's commands in the docs' order, except that a command ending a state (`fleet stop`) runs right after
    the last one that needs it: a later page's `fleet status` would otherwise start the fleet again (~40 s)."""
    commands = [c for c in COMMANDS if command_unit(c) == unit]
    for ender, state in [(c, r.ends) for c in commands if (r := match_rule(c)) and r.ends]:
        commands.remove(ender)
        users = [i for i, c in enumerate(commands) if (r := match_rule(c)) and state in r.needs]
        commands.insert(users[-1] + 1 if users else len(commands), ender)
    return commands


def param(cmd: DocCommand):
    """A command as a pytest parameter: its id, and the multiproc mark its rule asks for."""
    rule = match_rule(cmd)
    return pytest.param(cmd, id=cmd.id, marks=[pytest.mark.multiproc] if rule and rule.multiproc else [])
