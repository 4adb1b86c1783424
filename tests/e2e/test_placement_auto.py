"""``trainer.placement: auto`` on the trainer's path: the run searches its own placement at start-up, runs on it (the
manifest's pools and the workers' own placement report are the plan's), and its summary ends with the capacity line
and the advisor's verdict on its own ledger; a run placed by hand says it has no plan. Bad combinations are refused
before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli import main as hybridflow
from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.placement.auto import apply_auto_placement, plan_for_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"
SHORT = ["trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never", "trainer.total_steps=3",
         "trainer.checkpoint_every=0", "trainer.val_every=0", "trainer.val_n=1", "data.task.num_val_prompts=0",
         "data.batch_size=8", "rollout.max_new_tokens=6"]


def test_ppo_on_two_devices_is_split_and_grpo_colocated() -> None:
    """The search's choice on this box's two CPU devices: PPO's critic trains beside the actor on a device of its
    own (their updates overlap); GRPO, with nothing to overlap, keeps every stage on both devices."""
    ppo = plan_for_config(load_config(EXAMPLE, ["algorithm.name=ppo", "trainer.placement=auto"]))
    assert ppo.plan.kind == "split"
    pools = ppo.fragment["resource_pools"]
    assert sorted(sum(pool["devices_per_node"]) for pool in pools.values()) == [1, 1]
    assert ppo.fragment["actor"]["pool"] != ppo.fragment["critic"]["pool"]
    assert set(ppo.hosted) == {"actor", "critic"}  # the reward is a function: it stays on the actor's devices
    assert ppo.fragment["reward"]["pool"] == ppo.fragment["actor"]["pool"]
    grpo = plan_for_config(load_config(EXAMPLE, ["trainer.placement=auto"]))
    assert grpo.plan.kind == "colocate" and list(grpo.fragment["resource_pools"].values()) == [
        {"devices_per_node": [2], "device": "cpu"}]


@pytest.mark.slow
def test_an_auto_placed_run_runs_its_plan_and_ends_with_the_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "auto"
    assert hybridflow(["train", "--no-progress", str(EXAMPLE), f"trainer.run_dir={run_dir}", "algorithm.name=ppo",
                       "trainer.placement=auto", *SHORT]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((run_dir / "manifest.json").read_text())
    plan = json.loads((run_dir / "placement.json").read_text())
    assert manifest["plan"]["mode"] == "auto" and manifest["plan"]["plan"] == plan["plan"]
    # the run ran on the plan: its config's pools and each role's pool are the fragment's, and the workers say so
    assert manifest["config"]["resource_pools"] == {
        name: {**pool, "cpus_per_worker": 0.5, "ready_timeout_s": 60.0}
        for name, pool in plan["fragment"]["resource_pools"].items()}
    for role in ("actor", "critic"):
        assert manifest["config"][role]["pool"] == plan["fragment"][role]["pool"]
    assert {pool: len(ranks["ranks"]) for pool, ranks in manifest["placement"].items()} == {
        name: sum(pool["devices_per_node"]) for name, pool in plan["fragment"]["resource_pools"].items()}
    assert (run_dir / "plan.json").exists()
    lines = out.strip().splitlines()
    capacity = next(i for i, line in enumerate(lines) if line.startswith("capacity: "))
    assert lines[capacity + 1].startswith("placement advisor (3 iterations): "), out[-2000:]
    assert lines[capacity + 1].split(": ", 1)[1].startswith(("KEEP: ", "REMAP: "))


def test_a_run_placed_by_hand_says_it_has_no_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "manual"
    assert hybridflow(["train", "--no-progress", str(EXAMPLE), f"trainer.run_dir={run_dir}",
                       "trainer.total_steps=2", *SHORT[:3], *SHORT[4:]]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    capacity = next(i for i, line in enumerate(lines) if line.startswith("capacity: "))
    assert lines[capacity + 1].startswith("placement advisor: no plan for this run (placed by hand)")
    assert json.loads((run_dir / "manifest.json").read_text())["plan"] == {"mode": "manual"}


def test_refusals_name_the_fix(tmp_path: Path) -> None:
    both = load_config(EXAMPLE, ["trainer.placement=auto", f"trainer.plan={tmp_path}"])
    with pytest.raises(ConfigError, match=r"drop trainer\.plan"):
        apply_auto_placement(both, tmp_path / "run")
    cuda = load_config(EXAMPLE, ["trainer.placement=auto", "resource_pools.main.device=cuda"])
    with pytest.raises(ConfigError, match=r"trainer\.placement_profile"):
        plan_for_config(cuda)
    missing = load_config(EXAMPLE, ["trainer.placement=auto", "model.preset=null", f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"config\.json"):
        plan_for_config(missing)
