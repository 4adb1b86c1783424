"""Reading a YAML config and applying dotted ``key=value`` overrides; turning validation errors into messages that
name the key path and the fix."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from hybridflow.errors import ConfigError
from hybridflow.yaml12 import load_yaml

__all__ = ["apply_overrides", "read_yaml_mapping", "explain_errors"]


def _format_location(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc if not str(part).startswith("function-")) or "(top level)"


def explain_errors(errors: list[Any]) -> str:
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
            lines.append(f"{key}: unknown key (given {given!r}). Fix: remove it or check its spelling.")
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
