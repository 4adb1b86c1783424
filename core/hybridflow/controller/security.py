"""Network defaults for Ray: a local Ray binds its node to loopback; joining a remote cluster without
authentication is refused unless explicitly allowed.

Imported by :mod:`hybridflow.controller` before Ray itself. It decides nothing about placement or workers.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import warnings

from hybridflow.errors import ConfigError

__all__ = ["LOOPBACK_ENV", "check_remote_address", "is_loopback"]

#: Ray uses 127.0.0.1 as the node address when it believes multi-node clusters are off; that variable is read
#: once, when Ray is first imported, so it is set here before any ``import ray`` in this process.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
if "ray" not in sys.modules:
    os.environ.setdefault(LOOPBACK_ENV, "0")


def is_loopback(host: str) -> bool:
    """True if ``host`` (name or IP, optionally ``host:port`` or a ``ray://`` URL) resolves to a loopback address."""
    host = host.removeprefix("ray://").rsplit(":", 1)[0] if ":" in host.removeprefix("ray://") else host
    if host in {"auto", "local"}:
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_remote_address(address: str, *, allow_without_auth: bool) -> None:
    """Refuse to join a non-loopback cluster with Ray's token authentication disabled, unless allowed."""
    if is_loopback(address):
        return
    auth_disabled = os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled"
    if not auth_disabled:
        return
    if not allow_without_auth:
        raise ConfigError(
            f"ray.address={address!r} is not on this machine and Ray authentication is off (RAY_AUTH_MODE=disabled): "
            "anyone who can reach that cluster could run code in it. Expected token authentication (Ray's default; "
            "unset RAY_AUTH_MODE) or an explicit ray.allow_remote_without_auth=true."
        )
    warnings.warn(f"joining Ray cluster {address} WITHOUT authentication (ray.allow_remote_without_auth=true)",
                  stacklevel=2)
