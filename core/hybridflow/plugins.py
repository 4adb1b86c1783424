"""Plugin loading: a pluggy PluginManager over the ``hybridflow`` entry-point group, filling the registries.

Nothing here runs at ``import hybridflow``; :func:`load_plugins` is called explicitly by the CLI, the trainer
and each worker process. It knows nothing about any particular plugin. Entry points are read with the standard
library's ``importlib.metadata`` (as pluggy's ``load_setuptools_entrypoints`` does; the ``entrypoints`` package is
maintenance-only upstream and points to it), and each module is registered with pluggy here so that a failure
stays one plugin's :class:`PluginLoadError` and disabled plugins are never imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import os
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from hybridflow import hookspecs, registries
from hybridflow.errors import PluginLoadError, PluginValidationError

__all__ = [
    "ENTRY_POINT_GROUP",
    "DISABLE_ENV",
    "PluginInfo",
    "get_plugin_manager",
    "load_plugins",
    "register_plugin",
    "plugin_infos",
    "disabled_plugins",
]

ENTRY_POINT_GROUP = "hybridflow"
DISABLE_ENV = "HYBRIDFLOW_DISABLE_PLUGINS"
CORE_OWNER = "hybridflow (core)"
#: the core's own hook implementations, registered before any plugin
CORE_PLUGIN_MODULES = ("hybridflow.builtins", "hybridflow.rewards", "hybridflow.genrm", "hybridflow.algorithms.drivers")


@dataclass(slots=True)
class PluginInfo:
    """What ``hybridflow plugins`` shows for one plugin."""

    name: str
    distribution: str
    version: str
    entry_point: str
    registered: dict[str, list[str]] = field(default_factory=dict)
    capabilities: dict[str, str] = field(default_factory=dict)
    error: PluginLoadError | None = None
    disabled: bool = False


class _OwnedRegistry:
    """A registry view that stamps every registration with the plugin that made it."""

    def __init__(self, registry: Any, owner: str) -> None:
        self._registry = registry
        self._owner = owner

    def register(self, name: str, item: Any, *, owner: str | None = None, replace: bool = False,
                 info: object | None = None) -> Any:
        return self._registry.register(name, item, owner=owner or self._owner, replace=replace, info=info)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._registry, attribute)


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_infos: dict[str, PluginInfo] = {}
_entry_points_loaded = False


def disabled_plugins() -> set[str]:
    """Names listed in ``HYBRIDFLOW_DISABLE_PLUGINS`` (comma separated)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager with hybridflow's hookspecs and the core's built-in registrations."""
    global _manager
    with _lock:
        if _manager is None:
            manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            manager.add_hookspecs(hookspecs)
            _manager = manager
            for module_name in CORE_PLUGIN_MODULES:
                module = importlib.import_module(module_name)
                _register_module(manager, module, name=module_name, owner=CORE_OWNER)
        return _manager


def _register_module(
    manager: pluggy.PluginManager, module: ModuleType, *, name: str, owner: str
) -> dict[str, list[str]]:
    """Register a hook module with pluggy (validating it) and let it fill the registries as ``owner``.

    Registration hooks are historic, so each plugin's implementation is called once, when that plugin is
    registered, with a registry view that stamps ``owner`` on what it adds (duplicate errors name both owners).
    """
    try:
        manager.register(module, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginValidationError(f'Plugin "{name}" ({owner}) is invalid: {exc}') from exc
    registered: dict[str, list[str]] = {}
    for hook_name, registry in registries.ALL.items():
        implementations = [
            impl for impl in getattr(manager.hook, hook_name).get_hookimpls() if impl.plugin_name == name
        ]
        if not implementations:
            continue
        before = set(registry.names())
        for impl in implementations:
            impl.function(registry=_OwnedRegistry(registry, owner))
        added = sorted(set(registry.names()) - before)
        if added:
            registered[registry.kind] = added
    return registered


def register_plugin(module: ModuleType, *, name: str, owner: str | None = None) -> PluginInfo:
    """Register a plugin module from code (tests, notebooks) exactly as an entry point would be."""
    manager = get_plugin_manager()
    with _lock:
        owner = owner or name
        info = PluginInfo(name=name, distribution=owner, version="(in code)", entry_point=module.__name__)
        info.registered = _register_module(manager, module, name=name, owner=owner)
        info.capabilities = _capabilities(module)
        _infos[name] = info
        manager.check_pending()
        return info


def load_plugins(*, strict: bool = True) -> list[PluginInfo]:
    """Load every ``hybridflow`` entry point once, fill the registries and return what each plugin did.

    With ``strict=True`` (the default) the first plugin that fails to import raises :class:`PluginLoadError`;
    with ``strict=False`` failures are recorded on the returned :class:`PluginInfo` (``hybridflow plugins``).
    Plugins named in ``HYBRIDFLOW_DISABLE_PLUGINS`` are listed as disabled and not imported.
    """
    global _entry_points_loaded
    manager = get_plugin_manager()
    with _lock:
        if not _entry_points_loaded:
            _entry_points_loaded = True
            disabled = disabled_plugins()
            for entry_point in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
                _load_entry_point(manager, entry_point, disabled)
            manager.check_pending()
        infos = list(_infos.values())
    if strict:
        for info in infos:
            if info.error is not None:
                raise info.error
    return infos


def _load_entry_point(manager: pluggy.PluginManager, entry_point: Any, disabled: set[str]) -> None:
    distribution = entry_point.dist.metadata["Name"] if entry_point.dist is not None else "(unknown)"
    version = entry_point.dist.version if entry_point.dist is not None else "?"
    info = PluginInfo(name=entry_point.name, distribution=distribution, version=version, entry_point=entry_point.value)
    _infos[entry_point.name] = info
    if entry_point.name in disabled:
        info.disabled = True
        return
    if manager.get_plugin(entry_point.name) is not None:
        return
    try:
        module = entry_point.load()
        info.registered = _register_module(manager, module, name=entry_point.name, owner=distribution)
        info.capabilities = _capabilities(module)
    except PluginValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import failure becomes a typed, explained error
        extra = _extra_hint(entry_point)
        fix = (
            f'Install: pip install "{distribution}{extra}"; or skip it: {DISABLE_ENV}={entry_point.name}.'
        )
        info.error = PluginLoadError(
            plugin=entry_point.name,
            distribution=distribution,
            version=version,
            entry_point=entry_point.value,
            cause=exc,
            fix=fix,
        )
        info.error.__cause__ = exc


def _extra_hint(entry_point: Any) -> str:
    dist = entry_point.dist
    if dist is None:
        return ""
    extras = dist.metadata.get_all("Provides-Extra") or []
    return f"[{extras[0]}]" if extras else ""


def _capabilities(module: ModuleType) -> dict[str, str]:
    report = getattr(module, "hybridflow_report_capabilities", None)
    if report is None:
        return {}
    return dict(report() or {})


def plugin_infos() -> list[PluginInfo]:
    """Plugins seen so far (without loading anything new)."""
    with _lock:
        return list(_infos.values())


def _reset_for_tests() -> None:
    """Forget loaded plugins and empty the registries (tests only)."""
    global _manager, _entry_points_loaded
    with _lock:
        _manager = None
        _entry_points_loaded = False
        _infos.clear()
        for registry in registries.ALL.values():
            for name in registry.names():
                registry.unregister(name)
