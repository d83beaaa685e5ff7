"""The ``offgrpo`` dispatcher as a new user meets it: --version, and the convert sub-commands listed by --help."""

from __future__ import annotations

import importlib.metadata

import pytest

from megatron_offgrpo.cli import CONVERT, main


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_version_and_commit(flag, capsys):
    main([flag])  # returns: exit status 0
    first, recipes = capsys.readouterr().out.strip().splitlines()
    assert first.startswith(f"offgrpo {importlib.metadata.version('megatron-offgrpo')}, commit "), first
    assert recipes.startswith("recipes: ") and recipes.endswith("(offgrpo recipes DIR copies them)"), recipes


def test_convert_help_lists_each_sub_command_with_its_description(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["convert", "--help"])
    out = capsys.readouterr().out
    assert caught.value.code == 0
    for name, (_, description) in CONVERT.items():
        assert any(line.split() == [name, *description.split()] for line in out.splitlines()), (name, out)


def test_convert_without_a_sub_command_lists_them_and_fails(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["convert"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "roundtrip" in err and "name a convert sub-command" in err


def test_end_process_runs_the_exit_handlers_flushes_and_keeps_the_status():
    """How a heavy sub-command's process ends (no interpreter teardown): the atexit handlers still run, buffered
    output still arrives, and the exit status is the command's."""
    import subprocess
    import sys

    code = ("import atexit, sys; atexit.register(lambda: print('handler ran'))\n"
            "from megatron_offgrpo.cli import end_process\n"
            "print('buffered', end=' '); print('to stderr', file=sys.stderr, end=''); end_process(3)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered handler ran\n", "to stderr")
