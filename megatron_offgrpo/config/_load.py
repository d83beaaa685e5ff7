"""How ``load_config`` reads its inputs: a YAML recipe and ``key=value`` overrides, each value coerced to its field's
declared type, each unknown key or bad value a ``ConfigError`` naming the key.

It works on any tree of dataclasses and imports nothing of ours (the config room's door re-exports
``ConfigError`` and ``parse_override``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path

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


@functools.cache
def field_types(cls: type) -> dict[str, object]:
    """Field name -> its resolved type (annotations are strings under ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def split_optional(hint: object) -> tuple[object, bool]:
    """``X | None`` -> (X, True); any other type -> (it, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def choices(hint: object) -> tuple[str, ...] | None:
    """The values of a choice key's ``Literal`` type (``X | None`` and ``list[X]`` looked through); None otherwise."""
    base, _ = split_optional(hint)
    if typing.get_origin(base) is list:
        base = typing.get_args(base)[0]
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


def type_name(hint: object) -> str:
    """How docs/config.md writes a type: ``int``, ``str | None``, ``list[str]``, ``"hf" | "random"``."""
    base, optional = split_optional(hint)
    if typing.get_origin(base) is typing.Literal:
        text = " | ".join(f'"{value}"' for value in typing.get_args(base))
    elif typing.get_origin(base) is list:
        text = f"list[{type_name(typing.get_args(base)[0])}]"
    else:
        text = getattr(base, "__name__", str(base))
    return f"{text} | None" if optional else text


_INT_LIMIT = 2**63 - 1


def coerce(value: object, hint: object, key: str) -> object:
    """Convert a YAML/CLI value to the field's type ``hint`` (resolved), naming the key on failure. A choice key's
    value is only made a string here: ``Config.validate`` checks it against the choices with every other rule, so
    that one run of a command reports every error."""
    base, optional = split_optional(hint)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if not optional:
            raise ConfigError(f"{key}: null is not allowed (type {type_name(hint)})")
        return None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            number = int(value)
            if abs(number) > _INT_LIMIT:  # every int key is a count or size; past int64 it only overflows later
                raise ConfigError(f"{key}={value!r}: out of range (at most {_INT_LIMIT})")
            return number
        if base is float:
            return float(value)
        if base is str or typing.get_origin(base) is typing.Literal:
            return str(value)
        if typing.get_origin(base) is list:
            if isinstance(value, str):  # "a,b" on a command line
                value = [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, (dict, bool, int, float)):
                raise ValueError(value)
            return [str(v) for v in value]
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected {type_name(base)}") from None
    return value


def apply_values(section: object, values: dict[str, object], prefix: str,
                 renamed: dict[str, str] | None = None) -> None:
    """Set ``values`` (a nested mapping, as in a recipe) on the dataclass ``section`` and its sub-sections, in place.
    ``renamed``: full keys that were folded into others -> their new spelling, refused with it in one line.

    Raises:
        ConfigError: an unknown key (listing the valid ones; a renamed one: its new spelling), a section given a
            scalar, or a value of the wrong type.
    """
    renamed = renamed or {}
    hints = field_types(type(section))
    for name, value in values.items():
        key = f"{prefix}{name}"
        if key in renamed:
            raise ConfigError(f"{key} is now {renamed[key]}")
        if name not in hints:
            raise ConfigError(f"unknown config key {key!r}; valid keys here: {sorted(hints)}")
        current = getattr(section, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is a section; "
                                  f"give its keys ({sorted(f.name for f in dataclasses.fields(current))})")
            apply_values(current, value, key + ".", renamed)
        else:
            setattr(section, name, coerce(value, hints[name], key))


def parse_override(text: str) -> dict[str, object]:
    """``"rollout.group_size=8"`` -> ``{"rollout": {"group_size": "8"}}`` (YAML scalars: 8, true, null, 1e-6)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. rollout.refresh_every=4)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"override {text!r}: the value is not a YAML scalar or list (quote it)") from None
    out: dict[str, object] = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


class _DuplicateKey(yaml.YAMLError):
    """A mapping names one key twice; carries the key and both lines (1-based) for ``read_recipe``'s message."""

    def __init__(self, key: object, line: int, first_line: int) -> None:
        super().__init__(f"duplicated key {key!r}")
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping, at any depth.

    Plain ``safe_load`` keeps the last value silently: a trailing ``train: {steps: 3}`` replaced a recipe's whole
    ``train`` section (its ``out_dir`` fell back to the default). Keys brought in by a YAML merge (``<<: *base``) may
    still be overridden: that is what a merge is for, and the check runs before merges are flattened.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen: dict[object, int] = {}
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


def read_recipe(path: str | Path) -> dict[str, object]:
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
