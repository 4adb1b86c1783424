"""``ray.address``: ``hybridflow train`` joins a Ray cluster started beforehand instead of starting its own.

A real Ray head is started on loopback (``ray start --head --block``, token authentication on, its own temp dir
and ports) in a fresh session, and killed with its process group afterwards; nothing else on the machine is touched.
"""

from __future__ import annotations

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arithmetic.yaml"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return int(handle.getsockname()[1])


@dataclass(frozen=True)
class RayHead:
    port: int
    temp_dir: Path
    env: dict[str, str]  # what a driver needs to join it (the token)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the head's process group (ray start --block stops its raylet and GCS), SIGKILL what lingers."""
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
        while time.time() < deadline:  # children (gcs_server, raylet) share the group; wait until none is left
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    temp_dir = Path(tempfile.mkdtemp(prefix="hf-head-", dir="/tmp"))  # short: Ray's socket paths must stay < 108
    port = free_port()
    token_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**os.environ, **token_env, "RAY_USAGE_STATS_ENABLED": "0"}
    command = [str(BIN / "ray"), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
               "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(temp_dir),
               "--ray-client-server-port", str(free_port()), "--dashboard-port", str(free_port()),
               "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]
    log = (temp_dir / "ray-start.log").open("wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not list(temp_dir.glob("session_*/logs/raylet.out")) or not _accepts(port):
            if process.poll() is not None or time.time() > deadline:
                pytest.fail(f"ray start --head did not come up: {(temp_dir / 'ray-start.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield RayHead(port=port, temp_dir=temp_dir, env=token_env)
    finally:
        _stop(process)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.mark.slow  # ~30 s: a Ray head and a 2-step CLI run
def test_train_joins_the_cluster_named_by_ray_address(tmp_path: Path, ray_head: RayHead) -> None:
    run_dir = tmp_path / "run"
    command = [str(BIN / "hybridflow"), "train", str(EXAMPLE), f"ray.address={ray_head.address}",
               "trainer.total_steps=2", "trainer.checkpoint_every=0", f"trainer.run_dir={run_dir}",
               "trainer.tensorboard=false", "trainer.resume=never", "--no-progress"]
    result = subprocess.run(command, check=False, env={**os.environ, **ray_head.env}, capture_output=True, text=True,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "done: 2 steps" in result.stdout

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["ray"]["address"] == ray_head.address
    assert manifest["ray"]["gcs_address"] == ray_head.address  # the started head's GCS, not a new local Ray
    # the run's driver and its worker actors logged into the head's own session directory
    logs = next(ray_head.temp_dir.glob("session_*/logs"))
    assert list(logs.glob("python-core-driver-*.log")), sorted(p.name for p in logs.iterdir())
    worker_logs = [p for p in logs.glob("worker-*.err") if "WorkerHost" in p.read_text(errors="replace")]
    assert len(worker_logs) >= 2, sorted(p.name for p in logs.iterdir())


@pytest.mark.slow  # Ray retries the connection for ~20 s before giving up
def test_joining_without_the_token_is_a_config_error_that_says_how(ray_head: RayHead) -> None:
    code = ("import sys; from hybridflow.controller import init_ray\n"
            f"init_ray({ray_head.address!r})\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    result = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "ConfigError" in result.stderr and "RAY_AUTH_MODE=token" in result.stderr, result.stderr[-3000:]
