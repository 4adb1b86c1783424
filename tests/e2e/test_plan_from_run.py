"""Plan → train → advise on a real run: `hybridflow plan --output`, `hybridflow train` with the fragment,
``trainer.plan`` and the periodic advisor (``trainer.advisor_every``), then `hybridflow plan --from-run RUN_DIR
--remaining N` on the trainer's own ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import main as hybridflow
from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.placement import compare_nodes, load_plan_record, read_ledger
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.record import retime_plan
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"


def _merge(base: dict, fragment: dict) -> dict:
    merged = dict(base)
    for key, value in fragment.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    model_dir = tmp_path / "tiny-qwen2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**tiny_model_config(), "torch_dtype": "float32"}))
    plan_dir = tmp_path / "plan"
    assert hybridflow(["plan", "--algorithm", "grpo", "--model", str(model_dir), "--devices", "2",
                       "--devices-per-node", "2", "--profile", "cpu", "--batch", "16", "--samples-per-prompt", "4",
                       "--prompt-length", "8", "--response-length", "8", "--mini-batches", "1",
                       "--micro-batch-size", "32", "--output", str(plan_dir)]) == 0
    capsys.readouterr()
    return plan_dir


@pytest.mark.slow  # 45-70 s in the full run of 2026-12-07 (tests/durations.json)
def test_train_with_plan_then_advise_from_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_dir = _plan(tmp_path, capsys)
    fragment = yaml.safe_load((plan_dir / "placement.yaml").read_text())
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(_merge(yaml.safe_load(EXAMPLE.read_text()), fragment)))
    run_dir = tmp_path / "run"
    config = load_config(config_file, [
        f"trainer.run_dir={run_dir}", f"trainer.plan={plan_dir}", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.resume=never", "trainer.total_steps=2", "trainer.checkpoint_every=0",
        "trainer.advisor_every=1",
        "actor.kl_loss_coef=0.001", "reward.model={preset: tiny-qwen2}",
        "trainer.val_every=0", "trainer.val_n=1", "data.task.num_val_prompts=0"])
    trainer = Trainer(config, progress=False)
    fit_and_close(trainer)
    assert (run_dir / "plan.json").read_bytes() == (plan_dir / "plan.json").read_bytes()
    # the trainer's own check after step 1 of 2 (none after the last), with transition costs measured on this run
    in_run = [json.loads(line) for line in (run_dir / "advisor.jsonl").read_text().splitlines()]
    assert [line["step"] for line in in_run] == [1] and in_run[0]["remaining_iterations"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["advisor"][0]["step"] == 1
    assert trainer.advisor is not None and trainer.advisor.setup_seconds > 0  # this run's start-up, measured
    assert "placement advisor (1 checks" in capsys.readouterr().out  # printed at the end of the run
    if in_run[0]["drift"]:  # then it priced a transition with it: start-up per changed model
        transition = in_run[0]["transition"]
        assert transition["measured"] == 1.0
        assert transition["process_group_seconds"] == pytest.approx(
            transition["models_changed"] * trainer.advisor.setup_seconds / 3)

    # the trainer's role.method nodes are matched to the planner's stages
    inputs, record = load_plan_record(run_dir)
    usable = inputs.cluster.device.memory_bytes * inputs.efficiency.usable_memory_fraction
    plan = retime_plan(LayoutPlanner(inputs.simulator(), inputs.dataflow, inputs.models), record, usable)
    rows = read_ledger(run_dir)
    assert [row["iteration"] for row in rows] == [0, 1]
    compared = {c.node: c for c in compare_nodes(plan, rows, {s.name: s.kind for s in inputs.dataflow.stages})}
    assert set(compared) == {"actor.generate", "reference.compute_ref_log_probs", "reward_model.compute_scores",
                             "actor.update_policy"}
    assert compared["actor.generate"].stages == ("generate", "weight_sync")
    assert all(c.samples == 2 and c.observed_median > 0 for c in compared.values())

    assert hybridflow(["plan", "--from-run", str(run_dir), "--remaining", "1000", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    lines = (run_dir / "advisor.jsonl").read_text().splitlines()
    assert len(lines) == 2
    written = json.loads(lines[-1])
    assert {k: v for k, v in written.items() if k != "time"} == {k: v for k, v in printed.items() if k != "time"}
    assert printed["remaining_iterations"] == 1000
    assert printed["current_plan"] == "colocate {actor, reference, reward}:2"
    assert set(printed["drift"]) <= set(compared)
    # drift = observed/predicted off by > 15 % over the steady rows: the advisor drops the first (warm-up) row, so
    # the oracle is the comparison on row 1 alone (over both rows a 0.04 s and a 1.09 s generate step averaged to a
    # ratio inside the band while the steady row drifted: the earlier form of this check failed once in CI)
    steady = {c.node: c for c in compare_nodes(plan, rows[1:], {s.name: s.kind for s in inputs.dataflow.stages})}
    for node, comparison in steady.items():  # and every node off by more than that is reported, at its ratio
        assert (node in printed["drift"]) == (abs(comparison.ratio - 1) > 0.15), (node, comparison.ratio)
        if node in printed["drift"]:
            assert printed["drift"][node] == pytest.approx(comparison.ratio)
    if printed["remap"]:
        assert printed["total_gain_seconds"] > printed["transition"]["total_seconds"]
        assert printed["fragment"]["resource_pools"]

    # the report shows the same verdict on the same ledger (and writes no second advisor.jsonl line)
    assert hybridflow(["report", str(run_dir), "--remaining", "1000", "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)["advisor"]
    assert {k: v for k, v in verdict.items() if k != "time"} == {k: v for k, v in printed.items() if k != "time"}
    assert len((run_dir / "advisor.jsonl").read_text().splitlines()) == 2
    assert "<h2>Placement advisor</h2>" in (run_dir / "report.html").read_text()


def test_trainer_refuses_a_malformed_plan(tmp_path: Path, tiny_config) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text("{}")
    trainer = Trainer(tiny_config(tmp_path / "run", f"trainer.plan={bad}"), progress=False)
    try:
        with pytest.raises(ConfigError, match="malformed"):
            trainer.start()
        assert trainer.groups is None and not (tmp_path / "run" / "plan.json").exists()
    finally:
        trainer.close()
