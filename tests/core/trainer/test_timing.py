"""verl's ``timing_s/`` and ``perf/`` names from a step's ledger nodes (the trainer's path: tests/e2e/test_train.py)."""

from __future__ import annotations

import pytest

from hybridflow.ledger import NodeRecord
from hybridflow.trainer.timing import is_timing_metric, timing_metrics


def _node(name: str, seconds: float) -> NodeRecord:
    return NodeRecord(name=name, pool="main", start=100.0, end=100.0 + seconds)


def test_phases_take_verls_names_and_sum_over_calls() -> None:
    nodes = [_node("actor.generate", 0.5), _node("actor.compute_log_probs", 0.25),
             _node("reference.compute_ref_log_probs", 0.125), _node("critic.compute_values", 0.0625),
             _node("critic.update_critic", 1.0), _node("actor.update_policy_chunk", 0.75),
             _node("actor.update_policy_chunk", 0.25), _node("reward.compute_scores", 2.0), _node("judge.rank", 3.0)]
    metrics = timing_metrics(nodes, step_s=4.0, tokens=1000.0, ranks=4)
    assert metrics == {
        "timing_s/step": 4.0, "perf/time_per_step": 4.0, "perf/total_num_tokens": 1000.0, "perf/throughput": 62.5,
        "timing_s/gen": 0.5, "timing_s/old_log_prob": 0.25, "timing_s/ref": 0.125, "timing_s/values": 0.0625,
        "timing_s/update_critic": 1.0, "timing_s/update_actor": 1.0, "timing_s/reward": 2.0,
        "timing_s/judge.rank": 3.0,  # a method verl has no name for keeps its node's name
    }
    assert timing_metrics([], step_s=0.0, tokens=10.0, ranks=0)["perf/throughput"] == pytest.approx(1e10)


def test_timing_metrics_are_told_apart_from_learning_ones() -> None:
    assert all(is_timing_metric(k) for k in ("timing_s/gen", "perf/throughput", "time/step_s",
                                              "throughput/prompt_response_tokens_per_s"))
    assert not any(is_timing_metric(k) for k in ("reward/mean", "actor/pg_loss", "val-core/arith/acc/mean@1"))
