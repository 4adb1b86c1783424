"""Fixtures of the megatron engine tests: run a scenario of megatron_ranks.py on N gloo processes, bounded in time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_SCRIPT = Path(__file__).with_name("megatron_ranks.py")


def run_ranks(tmp_path: Path, scenario: str, world: int, args: dict[str, Any], timeout_s: float = 240) -> list[Any]:
    """Run ``scenario`` on ``world`` processes; return each rank's result (rank order). Fails on timeout or error."""
    import torch

    from hybridflow.controller.host import reserve_port

    out = tmp_path / f"{scenario}_{world}_{abs(hash(json.dumps(args, sort_keys=True)))}"
    out.mkdir()
    # the engine starts torch.distributed from MASTER_PORT (env://), so rank 0's port is a number: held here until
    # the ranks finish (rank 0's TCPStore still binds it; no other process is handed it), not bound and released
    reservation = reserve_port("127.0.0.1")
    port = str(reservation.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    logs = []
    with reservation:
        procs = [
            subprocess.Popen(
                [sys.executable, str(_SCRIPT), scenario, str(rank), str(world), port, str(out), json.dumps(args)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for rank in range(world)
        ]
        try:
            for proc in procs:
                logs.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
            pytest.fail(f"{scenario} on {world} ranks did not finish in {timeout_s}s")
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            tail = "\n".join(line for line in logs[rank].splitlines() if "warn" not in line.lower())[-4000:]
            pytest.fail(f"{scenario} rank {rank} exited with {proc.returncode}:\n{tail}")
    return [torch.load(out / f"rank_{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.fixture
def ranks(tmp_path: Path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
    return lambda scenario, world, args, timeout_s=240: run_ranks(tmp_path, scenario, world, args, timeout_s)


@pytest.fixture(scope="module")
def module_ranks(tmp_path_factory: pytest.TempPathFactory):
    """Like ``ranks`` but shared by a test module, so a 1-rank reference runs once."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
    cache: dict[str, list[Any]] = {}

    def run(scenario: str, world: int, args: dict[str, Any], timeout_s: float = 240) -> list[Any]:
        key = json.dumps([scenario, world, args], sort_keys=True)
        if key not in cache:
            cache[key] = run_ranks(tmp_path_factory.mktemp("ranks"), scenario, world, args, timeout_s)
        return cache[key]

    return run
