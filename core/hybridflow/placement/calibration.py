"""Compare a run's measured node times (``ledger.jsonl``) with the simulator's, and fit its efficiency factors.

Only the per-kind efficiencies are fitted (training, forward-only, generation, transition overhead); the device
peaks and link bandwidths stay as profiled. Writing the ledger is the trainer's job.
Stability: experimental.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.dataflow import Dataflow
from hybridflow.placement.profiles import Efficiency
from hybridflow.placement.record import PlanInputs, PlanRecord, retime_plan
from hybridflow.placement.search import Plan, schedule_dataflow

__all__ = ["read_ledger", "node_seconds", "match_nodes", "NodeComparison", "compare_nodes", "fit_efficiency",
           "fit_efficiency_to_runs", "controller_seconds", "format_comparison", "LEDGER_FILE", "TRAINER_NODES"]

LEDGER_FILE = "ledger.jsonl"

# `hybridflow train` names ledger nodes role.method; each covers these dataflow stages (those the algorithm has).
# The hybrid engine reshards the actor's weights at the start of generate, so weight_sync is timed inside it, and
# ReMax's greedy baseline is a second actor.generate call (the ledger sums both).
TRAINER_NODES: dict[str, tuple[str, ...]] = {
    "actor.generate": ("generate", "generate_baseline", "weight_sync"),
    "actor.compute_log_probs": ("old_log_probs",),
    "reference.compute_ref_log_probs": ("ref_log_probs",),
    "critic.compute_values": ("values",),
    "reward_model.compute_scores": ("reward",),
    "cost_model.compute_scores": ("cost",),
    "critic.update_critic": ("critic_update",),
    "actor.update_policy": ("actor_update",),
}


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """Read ``ledger.jsonl`` rows that carry ``iteration`` and ``nodes``, in file order.

    Raises:
        ConfigError: the file is missing, a line is not JSON, or no row has node times.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / LEDGER_FILE
    rows = []
    try:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number} is not JSON ({exc.msg}); fix or delete that line.") from exc
            if isinstance(row, dict) and isinstance(row.get("nodes"), dict) and "iteration" in row:
                rows.append(row)
    except FileNotFoundError as exc:
        raise ConfigError(f"No ledger at {path}; expected a run directory written by `hybridflow train`.") from exc
    if not rows:
        raise ConfigError(f"Ledger {path} has no rows with 'iteration' and 'nodes'.")
    return rows


def node_seconds(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Each node's measured seconds across ``rows``: ``busy_seconds`` where a row has it, else ``seconds``.

    The trainer's ``seconds`` run from dispatch to the last rank finishing, so a node queued behind another on
    the same pool includes that wait; ``busy_seconds`` (the node's own run time) is preferred when recorded.
    """
    seconds: dict[str, list[float]] = {}
    for row in rows:
        for name, node in row["nodes"].items():
            if not isinstance(node, Mapping):
                continue
            value = node.get("busy_seconds", node.get("seconds"))
            if isinstance(value, int | float):
                seconds.setdefault(name, []).append(float(value))
    return seconds


def match_nodes(stages: Collection[str], measured: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Map each measured node to the simulator stages it covers: its own name if it is a stage (a ledger written
    in stage names), else the stages :data:`TRAINER_NODES` lists for it that ``stages`` has; others are left out."""
    matched: dict[str, tuple[str, ...]] = {}
    for name in measured:
        if name in stages:
            matched[name] = (name,)
        else:
            covered = tuple(stage for stage in TRAINER_NODES.get(name, ()) if stage in stages)
            if covered:
                matched[name] = covered
    return matched


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeComparison:
    """Predicted against observed seconds of one node over a run; ``stages`` are the simulator stages it covers."""

    node: str
    kind: str
    predicted: float
    observed_median: float
    observed_min: float
    observed_max: float
    samples: int
    stages: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """Observed over predicted; > 1 means the node runs slower than the simulator says."""
        return self.observed_median / self.predicted if self.predicted > 0 else float("inf")


def compare_nodes(plan: Plan, rows: Sequence[Mapping[str, Any]], kinds: Mapping[str, str]) -> list[NodeComparison]:
    """One :class:`NodeComparison` per node both predicted by ``plan`` and measured in ``rows``.

    Measured nodes are matched to stages by :func:`match_nodes`; a node covering several stages (the trainer's
    ``actor.generate`` holds generation and the weight sync) is compared with their summed prediction and takes
    the kind of its first stage.
    """
    predicted = {t.name: t.seconds for t in plan.timings}
    measured = node_seconds(rows)
    comparisons = []
    for name, stages in sorted(match_nodes(predicted, measured).items()):
        values = measured[name]
        comparisons.append(NodeComparison(node=name, kind=kinds.get(stages[0], "?"),
                                          predicted=sum(predicted[s] for s in stages),
                                          observed_median=statistics.median(values), observed_min=min(values),
                                          observed_max=max(values), samples=len(values), stages=stages))
    return comparisons


_KIND_FIELDS = {"train": ("train",), "infer": ("infer",), "generate": ("prefill", "decode_bandwidth")}


def fit_efficiency(inputs: PlanInputs, record: PlanRecord, rows: Sequence[Mapping[str, Any]],
                   rounds: int = 6) -> tuple[Efficiency, list[NodeComparison]]:
    """Scale each kind's efficiency so the plan's predicted node times match the observed medians.

    Compute time is inversely proportional to efficiency but communication is not, so the scale is refined by
    fixed-point iteration (``rounds``). Returns the fitted efficiency and the comparison under it.
    """
    dataflow = inputs.dataflow
    kinds = {s.name: s.kind for s in dataflow.stages}
    efficiency = inputs.efficiency
    usable = inputs.cluster.device.memory_bytes * efficiency.usable_memory_fraction
    comparisons: list[NodeComparison] = []
    for _ in range(rounds):
        planner = LayoutPlanner(inputs.simulator(efficiency), dataflow, inputs.models)
        comparisons = compare_nodes(retime_plan(planner, record, usable), rows, kinds)
        factors: dict[str, float] = {}
        overhead = efficiency.transition_overhead_seconds
        for kind in ("train", "infer", "generate", "transition"):
            matched = [c for c in comparisons if c.kind == kind]
            observed = sum(c.observed_median for c in matched)
            predicted = sum(c.predicted for c in matched)
            if not matched or observed <= 0 or predicted <= 0:
                continue
            if kind == "transition":
                overhead = max(0.0, overhead + (observed - predicted) / len(matched))
                continue
            for name in _KIND_FIELDS[kind]:
                factors[name] = predicted / observed
        if all(abs(f - 1) < 1e-3 for f in factors.values()) and overhead == efficiency.transition_overhead_seconds:
            break
        efficiency = replace(efficiency.scaled(**factors), transition_overhead_seconds=overhead)
    return efficiency, comparisons


def _time_nodes(inputs: PlanInputs, record: PlanRecord, rows: Sequence[Mapping[str, Any]], efficiency: Efficiency
                ) -> list[NodeComparison]:
    usable = inputs.cluster.device.memory_bytes * efficiency.usable_memory_fraction
    plan = retime_plan(LayoutPlanner(inputs.simulator(efficiency), inputs.dataflow, inputs.models), record, usable)
    return compare_nodes(plan, rows, {s.name: s.kind for s in inputs.dataflow.stages})


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(vector)
    a = [row[:] + [v] for row, v in zip(matrix, vector)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def _nonnegative_least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """min ‖A·x − b‖ with x ≥ 0, by trying every support set (few unknowns)."""
    n = len(rows[0])
    best, best_error = [0.0] * n, sum(t * t for t in targets)
    for mask in range(1, 2**n):
        support = [j for j in range(n) if mask >> j & 1]
        gram = [[sum(r[i] * r[j] for r in rows) for j in support] for i in support]
        rhs = [sum(r[i] * t for r, t in zip(rows, targets)) for i in support]
        solution = _solve(gram, rhs)
        if solution is None or min(solution) < 0:
            continue
        x = [0.0] * n
        for j, value in zip(support, solution):
            x[j] = value
        error = sum((sum(r[j] * x[j] for j in range(n)) - t) ** 2 for r, t in zip(rows, targets))
        if error < best_error:
            best, best_error = x, error
    return best


def fit_efficiency_to_runs(inputs: PlanInputs, runs: Sequence[tuple[PlanRecord, Sequence[Mapping[str, Any]]]],
                           rounds: int = 4, collective_stall: float | None = None
                           ) -> tuple[Efficiency, list[list[NodeComparison]]]:
    """Fit each kind's compute efficiency, the shared ``sync_latency_seconds``, the collective stall on shared cores
    and the controller's per-iteration time to several runs at once.

    Each measured node is modelled as stretch · (a_kind · compute + fixed + hops · latency (+ the transition
    overhead if it covers the weight sync)): compute and fixed come from re-timing the run's plan at the prior
    efficiency and at half of it, hops from re-timing at a latency of 1 s and 0, all on devices with compute of
    their own. ``stretch`` is how much the cluster's shared cores (:attr:`Cluster.compute_units`) slow the node
    down where stages overlap; it depends on the fit, so with shared cores the fit is repeated ``rounds`` times,
    each time with the stretches of the previous fit (1 without sharing). The scales a_kind, the latency and the
    overhead are the non-negative least-squares solution over every node of every run, weighted by 1/observed
    (relative errors). Runs whose models all have one data-parallel size cannot tell compute from latency; give
    runs of different sizes. With shared cores, :attr:`Efficiency.collective_stall` (unless given) is chosen on a
    grid (0 to 2, steps of 0.05) as the value whose fit leaves the smallest relative node error; it only matters for
    runs with multi-device sets. :attr:`Efficiency.controller_seconds` is :func:`controller_seconds` averaged over
    the runs whose rows carry iteration ``seconds`` (else the prior's). Returns the fitted efficiency and, per run,
    the comparison under it.

    Raises:
        ConfigError: no run has a node both measured and predicted.
    """
    stalls = [0.0] if collective_stall is None else [collective_stall]
    if collective_stall is None and inputs.cluster.compute_units is not None and any(
            max(record.devices) > 1 for record, _ in runs):
        stalls = [step / 20 for step in range(41)]
    fits = [_fit_nodes(inputs, runs, rounds, stall) for stall in stalls]
    efficiency, comparisons = min(fits, key=lambda fit: sum(  # the first (smallest stall) of equals
        (1 - c.predicted / c.observed_median) ** 2 for run in fit[1] for c in run if c.observed_median > 0))
    measured = [seconds for record, rows in runs
                if (seconds := controller_seconds(inputs.dataflow, record.placement, rows)) is not None]
    if measured:
        efficiency = replace(efficiency, controller_seconds=statistics.fmean(measured))
    return efficiency, comparisons


def controller_seconds(dataflow: Dataflow, placement: Sequence[Sequence[str]], rows: Sequence[Mapping[str, Any]]
                       ) -> float | None:
    """The controller's own time per iteration: the median over ``rows`` of the row's ``seconds`` (the iteration)
    minus the dataflow scheduled on ``placement``'s sets with that row's own measured node seconds (dependencies
    and one stage at a time per set; the node times already include any core sharing). What is left is the time no
    node covers: the driver dispatching calls and gathering results, rewards and advantages computed on the driver,
    the ledger. None if no row has ``seconds`` and a measured node.
    """
    set_of_role = {role: index for index, group in enumerate(placement) for role in group}
    names = {stage.name for stage in dataflow.stages}
    residuals = []
    for row in rows:
        iteration = row.get("seconds")
        measured = node_seconds([row])
        if not isinstance(iteration, int | float) or not measured:
            continue
        seconds = dict.fromkeys(names, 0.0)
        for node, stages in match_nodes(names, measured).items():
            seconds[stages[0]] += measured[node][0]  # actor.generate also covers the weight sync
        timings = schedule_dataflow(dataflow, set_of_role, seconds)
        residuals.append(float(iteration) - max(t.end for t in timings))
    return max(0.0, statistics.median(residuals)) if residuals else None


def _fit_nodes(inputs: PlanInputs, runs: Sequence[tuple[PlanRecord, Sequence[Mapping[str, Any]]]], rounds: int,
               collective_stall: float) -> tuple[Efficiency, list[list[NodeComparison]]]:
    """:func:`fit_efficiency_to_runs`' least squares at one ``collective_stall``."""
    prior = replace(inputs.efficiency, sync_latency_seconds=0.0, transition_overhead_seconds=0.0,
                    collective_stall=collective_stall)
    half = prior.scaled(**{name: 0.5 for names in _KIND_FIELDS.values() for name in names})
    own = replace(inputs, cluster=replace(inputs.cluster, compute_units=None))  # every device its own compute
    kinds = list(_KIND_FIELDS)
    terms: list[tuple[int, str, list[float], float, float]] = []  # run, node, coefficients, fixed, observed
    for index, (record, rows) in enumerate(runs):
        at_prior = _time_nodes(own, record, rows, prior)
        at_half = {c.node: c.predicted for c in _time_nodes(own, record, rows, half)}
        at_latency = {c.node: c.predicted for c in _time_nodes(own, record, rows,
                                                                replace(prior, sync_latency_seconds=1.0))}
        for c in at_prior:
            if c.observed_median <= 0 or c.kind not in (*kinds, "transition"):
                continue
            compute = at_half[c.node] - c.predicted
            hops = at_latency[c.node] - c.predicted
            overhead = float(sum(inputs.dataflow.stage(s).kind == "transition" for s in c.stages))
            terms.append((index, c.node, [compute if c.kind == kind else 0.0 for kind in kinds] + [hops, overhead],
                          c.predicted - compute, c.observed_median))
    if not terms:
        raise ConfigError("No measured node matches a predicted stage in any run; check the ledgers' node names "
                          f"against {sorted(TRAINER_NODES)} or the dataflow's stage names.")
    stretch: dict[tuple[int, str], float] = {}
    efficiency = inputs.efficiency
    for _ in range(rounds if inputs.cluster.compute_units is not None else 1):
        matrix, targets = [], []
        for index, node, coefficients, fixed, observed in terms:
            factor = stretch.get((index, node), 1.0)
            matrix.append([factor * value / observed for value in coefficients])
            targets.append((observed - factor * fixed) / observed)
        solution = _nonnegative_least_squares(matrix, targets)
        factors: dict[str, float] = {}
        for index, kind in enumerate(kinds):
            if any(row[index] for row in matrix):  # a kind no run measured keeps its prior efficiency
                for name in _KIND_FIELDS[kind]:
                    factors[name] = 1 / solution[index] if solution[index] > 0 else 1e4
        overhead = solution[-1] if any(row[-1] for row in matrix) else inputs.efficiency.transition_overhead_seconds
        efficiency = replace(prior.scaled(**factors), sync_latency_seconds=solution[-2],
                             transition_overhead_seconds=overhead)
        if inputs.cluster.compute_units is None:
            break
        for index, (record, rows) in enumerate(runs):
            alone = {c.node: c.predicted for c in _time_nodes(own, record, rows, efficiency)}
            for c in _time_nodes(inputs, record, rows, efficiency):
                if alone.get(c.node, 0.0) > 0:
                    stretch[(index, c.node)] = c.predicted / alone[c.node]
    return efficiency, [_time_nodes(inputs, record, rows, efficiency) for record, rows in runs]


def format_comparison(comparisons: Sequence[NodeComparison]) -> str:
    """A plain-text table of predicted vs observed seconds per node."""
    lines = [f"{'node':<16} {'kind':<10} {'predicted s':>12} {'observed s':>11} {'min':>8} {'max':>8} {'obs/pred':>8}"]
    for c in comparisons:
        lines.append(f"{c.node:<16} {c.kind:<10} {c.predicted:>12.3f} {c.observed_median:>11.3f} "
                     f"{c.observed_min:>8.3f} {c.observed_max:>8.3f} {c.ratio:>8.2f}")
    return "\n".join(lines)
