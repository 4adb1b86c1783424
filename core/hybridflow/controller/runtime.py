"""Starting (or joining) Ray: local by default, bound to loopback, no dashboard, object store capped.

It leaves placement (resource pools) and actors (worker groups) to the rest of the controller.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from hybridflow.controller import park
from hybridflow.controller.security import check_remote_address
from hybridflow.errors import ConfigError

__all__ = ["init_ray", "shutdown_ray", "is_local_ray", "DEFAULT_OBJECT_STORE_BYTES"]

#: object store cap for a local Ray (500 MB): enough for B=8192 × 2 × [1024] columns in flight, small on a laptop
DEFAULT_OBJECT_STORE_BYTES = 500_000_000

_local = False


def is_local_ray() -> bool:
    """True when :func:`init_ray` started a single-machine Ray (workers then rendezvous over 127.0.0.1)."""
    return _local and ray.is_initialized()


def init_ray(
    address: str | None = None,
    num_cpus: float | None = None,
    object_store_memory: int | None = None,
    *,
    num_gpus: int | None = None,
    namespace: str | None = None,
    allow_remote_without_auth: bool = False,
) -> dict[str, Any]:
    """Start a local Ray on 127.0.0.1 (or join ``address``) once per process; return the cluster's resources.

    Idempotent: a second call with Ray already up does nothing. Workers get ``OMP_NUM_THREADS=1`` unless the
    environment sets it. ``address="auto"`` or ``"ray://..."``/``"host:port"`` joins an existing cluster, which is
    how a run outgrows one machine (``ray.address`` in the config). Joining a cluster that is not on this machine
    while Ray's token authentication is off (``RAY_AUTH_MODE=disabled``) raises :class:`ConfigError` unless
    ``allow_remote_without_auth`` (``ray.allow_remote_without_auth`` in the config) is set.
    """
    if ray.is_initialized():
        return dict(ray.cluster_resources())  # type: ignore[no-untyped-call]  # unannotated in ray
    env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "RAY_DEDUP_LOGS": "0"}
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "namespace": namespace,
        "log_to_driver": True,
        "runtime_env": {"env_vars": env_vars},
    }
    if address is None:
        if object_store_memory is not None and object_store_memory <= 0:
            raise ConfigError(f"object_store_memory must be positive bytes, got {object_store_memory}")
        kwargs.update(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_memory or DEFAULT_OBJECT_STORE_BYTES,
            _node_ip_address="127.0.0.1",
        )
    else:
        if num_cpus is not None or num_gpus is not None or object_store_memory is not None:
            raise ConfigError(
                f"init_ray(address={address!r}) joins an existing cluster whose resources are fixed; expected no "
                f"num_cpus/num_gpus/object_store_memory, got {num_cpus}/{num_gpus}/{object_store_memory}. "
                f"Fix: drop them or start a local Ray (address=None)"
            )
        check_remote_address(address, allow_without_auth=allow_remote_without_auth)
        kwargs["address"] = address
    global _local
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        ray.init(**kwargs)
    except ConnectionError as exc:
        if address is None:
            raise
        raise ConfigError(
            f"could not join the Ray cluster at ray.address={address!r}: {exc} ({exc.__cause__ or 'no cause given'})."
            " Expected a running cluster there (`ray start --head --port PORT` on that machine). If it uses token "
            "authentication (`ray start` turns it on when ~/.ray/auth_token exists), set RAY_AUTH_MODE=token and "
            "provide its token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); Ray sends no token to "
            "an explicit address otherwise."
        ) from exc
    _local = address is None
    return dict(ray.cluster_resources())  # type: ignore[no-untyped-call]  # unannotated in ray


def shutdown_ray() -> None:
    """Stop the Ray this process started or joined (no-op when none), with the worker processes parked in it."""
    park.forget_parked()
    if ray.is_initialized():
        ray.shutdown()
