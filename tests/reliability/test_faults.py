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

    One rank (actor, reference and critic in one worker): each recovery restarts that one process instead of two.
    Faults on a chosen rank of a multi-rank group, and a peer left inside a collective, are test_recovery.py's."""
    ppo = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "actor.recompute_log_probs=true",
           "resource_pools.main.devices_per_node=[1]")
    run_and_export(short_config(tmp_path / "clean", *ppo), tmp_path / "w_clean")
    faults = {  # fault → the node whose failure it must cause
        "actor.handover@0:raise": "actor.generate",
        "reference.log_probs@1:raise": "reference.compute_ref_log_probs",
        "critic.values@1:raise": "critic.compute_values",
        "checkpoint.worker_write@2:raise": "save_checkpoint",
        "actor.log_probs@2:raise": "actor.compute_log_probs",
        "actor.generate@3:raise": "actor.generate",
        "critic.update@3:raise": "critic.update_critic",
    }  # in the order the run reaches them
    trainer = run_and_export(short_config(tmp_path / "faulty", *ppo, faults=list(faults)), tmp_path / "w_faulty")
    assert sorted(trainer.faults.fired()) == sorted(parse_fault_specs(f)[0].label for f in faults)
    events = trainer.supervisor.events
    assert [e["what"] for e in events] == ["iteration 0", "iteration 1", "iteration 1", "checkpoint of step 2",
                                           "iteration 2", "iteration 3", "iteration 3"], events
    for event, (fault, node) in zip(events, faults.items()):
        assert fault.split(":")[0] in event["message"] and node in event["message"], (fault, event["message"])
    clean, faulty = (load_file(tmp_path / w / "model.safetensors") for w in ("w_clean", "w_faulty"))
    assert clean.keys() == faulty.keys() and all(torch.equal(clean[k], faulty[k]) for k in clean)


def test_parse_specs() -> None:
    specs = parse_fault_specs("actor.update@2, actor.generate@1:hang:rank=1,critic.values@0:raise")
    assert [(s.point, s.iteration, s.action, s.rank) for s in specs] == [
        ("actor.update", 2, "kill", 0), ("actor.generate", 1, "hang", 1), ("critic.values", 0, "raise", 0)]
    assert parse_fault_specs("") == ()


@pytest.mark.parametrize("text, named", [
    ("actor.updat@2", 'Did you mean "actor.update"'),
    ("actor.update", "POINT@ITERATION"),
    ("actor.update@2:explode", "kill, hang or raise"),
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
    code = ("import sys; from hybridflow.reliability.faults import FaultPlan, maybe_fail; "
            "maybe_fail('actor.update', iteration=0, rank=0, plan=FaultPlan.from_json(sys.argv[1])); print('survived')")
    done = subprocess.run([sys.executable, "-c", code, plan.to_json()], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 17 and "survived" not in done.stdout and "Traceback" not in done.stderr
    assert plan.fired() == ["actor.update@0:kill:rank=0"]


def test_iteration_of_checkpoint() -> None:
    assert iteration_of_checkpoint("/run/checkpoints/.tmp-step-12-abcd1234") == 12
    assert iteration_of_checkpoint("/run/checkpoints/step-3") == 3
    assert iteration_of_checkpoint("/elsewhere") is None
