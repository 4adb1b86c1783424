"""The ledger's idle gaps on schedules whose idle time is known, and its rows on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.ledger import IterationRecord, Ledger, read_ledger


def test_idle_gaps_count_the_time_no_node_ran() -> None:
    record = IterationRecord(iteration=0, policy_version=0, start=100.0, end=110.0)
    # pool "a": busy [100, 100.5] (a node dispatched before the iteration, clipped), [101, 104] (two overlapping
    # nodes count once), [106, 107], [109, 110] (clipped at the end) → busy 5.5 s, idle 4.5 s
    for start, end in [(95.0, 100.5), (101.0, 103.0), (102.0, 104.0), (106.0, 107.0), (109.0, 112.0)]:
        record.add_node("actor.generate", pool="a", start=start, end=end)
    record.add_node("critic.values", pool="b", start=99.0, end=111.0)  # busy the whole iteration
    record.add_node("reward_model.scores", pool="c", start=103.0, end=104.0)
    record.add_node("reward_model.scores", pool="c", start=103.5, end=103.75)  # nested: adds nothing
    record.add_node("reward_model.scores", pool="c", start=90.0, end=95.0)  # wholly before the iteration
    gaps = record.idle_gaps()
    assert gaps == pytest.approx({"a": 4.5, "b": 0.0, "c": 9.0}, abs=1e-9)


def test_commit_writes_the_row_with_its_idle_seconds(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    record = ledger.begin(3, policy_version=3)
    record.start, record.end = 10.0, 14.0
    record.add_node("actor.update_policy", pool="main", start=11.0, end=12.5)
    ledger.commit(record)
    (row,) = read_ledger(tmp_path)
    assert row["iteration"] == 3 and row["seconds"] == 4.0
    assert row["idle_seconds"] == {"main": pytest.approx(2.5)}
    assert row["nodes"]["actor.update_policy"]["seconds"] == 1.5
