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

#: the deadline of the node a hang fault is injected into: only the hang (3600 s) may exceed it. A generation
#: submitted ahead counts it from its dispatch, queued behind an update, and a restarted worker's first calls are
#: slower: 10 s was exceeded once by a plain generation on a loaded CI box (two pytest workers on 2 cores)
HANG_DEADLINE_S = 30.0
#: the stop test's deadline: any expiry stops the run with the error it checks, so it need not only fit the hang
STOP_DEADLINE_S = 10.0


def weights(export: Path) -> dict[str, torch.Tensor]:
    return load_file(export / "model.safetensors")


@pytest.mark.slow  # a clean run and a run through every injected fault
def test_faults_recover_with_lookahead_on(tmp_path: Path) -> None:
    """trainer.lookahead (the default) stays on under faults. One 4-step run (checkpoint at step 2; the generations
    of iterations 1 and 3 are submitted ahead) takes: a worker (rank 1) killed inside update 0 while generation 1 is
    queued behind it; a hang in generation 1, submitted ahead (caught by its own deadline, not the group's; recovered
    by replaying update 0 into the restarted workers, no checkpoint yet); a worker killed between nodes after
    iteration 2 while generation 3 runs ahead (iteration 3 fails, step-2 is restored and update 2 replayed); one
    killed after iteration 3 (the checkpoint of step 4 fails, updates 2 and 3 are replayed). The result is the
    weights of an uninjected run, bit for bit."""
    clean_dir = tmp_path / "clean"
    run_and_export(short_config(clean_dir), tmp_path / "w_clean")
    faults = ["actor.update@0:kill:rank=1", "actor.generate@1:hang", "controller.between_nodes@2",
              "controller.between_nodes@3"]
    config = short_config(tmp_path / "faulty", faults=faults, deadlines={"actor.generate": HANG_DEADLINE_S})
    assert config.trainer.lookahead and config.trainer.deadline_s > HANG_DEADLINE_S + 60
    trainer = run_and_export(config, tmp_path / "w_faulty")

    reference, recovered = weights(tmp_path / "w_clean"), weights(tmp_path / "w_faulty")
    assert reference.keys() == recovered.keys() and all(torch.equal(reference[k], recovered[k]) for k in reference)

    events = trainer.supervisor.events
    assert [e["what"] for e in events] == ["iteration 0", "iteration 1", "iteration 3", "checkpoint of step 4"], events
    kill, hang, between, last = events
    assert kill["error"] == "WorkerError" and kill["updates_replayed"] == [] and kill["checkpoint"] is None, kill
    # the deadline counts from the dispatch during update 0, before iteration 1's attempt began; the group's own
    # deadline (trainer.deadline_s) is far longer, so catching it this early means the node's deadline applied
    assert hang["error"] == "DeadlineExceededError", hang
    assert HANG_DEADLINE_S / 2 <= hang["seconds_failed_attempt"] <= HANG_DEADLINE_S + 20, hang
    assert hang["updates_replayed"] == ["actor.update_policy@0"], hang
    stacks = list((tmp_path / "faulty" / "stacks").glob("main.actor.generate.rank0.*.txt"))
    assert stacks and "maybe_fail" in stacks[0].read_text()
    assert between["error"] == "WorkerError" and between["checkpoint"].endswith("step-2"), between
    assert between["updates_replayed"] == ["actor.update_policy@2"], between
    assert last["updates_replayed"] == ["actor.update_policy@2", "actor.update_policy@3"], last

    clean_rows, rows = read_ledger(clean_dir), read_ledger(tmp_path / "faulty")
    # the generations of iterations 1 and 3 were submitted ahead (dispatched before their iteration began) in both
    # runs: the faults hit real lookahead calls, and the retries redid them
    for ledger in (clean_rows, rows):
        ahead = [row["nodes"]["actor.generate"]["dispatched_at"] < row["start"] for row in ledger]
        assert ahead == [False, True, False, True], ahead
    audit = audit_ledger(rows, samples_per_prompt=4)
    assert audit.iterations == [0, 1, 2, 3]
    assert audit.mixed_versions == [] and audit.samples_lost == 0 and audit.samples_duplicated == 0
    assert audit.recoveries == 3  # the three iterations that failed say so in their ledger rows
    assert all(row["nodes"]["actor.update_policy"]["policy_versions"] == [row["iteration"]] for row in rows)
    assert [row["metrics"]["actor/policy_version"] for row in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [row["metrics"]["reward/mean"] for row in rows] == [row["metrics"]["reward/mean"] for row in clean_rows]


def test_hang_stops_the_run_within_its_deadline_when_policy_says_stop(tmp_path: Path) -> None:
    # one rank: the stop needs no peer, and each worker process costs seconds of CPU to start
    config = short_config(tmp_path / "stop", "reliability.on_hang=stop", "resource_pools.main.devices_per_node=[1]",
                          faults=["actor.update@0:hang"], deadlines={"actor.update_policy": STOP_DEADLINE_S}, steps=1,
                          every=0)
    trainer = Trainer(config, progress=False)
    try:
        trainer.start()
        started = time.time()
        with pytest.raises(DeadlineExceededError) as info:
            trainer.fit()
        elapsed = time.time() - started
    finally:
        trainer.close()
    assert elapsed <= STOP_DEADLINE_S + 30
    assert "actor.update_policy did not finish within its deadline" in str(info.value)
    assert str(tmp_path / "stop" / "stacks") in str(info.value)
    assert list((tmp_path / "stop" / "stacks").glob("main.actor.update_policy.rank*.txt"))
    assert read_ledger(tmp_path / "stop") == [] and trainer.supervisor.events == []
