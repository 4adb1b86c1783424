"""verl's timing and throughput metrics of a step, from the iteration's ledger record: ``timing_s/step``,
``timing_s/<phase>`` per dataflow node (verl's phase names where one exists: ``gen``, ``old_log_prob``, ``ref``,
``values``, ``update_critic``, ``update_actor``, ``reward``; ``timing_s/<role>.<method>`` otherwise), and
``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput`` (prompt+response tokens per second per worker
rank, verl's per-GPU figure).

A node's seconds run from its dispatch to its last rank's report, summed over its calls in the step; a generation
submitted ahead (overlapped with the previous step) is counted in the step that consumes it, so phases can add up
to more than ``timing_s/step``."""

from __future__ import annotations

from collections.abc import Iterable

from hybridflow.ledger import NodeRecord

__all__ = ["VERL_PHASES", "timing_metrics", "is_timing_metric"]

#: worker method → verl's ``timing_s/`` name
VERL_PHASES = {
    "generate": "gen",
    "compute_log_probs": "old_log_prob",
    "compute_ref_log_probs": "ref",
    "compute_values": "values",
    "update_critic": "update_critic",
    "update_policy": "update_actor",
    "update_policy_chunk": "update_actor",
    "compute_scores": "reward",
}


def timing_metrics(nodes: Iterable[NodeRecord], *, step_s: float, tokens: float, ranks: int) -> dict[str, float]:
    """The step's ``timing_s/`` and ``perf/`` metrics (see the module docstring); ``ranks``: worker ranks in all
    pools (at least 1)."""
    metrics = {"timing_s/step": step_s, "perf/time_per_step": step_s, "perf/total_num_tokens": tokens,
               "perf/throughput": tokens / max(step_s, 1e-9) / max(ranks, 1)}
    for node in nodes:
        method = node.name.rpartition(".")[2]
        key = f"timing_s/{VERL_PHASES.get(method, node.name)}"
        metrics[key] = metrics.get(key, 0.0) + node.seconds
    return metrics


def is_timing_metric(key: str) -> bool:
    """Whether ``key`` measures time (differs between otherwise identical runs): what run comparisons leave out."""
    return key.startswith(("timing_s/", "perf/", "time/", "throughput/"))
