"""The house's walls that are sizes and circles, read from the source with ``ast`` (nothing is imported; < 1 s):
small doors, no room too large a share of the product, train/ a page-sized room, no circle of files, and benchmarks/
entering the package through its doors only (issue 48). The import rules between rooms are ``test_rooms.py``'s.

A file circle is a cycle of imports between modules: every import counts (top-level and inside functions), except
those under ``if TYPE_CHECKING:``, which never run. An import of a name through a lazy door (``_EXPORTS``) is an
import of the module the door loads it from.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

from tests.test_rooms import PKGS, _imported, _module_of, cycles, room_of_module

REPO = Path(__file__).resolve().parents[1]  # not tests.helpers: that imports torch, and this test needs none
PRODUCT = PKGS + ("benchmarks", "launch")  # and the repository's top-level .py files (setup.py): not tests/
DOOR_NAMES = 15
"""Most names a room's door exports."""
WIDE_DOORS: dict[str, int] = {}
"""The doors still over ``DOOR_NAMES``, and their sizes: they may narrow (lower the number with them), never widen."""
FUNCTION_LINES = 60
"""Most lines of a function (STYLE.md: going over needs a reason)."""
LONG_FUNCTIONS = {
    "megatron_offgrpo/runtime/_cpu_compat.py:apply_cpu_compat": 79,  # one idempotent list of patches, each commented
    "megatron_offgrpo/cli/fleet.py:build_parser": 75,  # argparse declarations, one per flag
    "megatron_offgrpo/kernels/_api.py:fused_linear_grpo_loss": 74,  # the public kernel: every argument checked here
    "megatron_offgrpo/cli/eval.py:main": 65,
    "megatron_offgrpo/algo/_token_loss.py:token_loss": 65,  # the objective family's one dispatch, formula by formula
    "megatron_offgrpo/model/_builder.py:transformer_config": 61,  # one TransformerConfig, field by field
}
"""The functions over ``FUNCTION_LINES``, and their lengths: they may shrink (lower the number), never grow."""
ROOM_SHARE = 0.12
"""Most of the product's lines one room may hold."""
TRAIN = "megatron_offgrpo/train"
TRAIN_FILES, TRAIN_LINES = 20, 2700
"""train/ holds the loop, the trainer side and the step (DESIGN.md): sampling and bookkeeping have rooms of their
own."""
SCRIPTS = ("benchmarks",)
"""Scripts that use the package as a user would: through the doors only."""


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _product_files(root: Path) -> list[Path]:
    return sorted([p for d in PRODUCT for p in (root / d).rglob("*.py")] + list(root.glob("*.py")))


def door_names(init: Path) -> list[str]:
    """The names a door exports: its ``__all__`` (a list, or ``sorted(_EXPORTS)`` of a lazy door's table)."""
    tree = ast.parse(init.read_text())
    values = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)}
    names = values.get("__all__")
    if isinstance(names, ast.Call) and names.args and isinstance(names.args[0], ast.Name):
        names = values.get(names.args[0].id)  # __all__ = sorted(_EXPORTS)
    if names is None:
        return []
    value = ast.literal_eval(names)
    return list(value.keys() if isinstance(value, dict) else value)


def _executed_imports(nodes):
    """The import statements under ``nodes`` that can run: not those under ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _executed_imports(node.orelse)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            yield from _executed_imports(ast.iter_child_nodes(node))


def _lazy_table(init: Path) -> dict[str, str]:
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def file_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (see the module docstring)."""
    files = {_module_of(p, root): p for pkg in PKGS for p in sorted((root / pkg).rglob("*.py"))}
    lazy = {module: _lazy_table(path) for module, path in files.items() if path.name == "__init__.py"}
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in files.items():
        for node in _executed_imports([ast.parse(path.read_text(), filename=str(path))]):
            for name in _imported(node, module, path.name == "__init__.py"):
                if name in files:
                    target = name
                else:
                    base, _, leaf = name.rpartition(".")
                    if base not in files:
                        continue
                    target = lazy.get(base, {}).get(leaf, base)
                if target != module:
                    edges[module].add(target)
    return edges


def script_private_imports(root: Path) -> list[str]:
    """Imports of a ``_private`` module or name of the package from ``SCRIPTS``."""
    found = []
    for script in SCRIPTS:
        for path in sorted((root / script).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                for name in _imported(node, _module_of(path, root), path.name == "__init__.py"):
                    room = room_of_module(name)
                    tail = name[len(room):].lstrip(".").split(".") if room else []
                    if any(t.startswith("_") and not t.startswith("__") for t in tail if t):
                        found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_every_door_is_small():
    sizes = {room_of_module(_module_of(init, REPO)): len(door_names(init))
             for pkg in PKGS for init in sorted((REPO / pkg).rglob("__init__.py"))
             if room_of_module(_module_of(init, REPO)) == _module_of(init, REPO)}
    assert sizes["megatron_offgrpo.train"] > 0, "no door's names found: the scan reads the wrong thing"
    wide = {room: f"{n} names" + (f" (was {WIDE_DOORS[room]})" if room in WIDE_DOORS else "")
            for room, n in sizes.items() if n > WIDE_DOORS.get(room, DOOR_NAMES)}
    assert not wide, f"doors over {DOOR_NAMES} names (or wider than they were): {wide}"


def test_no_room_holds_more_than_its_share_of_the_product():
    total = sum(_lines(p) for p in _product_files(REPO))
    rooms: dict[str, int] = collections.Counter()
    for pkg in PKGS:
        for path in (REPO / pkg).rglob("*.py"):
            rooms[room_of_module(_module_of(path, REPO))] += _lines(path)
    assert total > 10_000 and len(rooms) > 10, "the product looks empty: the scan reads the wrong place"
    over = {room: f"{n / total:.1%}" for room, n in rooms.items() if n > ROOM_SHARE * total}
    assert not over, f"rooms over {ROOM_SHARE:.0%} of the product's {total} lines: {over}"


def test_train_stays_a_room_of_the_loop_the_trainer_side_and_the_step():
    files = sorted((REPO / TRAIN).glob("*.py"))
    lines = sum(_lines(p) for p in files)
    assert len(files) <= TRAIN_FILES and lines <= TRAIN_LINES, (
        f"{TRAIN}/: {len(files)} files, {lines} lines (at most {TRAIN_FILES} and {TRAIN_LINES}): what does not run "
        "on every trainer rank has a room of its own (sampler/: rank 0's sampling; runlog/: the run's records)")


def long_functions(root: Path) -> dict[str, int]:
    """``path:name`` -> lines of every function of the packages over ``FUNCTION_LINES`` lines."""
    found = {}
    for path in sorted(p for d in PKGS for p in (root / d.replace(".", "/")).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    found[f"{path.relative_to(root)}:{node.name}"] = length
    return found


def test_functions_are_short():
    found = long_functions(REPO)
    assert "megatron_offgrpo/runtime/_cpu_compat.py:apply_cpu_compat" in found, "the scan reads the wrong thing"
    grown = {name: f"{length} lines (was {LONG_FUNCTIONS[name]})" if name in LONG_FUNCTIONS else f"{length} lines"
             for name, length in found.items() if length > LONG_FUNCTIONS.get(name, FUNCTION_LINES)}
    assert not grown, f"functions over {FUNCTION_LINES} lines (or longer than they were): {grown}"


def test_no_file_circles():
    edges = file_graph(REPO)
    assert len(edges) > 50, "few imports found: the scan reads the wrong place"
    found = cycles(edges)
    assert not found, "modules that import each other (in a circle):\n  " + "\n  ".join(" -> ".join(c) for c in found)


def test_benchmarks_enter_by_the_doors():
    found = script_private_imports(REPO)
    assert not found, "benchmarks import private modules or names (use a door):\n  " + "\n  ".join(found)


@pytest.fixture
def toy(tmp_path):
    files = {
        "megatron_offgrpo/__init__.py": "",
        "megatron_offgrpo/train/__init__.py": (
            '_EXPORTS = {"go": "megatron_offgrpo.train._b"}\n__all__ = sorted(_EXPORTS)\n'
        ),
        "megatron_offgrpo/train/_a.py": "def f():\n    from megatron_offgrpo.train import go\n",  # via the lazy door
        "megatron_offgrpo/train/_b.py": "from megatron_offgrpo.train._c import x\n",
        "megatron_offgrpo/train/_c.py": "from . import _a\n",  # relative, closes _a -> _b -> _c -> _a
        "megatron_offgrpo/model/__init__.py": "__all__ = ['A', 'B']\nfrom megatron_offgrpo.model._d import A, B\n",
        "megatron_offgrpo/model/_d.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_offgrpo.model import A\n"
        ),  # never runs: no circle
        "benchmarks/x.py": (
            "def main():\n    from megatron_offgrpo.train._b import x\n    from megatron_offgrpo.train import go\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_scans_see_each_kind_of_breach(toy):
    assert door_names(toy / "megatron_offgrpo/train/__init__.py") == ["go"]
    assert door_names(toy / "megatron_offgrpo/model/__init__.py") == ["A", "B"]
    assert cycles(file_graph(toy)) == [["megatron_offgrpo.train._a", "megatron_offgrpo.train._b",
                                        "megatron_offgrpo.train._c"]]
    assert script_private_imports(toy) == ["benchmarks/x.py:2 megatron_offgrpo.train._b.x"]
    long = toy / "megatron_offgrpo/model/_long.py"
    long.write_text("def f():\n" + "    x = 1\n" * FUNCTION_LINES + "\n\ndef g():\n    return 1\n")
    assert long_functions(toy) == {"megatron_offgrpo/model/_long.py:f": FUNCTION_LINES + 1}


def test_a_lazy_door_gives_the_name_and_a_whole_module_only_when_asked(tmp_path, monkeypatch):
    """``lazy_door`` returns the attribute a name maps to (``"sft": "..._sft"`` is the function ``sft`` of the module
    ``_sft``, not the module), and a module itself only for the names in ``whole``."""
    import types

    from megatron_offgrpo._lazy import lazy_door

    (tmp_path / "lazytoy").mkdir()
    (tmp_path / "lazytoy" / "__init__.py").write_text("")
    (tmp_path / "lazytoy" / "_sft.py").write_text("def sft():\n    return 'ran'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    door = lazy_door({"sft": "lazytoy._sft", "whole": "lazytoy._sft"}, whole=("whole",))
    assert door("sft")() == "ran" and isinstance(door("whole"), types.ModuleType)
    with pytest.raises(AttributeError):
        door("loads")
