"""How ``load_config`` reads its inputs: a YAML recipe and ``key=value`` overrides, each value coerced to its field's
declared type, each unknown key or bad value a ``ConfigError`` naming the key.

It works on any tree of dataclasses and imports nothing of ours (``config.py`` imports it and re-exports
``ConfigError`` and ``parse_override``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A recipe or override names an unknown key or a value of the wrong type."""


NAME_MAX = 255
"""Bytes of one path component on every filesystem a run is likely to read or write (ext4, xfs, NFS, Lustre)."""


def long_component(path: str | Path) -> str | None:
    """Why ``path`` cannot name a file: a component over ``NAME_MAX`` bytes (``stat`` would raise ``OSError: File name
    too long`` from deep inside whatever reads it first), or None."""
    long = next((part for part in Path(path).parts if len(part.encode()) > NAME_MAX), None)
    if long is None:
        return None
    return f"the component {long[:40]}... is {len(long.encode())} bytes, over the {NAME_MAX} a file name may have"


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field's declared type, naming the key on failure."""
    text = str(annotation)  # a string: annotations are not evaluated (`from __future__ import annotations`)
    optional = "None" in text
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if not optional:
            raise ConfigError(f"{key}: null is not allowed (type {text})")
        return None
    base = text.replace("| None", "").replace("None |", "").strip()
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if base == "float":
            return float(value)
        if base == "str":
            return str(value)
        if base.startswith("list"):
            if isinstance(value, str):  # "a,b" on a command line
                value = [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, (dict, bool, int, float)):
                raise ValueError(value)
            return [str(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected {base}") from None
    return value


def apply_values(section: Any, values: dict[str, Any], prefix: str) -> None:
    """Set ``values`` (a nested mapping, as in a recipe) on the dataclass ``section`` and its sub-sections, in place.

    Raises:
        ConfigError: an unknown key (listing the valid ones), a section given a scalar, or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(section)}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key {key!r}; valid keys here: {sorted(fields)}")
        current = getattr(section, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is a section; "
                                  f"give its keys ({sorted(f.name for f in dataclasses.fields(current))})")
            apply_values(current, value, key + ".")
        else:
            setattr(section, name, coerce(value, fields[name].type, key))


def parse_override(text: str) -> dict[str, Any]:
    """``"rollout.group_size=8"`` -> ``{"rollout": {"group_size": "8"}}`` (YAML scalars: 8, true, null, 1e-6)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. rollout.refresh_every=4)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"override {text!r}: the value is not a YAML scalar or list (quote it)") from None
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


class _DuplicateKey(yaml.YAMLError):
    """A mapping names one key twice; carries the key and both lines (1-based) for ``read_recipe``'s message."""

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"duplicated key {key!r}")
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping, at any depth.

    Plain ``safe_load`` keeps the last value silently: a trailing ``train: {steps: 3}`` replaced a recipe's whole
    ``train`` section (its ``out_dir`` fell back to the default). Keys brought in by a YAML merge (``<<: *base``) may
    still be overridden: that is what a merge is for, and the check runs before merges are flattened.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, line, seen[key])
            except TypeError:  # an unhashable key: the base class reports it with its own message
                continue
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The sections of the YAML recipe at ``path`` (an empty file: none).

    Raises:
        FileNotFoundError: no such file. ConfigError: not YAML, a key given twice in one mapping, or not a mapping
            of sections.
    """
    path = Path(path)
    if (long := long_component(path)) is not None:  # before is_file(): it would raise
        raise ConfigError(f"config recipe {path}: {long}: give a shorter --config path")
    if not path.is_file():
        raise FileNotFoundError(f"config recipe {path} not found")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}  # a SafeLoader subclass: as safe
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: line {exc.line}: key {exc.key!r} is given twice (first at line "
                          f"{exc.first_line}); the later one would silently replace the first: merge them") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    return data
