"""The house rules of docs/design.md on imports, read from the source with ``ast`` (nothing is imported; < 1 s).

A room is a top-level package (``checkpoint_tools``), a direct sub-package of ``megatron_offgrpo``
(``megatron_offgrpo/rollout``) or a top-level module of it (``megatron_offgrpo/config.py``), as in
docs/design.md ("Rooms and arrows"). A room is entered only through its ``__init__.py``: no import of another room's
``_private`` module or name, no cycle between rooms; and the fleet side speaks HF names only: rollout/ (and fleet/)
never import model/. Every import counts: top-level, inside functions, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]  # not tests.helpers: that imports torch, and this test needs none
PKGS = ("megatron_offgrpo", "checkpoint_tools")
HF_ONLY = ("megatron_offgrpo.rollout", "megatron_offgrpo.fleet", "megatron_offgrpo.transports")  # never import model/
MODEL = "megatron_offgrpo.model"
# The three rooms of generation, by the process they run in, and the only rooms each may import: transports (the
# weights' way into the servers, and its wire format) at the bottom, the fleet (inside and around the vLLM servers)
# on it, the trainer-side client (rollout) on both. Neither the fleet nor the transports know the client.
GENERATION_MAY_IMPORT = {
    "megatron_offgrpo.transports": {"checkpoint_tools"},
    "megatron_offgrpo.fleet": {"megatron_offgrpo.transports", "checkpoint_tools", "megatron_offgrpo.runtime"},
    "megatron_offgrpo.rollout": {
        "megatron_offgrpo.transports",
        "megatron_offgrpo.fleet",
        "checkpoint_tools",
        "megatron_offgrpo.data",
        "megatron_offgrpo.envs",
    },
    # environments see prompts and text, never the model; optional packages through the root's require_extra
    "megatron_offgrpo.envs": {"megatron_offgrpo.data", "megatron_offgrpo.require_extra"},
}


def room_of_module(mod: str) -> str | None:
    """The room of a dotted module (or module.name) path; None outside the project."""
    parts = mod.split(".")
    if parts[0] not in PKGS:
        return None
    if parts[0] == "checkpoint_tools" or len(parts) == 1:
        return parts[0]
    return parts[0] + "." + parts[1]


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement reaches: ``a.b`` for ``import a.b``, ``a.b.c`` for ``from a.b import c``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = module.split(".")
        package = package if is_package else package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]


def scan(root: Path) -> tuple[list[str], dict[str, set[str]], list[str]]:
    """(private cross-room imports, room -> rooms it imports, imports of model/ from the HF-only rooms)."""
    private, model_imports, edges = [], [], collections.defaultdict(set)
    for pkg in PKGS:
        for path in sorted((root / pkg).rglob("*.py")):
            module = _module_of(path, root)
            src = room_of_module(module)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                for name in _imported(node, module, path.name == "__init__.py"):
                    dst = room_of_module(name)
                    if dst is None or dst == src:
                        continue
                    edges[src].add(dst)
                    where = f"{path.relative_to(root)}:{node.lineno} {src} -> {name}"
                    tail = name[len(dst) :].lstrip(".").split(".")
                    if any(t.startswith("_") and not t.startswith("__") for t in tail if t):
                        private.append(where)
                    if src in HF_ONLY and dst == MODEL:
                        model_imports.append(where)
    return private, edges, model_imports


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def repo_scan():
    return scan(REPO)


def test_rooms_are_entered_through_their_door(repo_scan):
    private, _, _ = repo_scan
    assert not private, "imports of another room's private module or name:\n  " + "\n  ".join(private)


def test_no_cycles_between_rooms(repo_scan):
    _, edges, _ = repo_scan
    assert edges, "no import between rooms found: the scan looks in the wrong place"
    found = cycles(edges)
    assert not found, "room cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_the_fleet_side_never_imports_the_model(repo_scan):
    _, _, model_imports = repo_scan
    assert not model_imports, "rollout/ must speak HF names only (go through checkpoint_tools):\n  " + "\n  ".join(
        model_imports
    )


def test_the_generation_rooms_import_only_what_they_may(repo_scan):
    _, edges, _ = repo_scan
    assert set(GENERATION_MAY_IMPORT) <= set(edges), "a generation room is missing or imports nothing of ours"
    extra = {
        room: sorted(edges[room] - allowed) for room, allowed in GENERATION_MAY_IMPORT.items() if edges[room] - allowed
    }
    assert not extra, f"generation rooms import rooms they may not: {extra}"


def test_the_scan_sees_every_kind_of_violation(tmp_path):
    files = {
        "megatron_offgrpo/__init__.py": "",
        "megatron_offgrpo/config.py": "def f():\n    from megatron_offgrpo.train import loop\n",
        "megatron_offgrpo/train/__init__.py": "from megatron_offgrpo.config import Config\n",
        "megatron_offgrpo/train/loop.py": "from . import _step\nfrom ._step import x\n",  # relative: same room, fine
        "megatron_offgrpo/model/__init__.py": "from megatron_offgrpo.model._arch import QwenArch\n",
        "megatron_offgrpo/rollout/__init__.py": "",
        "megatron_offgrpo/rollout/_a.py": "import megatron_offgrpo.model\n",
        "megatron_offgrpo/rollout/_b.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from checkpoint_tools._io import HF_INDEX\n"
            "def g():\n    from checkpoint_tools import _mapping\n    from megatron_offgrpo.model import __doc__\n"
        ),
        "checkpoint_tools/__init__.py": "from megatron_offgrpo.model import QwenArch\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    private, edges, model_imports = scan(tmp_path)
    assert [p.split(" ", 1)[1] for p in private] == [
        "megatron_offgrpo.rollout -> checkpoint_tools._io.HF_INDEX",
        "megatron_offgrpo.rollout -> checkpoint_tools._mapping",
    ]
    assert cycles(edges) == [["megatron_offgrpo.config", "megatron_offgrpo.train"]]
    assert [m.split(":")[0] for m in model_imports] == [
        "megatron_offgrpo/rollout/_a.py",
        "megatron_offgrpo/rollout/_b.py",
    ]
