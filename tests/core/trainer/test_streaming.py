"""Streaming mini-batches (``trainer.stream_mini_batches``, docs/guide/async.md): the config checks, the chunks a step
is cut into, how the chunks' update metrics combine and the actor worker's version between chunks (the trainer's path:
tests/e2e/test_async_train.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.algorithms.helpers import combine_chunk_metrics, split_prompt_chunks, stream_chunk_count
from hybridflow.batch import Batch
from hybridflow.config import load_config
from hybridflow.errors import ConfigError, VersionMismatchError

#: 4 prompts × n 4 = 16 rows a step, a rollout pool of 1 worker, chunks of 8 rows (2 prompt groups)
BASE = ["resource_pools.main.devices_per_node=[1]", "resource_pools.gen.devices_per_node=[1]", "data.batch_size=4",
        "rollout.n=4", "actor.recompute_log_probs=false"]
STREAM = [*BASE, "rollout.pool=gen", "trainer.stream_mini_batches=true", "actor.mini_batch_size=8"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.pool=null"], "rollout.pool is not set"),
    (["actor.mini_batch_size=null"], "must be a multiple of rollout.n = 4 .* got None"),
    (["actor.mini_batch_size=6"], "got 6"),  # not whole prompt groups
    (["actor.mini_batch_size=12"], "got 12"),  # does not divide the 16 rows
    (["actor.mini_batch_size=16"], "2 or more, got 16"),  # one chunk: nothing to stream
    (["resource_pools.gen.devices_per_node=[2]", "actor.mini_batch_size=4"], "split over the rollout pool's 2"),
    (["actor.recompute_log_probs=true"], "weights already stepped"),
    (["actor.ppo_epochs=2"], "ppo_epochs = 2"),
    (["rollout.pool=nowhere"], "not a pool of resource_pools"),
])
def test_streaming_is_refused_where_it_cannot_apply(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*STREAM, *overrides])
    config = load_config(None, STREAM)
    assert stream_chunk_count(config) == 2
    assert stream_chunk_count(load_config(None, [*STREAM[:-2], "actor.mini_batch_size=8"])) == 1


def test_an_algorithm_with_batch_wide_advantages_is_refused(tmp_path: Path) -> None:
    from hybridflow.trainer import Trainer

    config = load_config(None, [*STREAM, "algorithm.name=ppo", f"trainer.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="algorithm 'ppo' computes its advantages over the whole batch"):
        Trainer(config, progress=False)


def test_chunks_are_runs_of_whole_prompts_tagged_in_order() -> None:
    prompts = Batch({"input_ids": torch.arange(6)[:, None]}, {"uid": [f"p{row}" for row in range(6)]},
                    {"iteration": 3})
    chunks = split_prompt_chunks(prompts, 3)
    assert [list(chunk["uid"]) for chunk in chunks] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert [(chunk.meta["chunk"], chunk.meta["chunks"], chunk.meta["iteration"]) for chunk in chunks] == [
        (0, 3, 3), (1, 3, 3), (2, 3, 3)]
    with pytest.raises(ValueError, match="cannot split 6 prompts into 4"):
        split_prompt_chunks(prompts, 4)


def test_chunk_metrics_combine_as_the_engine_averages_its_mini_batches() -> None:
    # a training engine's train_step: per-mini-batch values summed in order, divided by the steps taken
    minis = [{"loss": 0.1, "pg_clipfrac": 0.3, "grad_norm": 1.7}, {"loss": 0.7, "pg_clipfrac": 0.0, "grad_norm": 0.2},
             {"loss": 0.2, "pg_clipfrac": 0.6, "grad_norm": 0.9}]
    engine = {key: sum((mini[key] for mini in minis), 0.0) / len(minis) for key in minis[0]}
    chunks = [{**mini, "lr": 0.003, "optimizer_steps": 1.0} for mini in minis]
    chunks[-1].update({"actor/policy_version": 4.0, "lr": 0.002})
    combined = combine_chunk_metrics(chunks)
    assert {key: combined[key] for key in engine} == engine  # bit for bit
    assert combined["optimizer_steps"] == 3.0 and combined["lr"] == 0.002 and combined["actor/policy_version"] == 4.0


def _method(cls: type, name: str) -> Any:
    """``cls.name`` undecorated (called in this process instead of through a worker group)."""
    bound = getattr(cls, name)
    return getattr(bound, "__wrapped__", bound)


def test_the_actor_moves_its_version_at_the_final_chunk_and_refuses_exports_between() -> None:
    """A streamed step on the actor worker (in this process): chunks before the final train but leave the version;
    until the final one, weight exports, log-probs and generation are refused (the weights are no version)."""
    from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
    from hybridflow.presets import preset_model_config
    from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
    from hybridflow.workers.roles import RoleSpec
    from hybridflow.workers.rollout import WeightExportingActor

    model = ModelSpec(config=preset_model_config("tiny-qwen2"))
    actor = WeightExportingActor(RoleSpec(role="actor", engine="fsdp", engine_config=TrainingEngineConfig(model=model),
                                          loss=sequence_mean_nll, rollout_engine="hf",
                                          rollout_config=RolloutEngineConfig(model=model), sampling=SamplingParams()))
    chunks = [build_training_batch(rows=4, seed=seed) for seed in (0, 1)]
    update, export = _method(WeightExportingActor, "update_policy_chunk"), _method(WeightExportingActor,
                                                                                    "export_generation_weights")
    before = {name: tensor.clone() for name, tensor in actor.engine.generation_weights(target="hf")}
    metrics = update(actor, chunks[0], final=False)
    assert actor.policy_version == 0 and "actor/policy_version" not in metrics and metrics["optimizer_steps"] == 1
    for method, args in (("export_generation_weights", ()), ("compute_log_probs", (chunks[1],)),
                         ("generate", (chunks[1],))):
        with pytest.raises(VersionMismatchError, match="inside a streamed step"):
            _method(WeightExportingActor, method)(actor, *args)
    assert update(actor, chunks[1], final=True)["actor/policy_version"] == 1 and actor.policy_version == 1
    version, buckets = export(actor)
    assert version == 1 and buckets
    after = dict(actor.engine.generation_weights(target="hf"))
    assert any(not torch.equal(after[name], tensor) for name, tensor in before.items())  # two steps were taken
