"""Fault specs: parsing, typed errors naming the bad spec, fire-once markers, the config switch and hard exits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.ledger import read_ledger
from hybridflow.reliability import faults as faults_module
from hybridflow.reliability.faults import (
    ENV_VAR,
    FaultPlan,
    InjectedFault,
    iteration_of_checkpoint,
    maybe_fail,
    parse_fault_specs,
)

from .conftest import run_and_export, short_config


@pytest.mark.slow
def test_points_fire_in_their_nodes_and_the_run_recovers(tmp_path: Path) -> None:
    """Every point a PPO run passes (all but reward_model.scores and the two killing the driver or its checkpoint,
    which tests/reliability/test_recovery.py and test_checkpoint_atomic.py cover) fires once, inside the node it is
    named after, and the run recovers each to the weights of a run without faults.

    The same run shows that the updates a recovery replays belong to earlier iterations and submit no generation
    ahead: the replay of update 3 (restoring the worker killed in update 4) would submit iteration 5's generation
    from the wrong weights and consume the fault armed for it; with the driver's gate that fault fires in iteration
    5's own generation (submitted ahead by update 4) and is recovered there.

    One rank (actor, reference and critic in one worker): each recovery restarts that one process instead of two.
    Faults on a chosen rank of a multi-rank group, and a peer left inside a collective, are test_recovery.py's."""
    ppo = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "actor.recompute_log_probs=true",
           "resource_pools.main.devices_per_node=[1]")
    run_and_export(short_config(tmp_path / "clean", *ppo, steps=6, every=3), tmp_path / "w_clean")
    faults = {  # fault → the node whose failure it must cause
        "actor.handover@0:raise": "actor.generate",
        "reference.log_probs@1:raise": "reference.compute_ref_log_probs",
        "actor.log_probs@2:raise": "actor.compute_log_probs",
        "checkpoint.worker_write@3:raise": "save_checkpoint",
        "critic.values@3:raise": "critic.compute_values",
        "critic.update@3:raise": "critic.update_critic",
        "actor.update@4:kill": "actor.update_policy",
        "actor.generate@5:raise": "actor.generate",
    }  # in the order the run reaches them; the log-probs, reference and values calls are dispatched together, so
    # each of them fails in an iteration of its own (two faults there would fire in one attempt: one recovery)
    trainer = run_and_export(short_config(tmp_path / "faulty", *ppo, faults=list(faults), steps=6, every=3),
                             tmp_path / "w_faulty")
    assert sorted(trainer.faults.fired()) == sorted(parse_fault_specs(f)[0].label for f in faults)
    events = trainer.supervisor.events
    assert [e["what"] for e in events] == ["iteration 0", "iteration 1", "iteration 2", "checkpoint of step 3",
                                           "iteration 3", "iteration 3", "iteration 4", "iteration 5"], events
    for event, (fault, node) in zip(events, faults.items()):
        named = fault.split(":")[0] if fault.endswith(":raise") else "died"  # a killed worker is found dead
        assert named in event["message"] and node in event["message"], (fault, event["message"])
    kill = events[6]
    assert kill["checkpoint"].endswith("step-3"), kill  # what update 3 is replayed onto, before iteration 4
    assert sorted(kill["updates_replayed"]) == ["actor.update_policy@3", "critic.update_critic@3"], kill
    ahead = [row["nodes"]["actor.generate"]["dispatched_at"] < row["start"] for row in read_ledger(tmp_path / "faulty")]
    # lookahead ran wherever allowed (never into a checkpoint step); iteration 5's row holds its failed ahead attempt
    assert ahead == [False, True, True, False, True, True], ahead
    clean, faulty = (load_file(tmp_path / w / "model.safetensors") for w in ("w_clean", "w_faulty"))
    assert clean.keys() == faulty.keys() and all(torch.equal(clean[k], faulty[k]) for k in clean)


def test_parse_specs() -> None:
    specs = parse_fault_specs("actor.update@2, actor.generate@1:hang:rank=1,critic.values@0:raise")
    assert [(s.point, s.iteration, s.action, s.rank) for s in specs] == [
        ("actor.update", 2, "kill", 0), ("actor.generate", 1, "hang", 1), ("critic.values", 0, "raise", 0)]
    assert parse_fault_specs("") == ()


def test_a_weight_load_fault_fires_before_its_bucket(tmp_path: Path) -> None:
    """``rollout.load_weights@V[:bucket=B]``: fires in the load of version V before bucket B (default 1), once."""
    default, second = parse_fault_specs("rollout.load_weights@2:raise,rollout.load_weights@3:raise:bucket=2")
    assert (default.bucket, default.fires_at_bucket, second.fires_at_bucket) == (None, 1, 2)
    assert second.label == "rollout.load_weights@3:raise:rank=0:bucket=2"
    plan = FaultPlan.from_sources([default.label, second.label], tmp_path, environ={})
    assert FaultPlan.from_json(plan.to_json()) == plan
    assert maybe_fail("rollout.load_weights", iteration=3, rank=0, bucket=1, plan=plan) is None
    with pytest.raises(InjectedFault, match="bucket=2"):
        maybe_fail("rollout.load_weights", iteration=3, rank=0, bucket=2, plan=plan)
    assert maybe_fail("rollout.load_weights", iteration=2, rank=0, bucket=0, plan=plan) is None
    with pytest.raises(InjectedFault):
        maybe_fail("rollout.load_weights", iteration=2, rank=0, bucket=1, plan=plan)
    assert sorted(plan.fired()) == sorted([default.label, second.label])


@pytest.mark.parametrize("text, named", [
    ("actor.updat@2", 'Did you mean "actor.update"'),
    ("actor.update", "POINT@ITERATION"),
    ("actor.update@2:explode", "kill, hang or raise"),
    ("actor.update@2:bucket=1", "bucket=B"),
    ("rollout.load_weights@1:bucket=x", "takes a number"),
])
def test_bad_specs_are_typed_errors_naming_the_spec(text: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_fault_specs(text)
    assert named in str(info.value)


def test_config_switch_off_by_default_and_validated(tmp_path: Path) -> None:
    assert load_config(None, []).reliability.faults == []
    config = load_config(None, ['reliability.faults=["actor.update@1"]'])
    plan = FaultPlan.from_sources(config.reliability.faults, tmp_path, environ={ENV_VAR: "actor.generate@3:hang"})
    assert [s.label for s in plan.specs] == ["actor.update@1:kill:rank=0", "actor.generate@3:hang:rank=0"]
    assert not FaultPlan.from_sources([], tmp_path, environ={}).active
    with pytest.raises(ConfigError) as info:
        load_config(None, ['reliability.faults=["critic.valu@1"]'])
    assert "reliability" in str(info.value) and 'Did you mean "critic.values"' in str(info.value)


def test_fault_fires_once_per_run(tmp_path: Path) -> None:
    plan = FaultPlan.from_sources(["critic.values@2:raise:rank=1"], tmp_path, environ={})
    assert maybe_fail("critic.values", iteration=1, rank=1, plan=plan) is None   # wrong iteration
    assert maybe_fail("critic.values", iteration=2, rank=0, plan=plan) is None   # wrong rank
    with pytest.raises(InjectedFault, match=r"critic\.values@2"):
        maybe_fail("critic.values", iteration=2, rank=1, plan=plan)
    assert maybe_fail("critic.values", iteration=2, rank=1, plan=plan) is None   # the marker says: fired
    assert plan.fired() == ["critic.values@2:raise:rank=1"]
    assert FaultPlan.from_json(plan.to_json()) == plan


def test_plans_are_scoped_to_their_owner(tmp_path: Path) -> None:
    """Two runs in one process: a fault of one run's plan never fires at the same point of the other's."""
    mine = FaultPlan.from_sources(["critic.values@1:raise"], tmp_path / "mine", environ={})
    other = FaultPlan.from_sources([], tmp_path / "other", environ={})
    assert maybe_fail("critic.values", iteration=1, rank=0, plan=other) is None
    with pytest.raises(InjectedFault):
        maybe_fail("critic.values", iteration=1, rank=0, plan=mine)


def test_driver_point_hands_the_kill_to_the_caller(tmp_path: Path) -> None:
    plan = FaultPlan.from_sources(["generate.before_consume@0:kill:rank=1"], tmp_path, environ={})
    spec = maybe_fail("generate.before_consume", iteration=0, plan=plan)
    assert spec is not None and spec.rank == 1


def test_kill_is_a_hard_exit_that_leaves_the_marker(tmp_path: Path) -> None:
    plan = FaultPlan.from_sources(["actor.update@0"], tmp_path, environ={})
    # the fresh process loads faults.py alone (it imports only hybridflow.errors): the package's __init__ pulls in
    # torch, seconds of CPU that show nothing here
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('faults', sys.argv[2]); "
            "faults = sys.modules['faults'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(faults); "
            "faults.maybe_fail('actor.update', iteration=0, rank=0, plan=faults.FaultPlan.from_json(sys.argv[1])); "
            "print('survived')")
    done = subprocess.run([sys.executable, "-c", code, plan.to_json(), faults_module.__file__], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 17 and "survived" not in done.stdout and "Traceback" not in done.stderr
    assert plan.fired() == ["actor.update@0:kill:rank=0"]


def test_iteration_of_checkpoint() -> None:
    assert iteration_of_checkpoint("/run/checkpoints/.tmp-step-12-abcd1234") == 12
    assert iteration_of_checkpoint("/run/checkpoints/step-3") == 3
    assert iteration_of_checkpoint("/elsewhere") is None
