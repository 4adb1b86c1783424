"""Real Ray clusters on loopback for tests: a head (``ray start --head --block``) and extra raylets
(``ray start --address --block``), each in its own session (process group), temp dir and ports its own processes
bind (port 0, see :func:`_port_flags`), with token authentication on. Stopping kills exactly those process groups;
nothing else on the machine is touched (never a global ``ray stop``: other Ray clusters may run on the same box).

Used by ``tests/e2e/test_multinode.py`` and ``bench/multinode.py`` (the same cluster, the same steps as
docs/guide/operations.md §9 lists for real machines).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hybridflow.controller.security import LOOPBACK_ENV

BIN = Path(sys.executable).parent

#: faster node-death detection than Ray's defaults (~15 s), so a killed raylet is noticed within a few seconds
FAST_FAILURE_DETECTION = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                          "RAY_health_check_failure_threshold": "4"}


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (``ray start --block`` stops its raylet/GCS), SIGKILL what lingers."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.time() + wait_s
        while time.time() < deadline:  # children (gcs_server, raylet, workers) share the group; wait until none left
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def kill_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the whole group at once (a machine dying: raylet, object store and workers gone, no goodbye)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait(timeout=10.0)
    deadline = time.time() + 10.0
    while time.time() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def _port_flags(head: bool) -> list[str]:
    """Port 0 for every port Ray would otherwise take at a fixed default (6379, 52365, 8265...) that another cluster
    on this box would then share: each component binds a free port itself and keeps it (the GCS, raylet, object
    manager, dashboard agent, runtime-env agent, metrics exporter and the head's API server take 0 and report the port
    they got). A number picked here (bind 0, close, pass it on) could be taken by another process, e.g. another
    cluster's under pytest-xdist, before Ray bound it.

    The one exception is the head's Ray client server (``ray://``): ``ray start`` refuses 0 for it and would
    otherwise take 10001 on every head. It gets a number picked here, which can race; :func:`start_head` starts the
    head again with a new one when its client server did not get it."""
    flags = ["--node-manager-port", "0", "--object-manager-port", "0", "--dashboard-agent-listen-port", "0",
             "--dashboard-agent-grpc-port", "0", "--runtime-env-agent-port", "0", "--metrics-export-port", "0"]
    if head:
        flags += ["--port", "0", "--dashboard-port", "0", "--ray-client-server-port", str(_unused_port())]
    return flags


def _unused_port() -> int:
    """A port free now (bound and released): only for the Ray client server, see :func:`_port_flags`."""
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return int(handle.getsockname()[1])


def _client_server_listening(node: RayNode, timeout_s: float) -> bool:
    """Whether the head's Ray client server listens on the port it was given: a process of the head's group owns a
    listening socket on it (a connection alone could reach another process that took the port). False once the head
    exits: ``ray start --block`` stops the whole head when its client server fails to bind ("address in use")."""
    import psutil

    deadline = time.time() + timeout_s
    while node.process.poll() is None and time.time() < deadline:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == node.client_server_port \
                    and conn.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    if os.getpgid(conn.pid) == node.process.pid:
                        return True
        time.sleep(0.5)
    return False


def _gcs_port(node: RayNode, timeout_s: float = 30.0) -> int:
    """The port the head's GCS bound (``--port 0``), from the address ``ray start`` writes to its temp dir's
    ``ray_current_cluster`` once the GCS is up."""
    address_file = node.temp_dir / "ray_current_cluster"
    deadline = time.time() + timeout_s
    while not address_file.exists() or not address_file.read_text().strip():
        if node.process.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"ray start --head wrote no GCS address to {address_file} within {timeout_s}s: "
                               f"{node.log_tail()}")
        time.sleep(0.2)
    return int(address_file.read_text().strip().rpartition(":")[2])


@dataclass
class RayNode:
    """One ``ray start --block`` process group."""

    process: subprocess.Popen[bytes]
    temp_dir: Path
    log: IO[bytes]
    resources: dict[str, float] = field(default_factory=dict)
    client_server_port: int = 0  #: the head's Ray client server port (see _port_flags); 0 on other nodes
    node_id: str = ""  #: its Ray node id, once it registered with the GCS
    address: str = ""  #: its ``NodeManagerAddress`` as registered (``ray start`` may turn 127.0.0.1 into another)

    def log_tail(self, full: bool = False) -> str:
        self.log.flush()
        text = (self.temp_dir / "ray-start.log").read_text(errors="replace")
        return text if full else text[-3000:]

    def stop(self) -> None:
        """Stop the node's process group and remove its temp dir."""
        stop_process_group(self.process)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    @property
    def session_logs(self) -> Path:
        return next(self.temp_dir.glob("session_*/logs"))


@dataclass
class LoopbackCluster:
    """A Ray head on 127.0.0.1 plus any raylets added; ``env`` is what a driver needs to join (the token)."""

    port: int
    env: dict[str, str]
    head: RayNode
    token_dir: Path
    workers: list[RayNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def driver_env(self) -> dict[str, str]:
        """This process's environment with the cluster's token settings (any other RAY_AUTH_* dropped)."""
        return {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}, **self.env}

    def add_node(self, *, num_cpus: int = 2, resources: dict[str, float] | None = None,
                 object_store_bytes: int = 100_000_000, timeout_s: float = 120.0) -> RayNode:
        """``ray start --address HEAD`` as a second raylet in its own process group; returns once it joined."""
        known = {node.node_id for node in [self.head, *self.workers]}  # a node just killed may still read as alive
        node = _start_until_up(lambda: _start_node(["--address", self.address], self.env, num_cpus=num_cpus,
                                                   resources=resources or {}, object_store_bytes=object_store_bytes,
                                                   head=False), what="ray start --address", timeout_s=timeout_s)
        try:
            _await_registration(self, node, known, timeout_s)
        except RuntimeError:
            node.stop()
            raise
        self.workers.append(node)
        return node

    def nodes(self, timeout_s: float = 180.0) -> list[dict[str, Any]]:
        """The cluster's nodes as the GCS lists them (``NodeID``, ``Alive``, ``Resources``, ``NodeManagerAddress``,
        as ``ray.nodes()`` names them), read by a short-lived process with a bare GCS client (this process may have
        its own Ray; a client is ~2x cheaper than a ``ray.init`` driver, which registers a job)."""
        code = (f"import json\nfrom ray._raylet import GcsClient\n"
                f"infos = GcsClient(address={self.address!r}).get_all_node_info(timeout=60).values()\n"
                "print('NODES=' + json.dumps([{'NodeID': i.node_id.hex(), 'Alive': i.state == 0, "
                "'Resources': dict(i.resources_total), 'NodeManagerAddress': i.node_manager_address} "
                "for i in infos]))")
        try:
            result = subprocess.run([sys.executable, "-c", code], env=self.driver_env(), capture_output=True,
                                    text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"could not list the cluster's nodes within {timeout_s}s: {exc.stderr!r:.3000}") from exc
        for line in result.stdout.splitlines():
            if line.startswith("NODES="):
                nodes: list[dict[str, Any]] = json.loads(line[len("NODES="):])
                return nodes
        raise RuntimeError(f"could not list the cluster's nodes: {result.stderr[-3000:]}")

    def alive_nodes(self) -> list[dict[str, Any]]:
        return [node for node in self.nodes() if node["Alive"]]

    def stop(self) -> None:
        for node in [*self.workers, self.head]:
            node.stop()
        shutil.rmtree(self.token_dir, ignore_errors=True)


def _await_registration(cluster: LoopbackCluster, node: RayNode, known: set[str], timeout_s: float) -> None:
    """Until the GCS lists a live node not in ``known`` (``node``, started last): records its id and address."""
    deadline = time.time() + timeout_s
    while True:
        new = [n for n in cluster.alive_nodes() if n["NodeID"] not in known]
        if new:
            node.node_id, node.address = str(new[0]["NodeID"]), str(new[0]["NodeManagerAddress"])
            return
        if node.process.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"ray start did not register its node with the GCS: {node.log_tail()}")
        time.sleep(1.0)


def _start_node(join: list[str], token_env: dict[str, str], *, num_cpus: int, resources: dict[str, float],
                object_store_bytes: int, head: bool, extra_env: dict[str, str] | None = None) -> RayNode:
    temp_dir = Path(tempfile.mkdtemp(prefix="hf-ray-", dir="/tmp"))  # short: Ray's socket paths must stay < 108
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    env = {**inherited, **token_env, "RAY_USAGE_STATS_ENABLED": "0", **(extra_env or {})}
    # hybridflow.controller (imported by the tests' conftest) sets this to 0 so a local Ray stays on loopback; a
    # `ray start` inheriting it would refuse to join as a second node ("not supported on Windows and OSX")
    env.pop(LOOPBACK_ENV, None)
    command = [str(BIN / "ray"), "start", *join, "--block", "--node-ip-address", "127.0.0.1", "--num-cpus",
               str(num_cpus), "--object-store-memory", str(object_store_bytes), "--disable-usage-stats",
               "--temp-dir", str(temp_dir), *(ports := _port_flags(head))]
    if head:
        command.append("--include-dashboard=false")
    if resources:
        command += ["--resources", json.dumps(resources)]
    log = (temp_dir / "ray-start.log").open("wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client_port = int(ports[ports.index("--ray-client-server-port") + 1]) if head else 0
    return RayNode(process=process, temp_dir=temp_dir, log=log, resources=dict(resources),
                   client_server_port=client_port)


#: what ``ray start --block`` prints once its node is up and registered with the GCS
STARTED = "Ray runtime started."


def _start_until_up(start: Callable[[], RayNode], *, what: str, timeout_s: float, attempts: int = 3) -> RayNode:
    """``start()`` a node and wait for :data:`STARTED`; a start that exits first is tried again (``attempts`` in
    all): on a loaded box ``ray start`` gives up by itself when its dashboard agent takes over 15 s to start (the
    raylet's fixed wait for the agent's port file; seen at load 15-25 on 2 cores) or its raylet over 30 s to
    register with the GCS."""
    failures = []
    for _ in range(attempts):
        node = start()
        deadline = time.time() + timeout_s
        while STARTED not in node.log_tail(full=True):
            if node.process.poll() is not None or time.time() > deadline:
                failures.append(node.log_tail())
                node.stop()
                break
            time.sleep(0.5)
        else:
            return node
    raise RuntimeError(f"{what} did not come up ({attempts} tries): " + "\n---\n".join(failures))


#: heads started at most while their Ray client server's port was taken by another process (see start_head)
CLIENT_PORT_TRIES = 3


def start_head(*, num_cpus: int = 2, resources: dict[str, float] | None = None,
               object_store_bytes: int = 200_000_000, extra_env: dict[str, str] | None = None,
               timeout_s: float = 90.0) -> LoopbackCluster:
    """``ray start --head`` on loopback with token authentication; stop it with ``.stop()``.

    The token is a fresh one in a file of its own (``RAY_AUTH_TOKEN_PATH``, what a real cluster copies to every
    machine, see docs/guide/operations.md); the head, every added node and every driver get ``RAY_AUTH_MODE=token`` and
    that path.
    """
    token_dir = Path(tempfile.mkdtemp(prefix="hf-token-", dir="/tmp"))
    token_file = token_dir / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    token_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    # The Ray client server's port is the one number picked before Ray binds it (_port_flags): when another process
    # took it meanwhile, the client server fails to bind ("address in use") and `ray start --block` stops the whole
    # head, before or after it printed STARTED. Such a head is started again with a new number, CLIENT_PORT_TRIES
    # times at most (each try also gets _start_until_up's own tries); every other port is bound by Ray itself.
    failures: list[str] = []
    try:
        for _ in range(CLIENT_PORT_TRIES):
            node = _start_until_up(lambda: _start_node(["--head"], token_env, num_cpus=num_cpus,
                                                       resources=resources or {},
                                                       object_store_bytes=object_store_bytes, head=True,
                                                       extra_env=extra_env),
                                   what="ray start --head", timeout_s=timeout_s)
            if _client_server_listening(node, timeout_s=30.0):
                break
            failures.append(f"its Ray client server did not listen on port {node.client_server_port}: "
                            f"{node.log_tail()}")
            node.stop()
        else:
            raise RuntimeError(f"ray start --head did not come up ({CLIENT_PORT_TRIES} tries): " +
                               "\n---\n".join(failures))
    except RuntimeError:
        shutil.rmtree(token_dir, ignore_errors=True)
        raise
    try:
        port = _gcs_port(node)
    except RuntimeError:
        node.stop()
        shutil.rmtree(token_dir, ignore_errors=True)
        raise
    cluster = LoopbackCluster(port=port, env=token_env, head=node, token_dir=token_dir)
    try:
        if not accepts(port):
            raise RuntimeError(f"ray start --head came up without its GCS port {port} accepting: {node.log_tail()}")
        _await_registration(cluster, node, set(), timeout_s)
    except RuntimeError:
        cluster.stop()
        raise
    return cluster
