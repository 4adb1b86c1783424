"""Reading a YAML config and applying dotted ``key=value`` overrides; turning validation errors into messages that
name the key path and the fix."""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from hybridflow.errors import ConfigError
from hybridflow.yaml12 import load_yaml

__all__ = ["apply_overrides", "read_yaml_mapping", "explain_errors"]


def _format_location(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc if not str(part).startswith("function-")) or "(top level)"


def _section_at(root: type[BaseModel], path: Sequence[Any]) -> type[BaseModel] | None:
    """The section model ``path`` (a validation error's location without its last key) leads to from ``root``;
    through optional sections and dicts / lists of sections (``resource_pools.main``). None where it is no section."""
    node: Any = root
    parts = [str(part) for part in path if not str(part).startswith("function-")]
    while True:
        origin = typing.get_origin(node)
        if origin is typing.Union or origin is types.UnionType:
            sections = [arg for arg in typing.get_args(node) if isinstance(arg, type) and issubclass(arg, BaseModel)]
            if len(sections) != 1:
                return None
            node = sections[0]
        elif origin is dict or origin is list:
            if not parts:
                return None
            parts.pop(0)  # the dict's key or the list's index
            node = typing.get_args(node)[-1]
        elif isinstance(node, type) and issubclass(node, BaseModel):
            if not parts:
                return node
            field = node.model_fields.get(parts.pop(0))
            if field is None:
                return None
            node = field.annotation
        else:
            return None


def _unknown_key(root: type[BaseModel] | None, loc: tuple[Any, ...], given: Any) -> str:
    """``Unknown config key "trainer.total_stepz"`` with the nearest key of that section, or the keys it takes."""
    key = _format_location(loc)
    section = _section_at(root, loc[:-1]) if root is not None and loc else None
    if section is None:
        return f'Unknown config key "{key}" (given {given!r}). Fix: remove it or check its spelling.'
    parent = _format_location(loc[:-1])
    prefix = f"{parent}." if parent != "(top level)" else ""
    known = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return (f'Unknown config key "{key}" (given {given!r}). Did you mean "{prefix}{close[0]}"? '
                f"Fix: rename it to {prefix}{close[0]}, or remove it.")
    where = parent if prefix else "the top level"
    return (f'Unknown config key "{key}" (given {given!r}); {where} takes: {", ".join(known)}. '
            "Fix: remove it or check its spelling.")


def explain_errors(errors: list[Any], root: type[BaseModel] | None = None) -> str:
    """One line per validation error naming its key path, what was wrong and the fix; an unknown key gets the
    nearest known key of its section (from ``root``, the validated model)."""
    lines = []
    for error in errors:
        key = _format_location(tuple(error["loc"]))
        given = error.get("input")
        kind = error["type"]
        if kind == "rejected_key":
            context = error.get("ctx") or {}
            where = f"{key}.{context.get('key')}" if key != "(top level)" else str(context.get("key"))
            lines.append(f"{where}: {error['msg']}.")
        elif kind == "extra_forbidden":
            lines.append(_unknown_key(root, tuple(error["loc"]), given))
        elif kind == "missing":
            lines.append(f"{key}: required but missing. Fix: set {key} in the YAML or as {key}=VALUE.")
        elif kind == "value_error" and isinstance(given, dict):
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{key if key != '(top level)' else 'config'}: {message}.")
        else:
            lines.append(f"{key}: {error['msg']}; given {given!r}. Fix: set {key} to a valid value.")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _parse_scalar(text: str) -> Any:
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML, numbers by YAML 1.2 rules) to a nested dict copy."""
    result = copy.deepcopy(data)
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f'override "{override}" is not of the form dotted.key=value (e.g. actor.optim.lr=1e-4)')
        key, _, raw = override.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f'override "{override}" has an empty key')
        node = result
        for index, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[:index + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_scalar(raw)
    return result


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """The mapping a YAML config file holds (numbers by YAML 1.2 rules; an empty file is ``{}``).

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping at the top level.
    """
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(loaded).__name__}")
    return loaded or {}
