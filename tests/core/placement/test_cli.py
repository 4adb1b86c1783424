"""``hybridflow plan``: prints a plan, writes a valid fragment and plan record, and runs the advisor on a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridflow.placement import load_plan_record, validate_fragment
from hybridflow.placement.cli import main

from placement_runs import make_run, write_ledger


def test_plan_writes_fragment_and_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "13b", "--devices", "32", "--profile", "h100", "--batch", "256",
                 "--output", str(tmp_path), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    fragment = yaml.safe_load((tmp_path / "placement.yaml").read_text())
    assert fragment == printed["fragment"]
    validate_fragment(fragment)
    inputs, record = load_plan_record(tmp_path)
    assert inputs.cluster.num_devices == 32 and inputs.workload.prompts == 256
    assert sum(record.devices) == 32


def test_plan_with_hf_config_and_safe_rlhf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
              "intermediate_size": 5632, "vocab_size": 32000, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["--algorithm", "safe_rlhf", "--model", str(tmp_path), "--cost", "350m", "--devices", "16"]) == 0
    out = capsys.readouterr().out
    assert "cost:" in out and "s/iteration" in out


def test_plan_reports_infeasible_as_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "70b", "--devices", "8"]) == 1
    assert "memory floors need" in capsys.readouterr().err


def test_from_run_writes_advisor_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs, record = make_run(tmp_path)
    write_ledger(tmp_path, inputs, record, inputs.efficiency)
    assert main(["--from-run", str(tmp_path), "--remaining", "10"]) == 0
    assert "KEEP" in capsys.readouterr().out
    assert len((tmp_path / "advisor.jsonl").read_text().splitlines()) == 1
    assert main(["--from-run", str(tmp_path)]) == 2


def test_plan_records_shared_cores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny", "--devices", "4", "--devices-per-node", "4", "--profile", "cpu", "--batch", "24",
                 "--compute-units", "2", "--output", str(tmp_path)]) == 0
    capsys.readouterr()
    inputs, _ = load_plan_record(tmp_path)
    assert inputs.cluster.compute_units == 2


def test_every_registered_algorithm_gets_a_dataflow_from_its_roles(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The derivation from declared roles reproduces the paper's written-out graphs for ppo and grpo; every
    registered algorithm (a new built-in included) plans and writes a valid fragment; unknown names list the
    known."""
    from hybridflow import registries
    from hybridflow.placement.dataflow import ALGORITHMS, derive_dataflow
    from hybridflow.plugins import load_plugins

    assert derive_dataflow("ppo") == ALGORITHMS["ppo"] and derive_dataflow("grpo") == ALGORITHMS["grpo"]
    load_plugins()
    registered = registries.algorithms.names()
    assert {"grpo", "ppo", "rloo", "reinforce_plus_plus", "remax", "on_policy_distill"} <= set(registered)
    for algorithm in registered:
        assert main(["--algorithm", algorithm, "--model", "7b", "--devices", "16", "--json"]) == 0, algorithm
        fragment = json.loads(capsys.readouterr().out)["fragment"]
        validate_fragment(fragment)
        assert {"actor", "reference", "reward"} <= set(fragment)
    assert main(["--algorithm", "nope", "--devices", "8"]) == 1
    assert ("Unknown algorithm 'nope' for placement. Known: grpo, on_policy_distill, ppo, reinforce_plus_plus, "
            "remax, rloo") in capsys.readouterr().err


def test_a_plugin_algorithm_plans_its_own_roles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The two-reward-model plugin algorithm (a second reward model under roles.safety): the plan places it, and
    the fragment puts it under roles.safety, where the trainer's config reads it."""
    import importlib
    import sys

    from hybridflow import plugins

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "two_reward_plugin"
    sys.path.insert(0, str(fixture))
    try:
        module = importlib.import_module("hybridflow_two_reward.plugin")
        plugins.register_plugin(module, name="two_reward_test")
        assert main(["--algorithm", "two_reward_grpo", "--model", "7b", "--devices", "16", "--json"]) == 0
        fragment = json.loads(capsys.readouterr().out)["fragment"]
        validate_fragment(fragment)
        assert set(fragment["roles"]) == {"safety"} and "pool" in fragment["roles"]["safety"]
        assert {"actor", "reference", "reward"} <= set(fragment)
    finally:
        from hybridflow import registries

        registries.algorithms.unregister("two_reward_grpo")
        plugins.get_plugin_manager().unregister(name="two_reward_test")
        sys.path.remove(str(fixture))
