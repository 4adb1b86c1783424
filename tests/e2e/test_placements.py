"""Split placements through the real trainer: PPO with actor, reference and critic + reward model each on a pool of
their own consumes the same samples at the same policy versions and learns the same numbers as the colocated run
(placement must not change the algorithm); the ledger shows the calls to disjoint pools overlapping in time (the
drivers dispatch them together).

One split run covers what a "two roles per pool" and an "every role alone" run covered separately (the reference
away from the actor, the critic away from the actor, two roles sharing a pool that is not the actor's), in three
worker processes instead of six.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.config import load_config
from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.progress import read_metrics
from hybridflow.trainer.timing import is_timing_metric

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"
PPO = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "actor.recompute_log_probs=true",
       "reward.model={preset: tiny-qwen2}", "data.batch_size=8", "rollout.max_new_tokens=6",
       "trainer.total_steps=2", "trainer.checkpoint_every=0", "trainer.val_every=0", "trainer.val_n=1",
       "data.task.num_val_prompts=0", "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never")
#: role section → pool, one worker per pool (a quarter CPU each: the box is shared)
PLACEMENTS: dict[str, dict[str, str]] = {
    "colocate": {"actor": "main", "reference": "main", "critic": "main", "reward": "main"},
    "split": {"actor": "p0", "reference": "p1", "critic": "p2", "reward": "p2"},
}
ROLE_OF_SECTION = {"actor": "actor", "reference": "reference", "critic": "critic", "reward": "reward_model"}


def run_placement(run_dir: Path, pools_of: dict[str, str]) -> Path:
    pools = {pool: {"devices_per_node": [1], "device": "cpu", "cpus_per_worker": 0.25}
             for pool in sorted(set(pools_of.values()))}
    config = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", *PPO,
                                   f"resource_pools={yaml.safe_dump(pools, default_flow_style=True).strip()}",
                                   *(f"{section}.pool={pool}" for section, pool in pools_of.items())])
    fit_and_close(Trainer(config, progress=False))
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("placements")
    return {name: run_placement(root / name, pools_of) for name, pools_of in PLACEMENTS.items()}


def consumption(row: dict[str, Any]) -> dict[str, Any]:
    return next(note for note in row["notes"] if "consumed_uids" in note)


def interval(row: dict[str, Any], node: str) -> tuple[float, float]:
    entry = row["nodes"][node]
    return entry["dispatched_at"], entry["dispatched_at"] + entry["seconds"]


@pytest.mark.slow
def test_each_pool_runs_its_roles_in_its_own_processes(runs: dict[str, Path]) -> None:
    for name, pools_of in PLACEMENTS.items():
        manifest = json.loads((runs[name] / "manifest.json").read_text())
        mapping = manifest["mapping"]
        assert {section: mapping[ROLE_OF_SECTION[section]]["pool"] for section in pools_of} == pools_of, name
        pids = {pool: {rank["pid"] for rank in placed["ranks"]} for pool, placed in manifest["placement"].items()}
        assert set(pids) == set(pools_of.values()), name
        assert len(set().union(*pids.values())) == len(pids), f"{name}: pools share a process: {pids}"


@pytest.mark.slow
def test_split_consumes_the_same_samples_and_versions_and_learns_the_same(runs: dict[str, Path]) -> None:
    reference_rows = read_ledger(runs["colocate"])
    reference_metrics = read_metrics(runs["colocate"])
    assert [row["iteration"] for row in reference_rows] == [0, 1]
    for name in ("split",):
        rows = read_ledger(runs[name])
        assert len(rows) == len(reference_rows)
        for row, expected in zip(rows, reference_rows):
            assert consumption(row)["prompt_uids"] == consumption(expected)["prompt_uids"], name
            assert consumption(row)["consumed_uids"] == consumption(expected)["consumed_uids"], name
            versions = {node: entry["policy_versions"] for node, entry in row["nodes"].items()}
            assert versions == {node: entry["policy_versions"] for node, entry in expected["nodes"].items()}, name
            assert set(versions["actor.update_policy"]) == {row["iteration"]}
        for got, expected in zip(read_metrics(runs[name]), reference_metrics):
            keys = sorted(k for k in expected if not is_timing_metric(k))
            assert sorted(k for k in got if not is_timing_metric(k)) == keys
            for key in keys:  # same samples, scores, KL, advantages, losses and gradient norms
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (name, key)
    last = reference_metrics[-1]
    assert {"actor/pg_loss", "critic/vf_loss", "kl/actor_ref"} <= set(last)


@pytest.mark.slow
def test_calls_to_disjoint_pools_overlap_in_the_ledger(runs: dict[str, Path]) -> None:
    scoring = ("actor.compute_log_probs", "reference.compute_ref_log_probs", "critic.compute_values")
    for name in ("split",):
        for row in read_ledger(runs[name]):
            where = (name, row["iteration"])
            critic_update, actor_update = interval(row, "critic.update_critic"), interval(row, "actor.update_policy")
            # the actor's update was dispatched while the critic's was still running (not once it had finished)
            assert actor_update[0] < critic_update[1], (where, critic_update, actor_update)
            # the reward model was dispatched with the other scoring calls, not after gathering their results
            reward = interval(row, "reward_model.compute_scores")
            assert reward[0] < max(interval(row, node)[1] for node in scoring), (where, reward)
