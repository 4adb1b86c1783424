"""The megatron engine declares ``reusable_process``: a worker process that closed its engines and was restored as a
parked host restores it (hybridflow.controller.process_state) trains a new engine bit for bit as a fresh one. The
contract check (:func:`~hybridflow.testing.contracts.training.check_process_reuse`) runs in spawned gloo processes, as
the plugin's contract suite runs: on 1 rank (t = 1), and on 2 ranks at (t, p) = (1, 1) (2 data-parallel ranks), then
(2, 1) and (1, 2) in the same processes (a reused process takes another layout; before close() released megatron's
parallel state it refused one). Each engine's world gets a fresh rendezvous, as a parked host's next group does."""

from __future__ import annotations

import dataclasses
import itertools
import json
import traceback
from pathlib import Path

import pytest

from hybridflow.engines import ParallelConfig, TrainingEngineConfig
from hybridflow.presets import save_tiny_model
from hybridflow.testing.contracts.rollout import prepare_model
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import check_process_reuse

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron

#: (tensor, pipeline) layouts checked one after the other on each world size
LAYOUTS = {1: ((1, 1),), 2: ((1, 1), (2, 1), (1, 2))}


def _megatron_state_left() -> list[str]:
    """Megatron's process-wide state that differs from a fresh import's (hybridflow_megatron.model.
    release_megatron_state puts it back once the last engine closes)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    from hybridflow_megatron import cpu_shim, model

    held = {"parallel_state initialized": parallel_state.model_parallel_is_initialized(),
            "parallel_state._DATA_PARALLEL_GLOBAL_RANKS": parallel_state._DATA_PARALLEL_GLOBAL_RANKS is not None,
            "parallel_state._GLOBAL_MEMORY_BUFFER": parallel_state._GLOBAL_MEMORY_BUFFER is not None,
            "hybridflow_megatron.model._parallel_sizes": model._parallel_sizes is not None,
            "tensor_parallel.random._CUDA_RNG_STATE_TRACKER": random._CUDA_RNG_STATE_TRACKER is not None,
            "cpu_shim active": cpu_shim.is_cpu_shim_active()}
    return [name for name, left in held.items() if left]


def _kv2_model(workdir: str) -> str:
    return str(Path(workdir) / "tiny_model_kv2")


def _reuse_rank(rank: int, world_size: int, workdir: str, out_file: str) -> None:
    import torch.distributed as dist

    from hybridflow_megatron.engine import build_megatron_training_engine

    worlds = itertools.count()
    outcomes: dict[str, str | None] = {}
    for tensor, pipeline in LAYOUTS[world_size]:
        def make(role: str, config: TrainingEngineConfig, tensor: int = tensor,  # type: ignore[no-untyped-def]
                 pipeline: int = pipeline):
            if not dist.is_initialized():  # the world of the engine before was destroyed: a new rendezvous
                store = dist.FileStore(str(Path(workdir) / f"store_{world_size}_{next(worlds)}"), world_size)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
            parallel = ParallelConfig(tensor_parallel_size=tensor, pipeline_parallel_size=pipeline)
            config = dataclasses.replace(config, parallel=parallel)
            if tensor > 1:  # the contract's model has 1 key/value head: the same one with 2, which t = 2 splits
                config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=_kv2_model(workdir)))
            return build_megatron_training_engine(role=role, config=config, device="cpu")

        key = f"t{tensor}p{pipeline}"
        try:
            check_process_reuse(make, Path(workdir))
            left = _megatron_state_left()
            outcomes[key] = f"closed engines left megatron state: {left}" if left else None
        except Exception:  # noqa: BLE001 - recorded: the layout's own test fails with it
            outcomes[key] = traceback.format_exc()
    Path(out_file.format(rank=rank)).write_text(json.dumps(outcomes))


@pytest.fixture(scope="module")
def reuse_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, str | None]]]:
    """Every rank's outcome per layout, for each world size (megatron imported once per rank)."""
    workdir = tmp_path_factory.mktemp("megatron_reuse")
    prepare_model(workdir)  # once, before the ranks read them
    save_tiny_model(_kv2_model(str(workdir)), num_kv_heads=2)
    out_files = {world: str(workdir / f"outcomes_{world}_{{rank}}.json") for world in LAYOUTS}
    run_rank_groups([(_reuse_rank, world, (str(workdir), out_files[world])) for world in LAYOUTS], workdir=workdir,
                    timeout_s=600)
    return {world: [json.loads(Path(out_files[world].format(rank=rank)).read_text()) for rank in range(world)]
            for world in LAYOUTS}


def test_megatron_declares_reusable_process() -> None:
    from hybridflow.engines import training_engine_info
    from hybridflow.plugins import load_plugins

    load_plugins()
    assert training_engine_info("megatron").reusable_process


@pytest.mark.slow  # a 1-rank and a 2-rank group of spawned processes, two engines per layout
@pytest.mark.parametrize(("world", "layout"), [(world, layout) for world, layouts in LAYOUTS.items()
                                               for layout in layouts],
                         ids=lambda value: f"{value}rank" if isinstance(value, int) else f"t{value[0]}p{value[1]}")
def test_the_declared_process_reuse_holds(world: int, layout: tuple[int, int],
                                          reuse_outcomes: dict[int, list[dict[str, str | None]]]) -> None:
    key = f"t{layout[0]}p{layout[1]}"
    for rank, outcomes in enumerate(reuse_outcomes[world]):
        assert outcomes[key] is None, f"rank {rank} of {world} ranks: {outcomes[key]}"
