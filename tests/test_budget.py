"""tests/_budget.py's order, on a generated tree of four files named like the suite's: under `-n 2 --dist loadfile`
the heaviest files are handed out first (xdist alone hands out the file with most tests first, and a heavy
one-test file last), and plain pytest (no xdist) runs them in the same order; every file's and test's time is
written where ``OFFGRPO_SUITE_TIMES`` says."""

from __future__ import annotations

import os
import subprocess
import sys
import json
from collections import defaultdict

import pytest

from tests.helpers import REPO

# path -> number of tests; test_many has the most, so xdist's own order would hand it out first
TREE = {"tests/test_many.py": 6, "tests/train/test_signals.py": 1, "tests/test_docs_demo.py": 1,
        "tests/train/test_e2e.py": 1}
TEST = """import os
def test_{i}():
    with open(os.environ["ORDER_LOG"], "a") as log:
        log.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + " " + __file__.split("/tests/", 1)[1] + "\\n")
"""


def _run(root, *args: str, **extra_env: str) -> dict[str, list[str]]:
    """pytest on the tree with tests/_budget.py loaded: the files each worker ran, in the order it ran them."""
    log = root / "order.log"
    log.unlink(missing_ok=True)
    # without the outer run's PYTEST_* variables: under `make test` this test runs in an xdist worker, whose
    # PYTEST_XDIST_WORKER the inner plain-pytest run would otherwise report as its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(REPO), ORDER_LOG=str(log), **extra_env)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests._budget", "-p", "no:cacheprovider",
                           "--rootdir", str(root), "-c", str(root / "pytest.ini"), *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran: dict[str, list[str]] = defaultdict(list)
    for line in log.read_text().splitlines():
        worker, path = line.split()
        if not ran[worker] or ran[worker][-1] != "tests/" + path:
            ran[worker].append("tests/" + path)
    return dict(ran)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    (root / "pytest.ini").write_text("[pytest]\n")
    for path, n in TREE.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("\n".join(TEST.format(i=i) for i in range(n)))
    return root


def test_loadfile_hands_out_the_heaviest_files_first(tree):
    pytest.importorskip("xdist")
    ran = _run(tree, "-n", "2", "--dist", "loadfile")
    # the first worker up gets the demo then (a one-test file: a worker needs its next test before it
    # runs its last) the signals; the second e2e, then the rest
    assert sorted(ran.values()) == [["tests/test_docs_demo.py", "tests/train/test_signals.py"],
                                    ["tests/train/test_e2e.py", "tests/test_many.py"]], ran


def test_without_xdist_the_order_is_the_same(tree):
    assert _run(tree, "-p", "no:xdist") == {"main": ["tests/test_docs_demo.py", "tests/train/test_e2e.py",
                                                     "tests/train/test_signals.py", "tests/test_many.py"]}


def test_every_files_and_tests_time_is_written_when_asked(tree, tmp_path):
    times = tmp_path / "times" / "suite-times.json"
    _run(tree, "-p", "no:xdist", OFFGRPO_SUITE_TIMES=str(times))
    written = json.loads(times.read_text())
    assert sorted(written["files"]) == sorted(TREE) and len(written["tests"]) == sum(TREE.values())
    # one process: the session holds every test (each time rounded to 0.01 s)
    assert all(seconds >= 0 for seconds in written["tests"].values())
    assert written["wall_s"] + 0.005 * len(written["tests"]) >= sum(written["tests"].values())
