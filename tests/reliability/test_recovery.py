"""Recovery on real workers: a worker killed inside the actor update, a hang caught by the watchdog and a worker
killed between nodes are recovered to bit-identical weights, with every sample consumed once and no mixed versions
in the ledger; with ``on_hang=stop`` a hang stops the run within its deadline instead."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.errors import DeadlineExceededError
from hybridflow.ledger import read_ledger
from hybridflow.reliability import audit_ledger
from hybridflow.trainer import Trainer

from .conftest import run_and_export, short_config

HANG_DEADLINE_S = 10.0


def weights(export: Path) -> dict[str, torch.Tensor]:
    return load_file(export / "model.safetensors")


@pytest.mark.slow  # ~55-60 CPU-seconds (a clean run and a run through every injected fault)
def test_faults_recover_to_the_uninjected_result(tmp_path: Path) -> None:
    run_and_export(short_config(tmp_path / "clean"), tmp_path / "w_clean")
    faults = ["actor.update@1:kill:rank=1", "actor.generate@2:hang", "controller.between_nodes@3"]
    trainer = run_and_export(short_config(tmp_path / "faulty", faults=faults,
                                          deadlines={"actor.generate": HANG_DEADLINE_S}), tmp_path / "w_faulty")

    clean, faulty = weights(tmp_path / "w_clean"), weights(tmp_path / "w_faulty")
    assert clean.keys() == faulty.keys() and all(torch.equal(clean[k], faulty[k]) for k in clean)

    events = trainer.supervisor.events
    assert [e["what"] for e in events] == ["iteration 1", "iteration 2", "checkpoint of step 4"]
    kill, hang, between = events
    assert kill["error"] == "WorkerError" and kill["updates_replayed"] == ["actor.update_policy@0"]
    assert hang["error"] == "DeadlineExceededError" and hang["checkpoint"].endswith("step-2")
    assert HANG_DEADLINE_S - 1 <= hang["seconds_failed_attempt"] <= HANG_DEADLINE_S + 20
    assert between["updates_replayed"] == ["actor.update_policy@2", "actor.update_policy@3"]
    stacks = list((tmp_path / "faulty" / "stacks").glob("main.actor.generate.rank0.*.txt"))
    assert stacks and "maybe_fail" in stacks[0].read_text()

    rows = read_ledger(tmp_path / "faulty")
    audit = audit_ledger(rows, samples_per_prompt=4)
    assert audit.iterations == [0, 1, 2, 3]
    assert audit.mixed_versions == [] and audit.samples_lost == 0 and audit.samples_duplicated == 0
    assert audit.recoveries == 2  # the two iterations that failed say so in their ledger rows
    assert all(row["nodes"]["actor.update_policy"]["policy_versions"] == [row["iteration"]] for row in rows)
    assert [row["metrics"]["actor/policy_version"] for row in rows] == [1.0, 2.0, 3.0, 4.0]


def test_hang_stops_the_run_within_its_deadline_when_policy_says_stop(tmp_path: Path) -> None:
    config = short_config(tmp_path / "stop", "reliability.on_hang=stop", faults=["actor.update@0:hang"],
                          deadlines={"actor.update_policy": HANG_DEADLINE_S}, steps=1, every=0)
    trainer = Trainer(config, progress=False)
    try:
        trainer.start()
        started = time.time()
        with pytest.raises(DeadlineExceededError) as info:
            trainer.fit()
        elapsed = time.time() - started
    finally:
        trainer.close()
    assert elapsed <= HANG_DEADLINE_S + 30
    assert "actor.update_policy did not finish within its deadline" in str(info.value)
    assert str(tmp_path / "stop" / "stacks") in str(info.value)
    assert list((tmp_path / "stop" / "stacks").glob("main.actor.update_policy.rank*.txt"))
    assert read_ledger(tmp_path / "stop") == [] and trainer.supervisor.events == []
