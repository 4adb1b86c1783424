"""The deepspeed engine declares ``reusable_process``: a worker process that closed its engines and was restored as a
parked host restores it (hybridflow.controller.process_state) trains a new engine bit for bit as a fresh one. The
contract check (:func:`~hybridflow.testing.contracts.training.check_process_reuse`) runs for ZeRO stages 1, 2 and 3,
one after the other in the same spawned processes, on a 1-rank and a 2-rank gloo group; each engine's world gets a
fresh rendezvous, as a parked host's next group does."""

from __future__ import annotations

import dataclasses
import itertools
import json
import traceback
from pathlib import Path

import pytest

from hybridflow.engines import TrainingEngineConfig
from hybridflow.testing.contracts.rollout import prepare_model
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import check_process_reuse

pytest.importorskip("deepspeed", reason="deepspeed is not installed (bash scripts/setup.sh --all)")
pytestmark = pytest.mark.deepspeed

STAGES = (1, 2, 3)
WORLDS = (1, 2)


def _deepspeed_state_left() -> list[str]:
    """DeepSpeed's module-level state that differs from a fresh import's (hybridflow_deepspeed.runtime.
    release_deepspeed_state puts it back once the last engine closes)."""
    import deepspeed.comm.comm as comm
    from deepspeed.runtime.zero import parameter_offload, partition_parameters
    from deepspeed.utils import groups

    held = {"deepspeed.comm.cdb": comm.cdb is not None, "groups._WORLD_GROUP": groups._WORLD_GROUP is not None,
            "groups._DATA_PARALLEL_GROUP": groups._DATA_PARALLEL_GROUP is not None,
            "parameter_offload.FWD_MODULE_STACK": bool(parameter_offload.FWD_MODULE_STACK),
            "zero.Init.param_id": partition_parameters.Init.param_id != 0}
    return [name for name, left in held.items() if left]


def _reuse_rank(rank: int, world_size: int, workdir: str, out_file: str) -> None:
    import torch.distributed as dist

    from hybridflow_deepspeed.plugin import build_deepspeed_training_engine

    worlds = itertools.count()
    outcomes: dict[str, str | None] = {}
    for stage in STAGES:
        def make(role: str, config: TrainingEngineConfig, stage: int = stage):  # type: ignore[no-untyped-def]
            if not dist.is_initialized():  # the world of the engine before was destroyed: a new rendezvous
                store = dist.FileStore(str(Path(workdir) / f"store_{world_size}_{next(worlds)}"), world_size)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
            config = dataclasses.replace(config, extra={**config.extra, "zero_stage": stage})
            return build_deepspeed_training_engine(role=role, config=config, device="cpu")

        try:
            check_process_reuse(make, Path(workdir))
            left = _deepspeed_state_left()
            outcomes[f"zero{stage}"] = f"closed engines left DeepSpeed state: {left}" if left else None
        except Exception:  # noqa: BLE001 - recorded: the stage's own test fails with it
            outcomes[f"zero{stage}"] = traceback.format_exc()
    Path(out_file.format(rank=rank)).write_text(json.dumps(outcomes))


@pytest.fixture(scope="module")
def reuse_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, str | None]]]:
    """Every rank's outcome per stage, for each world size (DeepSpeed imported once per rank)."""
    workdir = tmp_path_factory.mktemp("deepspeed_reuse")
    prepare_model(workdir)  # once, before the ranks read it
    out_files = {world: str(workdir / f"outcomes_{world}_{{rank}}.json") for world in WORLDS}
    run_rank_groups([(_reuse_rank, world, (str(workdir), out_files[world])) for world in WORLDS], workdir=workdir,
                    timeout_s=600)
    return {world: [json.loads(Path(out_files[world].format(rank=rank)).read_text()) for rank in range(world)]
            for world in WORLDS}


def test_deepspeed_declares_reusable_process() -> None:
    from hybridflow.engines import training_engine_info
    from hybridflow.plugins import load_plugins

    load_plugins()
    assert training_engine_info("deepspeed").reusable_process


@pytest.mark.slow  # a 1-rank and a 2-rank group of spawned processes, six engines each
@pytest.mark.parametrize("world", WORLDS, ids=lambda world: f"{world}rank")
@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"zero{stage}")
def test_the_declared_process_reuse_holds(stage: int, world: int,
                                          reuse_outcomes: dict[int, list[dict[str, str | None]]]) -> None:
    for rank, outcomes in enumerate(reuse_outcomes[world]):
        assert outcomes[f"zero{stage}"] is None, f"rank {rank} of {world}: {outcomes[f'zero{stage}']}"
