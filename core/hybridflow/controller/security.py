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

__all__ = ["LOOPBACK_ENV", "check_remote_address", "is_loopback", "token_auth_requested"]

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


def token_auth_requested() -> bool:
    """True when this process will authenticate to Ray with a token (``RAY_AUTH_MODE=token``).

    Ray (≥ 2.5x) never turns token authentication on by itself for an explicit ``address``: a driver that joins
    ``host:port`` sends no token unless ``RAY_AUTH_MODE=token`` is set, whatever the cluster does.
    """
    return os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token"


def check_remote_address(address: str, *, allow_without_auth: bool) -> None:
    """Refuse to join a non-loopback cluster without Ray's token authentication, unless allowed."""
    if is_loopback(address) or token_auth_requested():
        return
    if not allow_without_auth:
        mode = os.environ.get("RAY_AUTH_MODE")
        raise ConfigError(
            f"ray.address={address!r} is not on this machine and Ray token authentication is off for this driver "
            f"(RAY_AUTH_MODE={mode!r}; Ray enables it for an explicit address only with RAY_AUTH_MODE=token): anyone "
            "who can reach that cluster could run code in it. Expected RAY_AUTH_MODE=token with the cluster's token "
            "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), or an explicit "
            "ray.allow_remote_without_auth=true."
        )
    warnings.warn(f"joining Ray cluster {address} WITHOUT authentication (ray.allow_remote_without_auth=true)",
                  stacklevel=2)
