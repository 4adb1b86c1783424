"""``ray.address``: ``hybridflow train`` joins a Ray cluster started beforehand instead of starting its own.

A real Ray head is started on loopback (``ray start --head --block``, token authentication on, its own temp dir
and ports) in a fresh session, and killed with its process group afterwards; nothing else on the machine is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_cluster import BIN, LoopbackCluster, start_head

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arithmetic_scratch.yaml"


@pytest.fixture(scope="module")
def ray_head() -> Iterator[LoopbackCluster]:
    try:
        cluster = start_head(num_cpus=2)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.slow  # ~30 s: a Ray head and a 2-step CLI run
def test_train_joins_the_cluster_named_by_ray_address(tmp_path: Path, ray_head: LoopbackCluster) -> None:
    run_dir = tmp_path / "run"
    command = [str(BIN / "hybridflow"), "train", str(EXAMPLE), f"ray.address={ray_head.address}",
               "trainer.total_steps=2", "trainer.checkpoint_every=0", f"trainer.run_dir={run_dir}",
               "trainer.tensorboard=false", "trainer.resume=never", "--no-progress"]
    result = subprocess.run(command, check=False, env=ray_head.driver_env(), capture_output=True, text=True,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "done: 2 steps" in result.stdout

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["ray"]["address"] == ray_head.address
    assert manifest["ray"]["gcs_address"] == ray_head.address  # the started head's GCS, not a new local Ray
    # the run's driver and its worker actors logged into the head's own session directory
    logs = ray_head.head.session_logs
    assert list(logs.glob("python-core-driver-*.log")), sorted(p.name for p in logs.iterdir())
    worker_logs = [p for p in logs.glob("worker-*.err") if "WorkerHost" in p.read_text(errors="replace")]
    assert len(worker_logs) >= 2, sorted(p.name for p in logs.iterdir())


@pytest.mark.slow  # Ray retries the connection for ~20 s before giving up
def test_joining_without_the_token_is_a_config_error_that_says_how(ray_head: LoopbackCluster) -> None:
    code = ("import sys; from hybridflow.controller import init_ray\n"
            f"init_ray({ray_head.address!r})\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    result = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "ConfigError" in result.stderr and "RAY_AUTH_MODE=token" in result.stderr, result.stderr[-3000:]
