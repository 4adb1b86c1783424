"""Fixtures of the megatron engine tests: run a scenario of megatron_ranks.py on N gloo processes, bounded in time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import megatron_ranks  # this folder is on sys.path (pytest's rootdir conftest import mode)


def run_ranks(tmp_path: Path, scenario: str, world: int, args: dict[str, Any], timeout_s: float = 240) -> list[Any]:
    """Run ``scenario`` on ``world`` processes; return each rank's result (rank order). Fails on timeout or error."""
    import torch

    from hybridflow.testing.contracts.spawn import run_ranks as run_gloo_ranks

    out = tmp_path / f"{scenario}_{world}_{abs(hash(json.dumps(args, sort_keys=True)))}"
    out.mkdir()
    # each rank a child started with torch and transformers imported (hybridflow.controller.preloaded), rank 0's
    # port held by the harness until the ranks finish; a rank's traceback or a hang fails the test
    run_gloo_ranks(megatron_ranks.run_rank, world, scenario, str(out), args, workdir=out, timeout_s=timeout_s)
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
