"""Two trainers in one process: each hears only its own group calls (observers belong to the run, not the process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridflow.controller import CallRecord
from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer


@pytest.mark.slow  # two trainers' worker processes at once (neither can use the other's parked ones): 44-62 s in CI
def test_two_trainers_do_not_hear_each_others_calls(tmp_path: Path, tiny_config: Any) -> None:
    overrides = ("trainer.total_steps=1", "trainer.checkpoint_every=0")
    first, second = (Trainer(tiny_config(tmp_path / name, *overrides)) for name in ("first", "second"))
    heard: dict[str, list[CallRecord]] = {"first": [], "second": []}
    first.call_observers.append(heard["first"].append)
    second.call_observers.append(heard["second"].append)
    try:
        first.start()
        second.start()
        assert {id(group.observers) for group in first.groups.by_pool.values()} == {id(first.call_observers)}
        second.train_step()
        assert heard["first"] == [] and {"actor.generate", "actor.update_policy"} <= {
            f"{r.role}.{r.method}" for r in heard["second"]}
        calls_of_second = len(heard["second"])
        first.train_step()
        assert len(heard["second"]) == calls_of_second  # the first run's calls reach the first run's observers only
        assert {"actor.generate", "actor.update_policy"} <= {f"{r.role}.{r.method}" for r in heard["first"]}
    finally:
        first.close()
        second.close()
    assert [row["iteration"] for row in read_ledger(tmp_path / "first")] == [0]
    assert [row["iteration"] for row in read_ledger(tmp_path / "second")] == [0]
