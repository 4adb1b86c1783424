"""``hybridflow plugins``: each plugin's name, distribution, version, what it registered, and load errors.

It only reports; loading is :mod:`hybridflow.plugins`.
"""

from __future__ import annotations

import argparse

from hybridflow import registries
from hybridflow.plugins import CORE_OWNER, PluginInfo, load_plugins

__all__ = ["main", "format_plugins"]


def format_plugins(infos: list[PluginInfo]) -> str:
    """Plain-text table of plugins (stable for tests and logs)."""
    lines = [f"{'plugin':<12} {'distribution':<22} {'version':<10} registered"]
    core_registered = {
        registry.kind: registry.by_owner(CORE_OWNER)
        for registry in registries.ALL.values()
        if registry.by_owner(CORE_OWNER)
    }
    rows: list[tuple[str, str, str, str]] = [("(core)", "hybridflow", _core_version(), _describe(core_registered))]
    for info in sorted(infos, key=lambda i: i.name):
        if info.disabled:
            what = "disabled by HYBRIDFLOW_DISABLE_PLUGINS"
        elif info.error is not None:
            what = f"LOAD ERROR: {info.error}"
        else:
            what = _describe(info.registered)
        rows.append((info.name, info.distribution, info.version, what))
        for capability, status in sorted(info.capabilities.items()):
            if capability != "status":
                rows.append(("", "", "", f"  {capability}: {status}"))
            elif not info.registered:
                rows[-1] = (info.name, info.distribution, info.version, status)
    lines += [f"{a:<12} {b:<22} {c:<10} {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def _describe(registered: dict[str, list[str]]) -> str:
    if not registered:
        return "registers nothing yet"
    return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(registered.items()))


def _core_version() -> str:
    from hybridflow import __version__

    return __version__


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow plugins", description="List installed hybridflow plugins.")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any plugin failed to load")
    args = parser.parse_args(argv)
    infos = load_plugins(strict=False)
    print(format_plugins(infos))
    failed = [info for info in infos if info.error is not None]
    if failed:
        print(f"\n{len(failed)} plugin(s) failed to load.", flush=True)
        return 1 if args.strict else 0
    return 0
