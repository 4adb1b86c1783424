"""Security defaults: local Ray on loopback, documented code execution of ``module:function`` reward functions, no
remote cluster without authentication. (Checkpoints that load no code: test_checkpoint_loads_no_code.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_local_ray_binds_to_loopback() -> None:
    import ray

    assert ray.is_initialized()
    assert {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]} == {"127.0.0.1"}


def test_local_ray_services_listen_on_loopback_only() -> None:
    """Ray's own processes (GCS, raylet, agents) listen on loopback only. Worker processes are left out: rank 0 of a
    worker group hosts torch.distributed's rendezvous store, which torch binds to every interface whatever host it is
    given (documented in docs/guide/operations.md)."""
    import ipaddress

    import psutil
    import ray

    assert ray.is_initialized()
    services = ("gcs_server", "raylet", "dashboard", "runtime_env", "log_monitor", "monitor.py")

    def describe(process: psutil.Process) -> str:
        try:
            return " ".join([process.name(), *process.cmdline()])
        except psutil.Error:  # exited or a zombie since it was listed
            return ""

    service_processes = {p.pid: describe(p) for p in psutil.Process().children(recursive=True)}
    children = {pid for pid, text in service_processes.items() if any(name in text for name in services)}
    names = {service_processes[pid].split(" ", 1)[0] for pid in children}
    assert {"gcs_server", "raylet"} <= names, names
    listening = [c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.pid in children]
    assert listening, "no listening Ray socket found among this process's children"
    addresses = {c.laddr.ip.removeprefix("::ffff:") for c in listening}
    assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses


def test_docs_say_module_function_rewards_execute_code() -> None:
    text = (ROOT / "docs" / "guide" / "operations.md").read_text()
    assert "`module:function` or `path/to/file.py:function` execute code" in text
    from hybridflow import rewards

    assert "imports and runs user code" in (rewards.__doc__ or "")


def test_joining_a_remote_cluster_without_auth_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.controller.security import check_remote_address
    from hybridflow.errors import ConfigError

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ConfigError, match="allow_remote_without_auth"):
        check_remote_address("203.0.113.7:6379", allow_without_auth=False)
    check_remote_address("127.0.0.1:6379", allow_without_auth=False)  # loopback is fine
    with pytest.warns(UserWarning, match="WITHOUT authentication"):
        check_remote_address("203.0.113.7:6379", allow_without_auth=True)
    monkeypatch.delenv("RAY_AUTH_MODE")  # unset: Ray sends no token to an explicit address, so still refused
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE=token"):
        check_remote_address("203.0.113.7:6379", allow_without_auth=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    check_remote_address("203.0.113.7:6379", allow_without_auth=False)  # token auth on: allowed


def test_init_ray_refuses_a_remote_cluster_without_auth() -> None:
    """The call ``Trainer.start`` makes for ``ray.address`` checks authentication before joining (fresh process)."""
    code = (
        "from hybridflow.controller import init_ray\n"
        "from hybridflow.errors import ConfigError\n"
        "try:\n"
        "    init_ray('203.0.113.7:6379', allow_remote_without_auth=False)\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            check=False)
    assert "refused:" in result.stdout and "allow_remote_without_auth" in result.stdout, result.stderr[-2000:]
