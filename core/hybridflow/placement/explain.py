"""Why the search chose what it chose, in the cost model's own terms: the stage seconds each kind of placement
overlaps and the device time it leaves idle (:func:`explain_choice`), and what a standalone plan's separate
scoring devices buy (:func:`merge_forward_only_sets`, :func:`explain_standalone`: the same devices with the
forward-only models moved onto the trainer that does not generate). docs/design/placement.md, "The paper's grid against
ours". Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.dataflow import Dataflow
from hybridflow.placement.models import ModelSpec
from hybridflow.placement.search import Placement, Plan, evaluate_placement
from hybridflow.placement.simulator import Simulator

__all__ = ["explain_choice", "merge_forward_only_sets", "explain_standalone"]


def explain_choice(best: Plan, others: Sequence[Plan]) -> str:
    """Why ``best`` beats the best plan of each other kind among ``others``, in the cost model's own terms: the
    stage seconds a placement overlaps across disjoint sets against the device time it leaves idle (a model on
    fewer devices runs each stage longer; a set with nothing to run waits)."""
    parts = [f"{best.kind} {best.iteration_seconds:.1f} s (overlaps {best.overlap_seconds:.1f} s of stages, "
             f"{best.idle_fraction():.0%} of device time idle)"]
    seen = {best.kind}
    for plan in sorted(others, key=lambda p: p.iteration_seconds):
        if plan.kind in seen:
            continue
        seen.add(plan.kind)
        idle = max(plan.idle_seconds_per_set().items(), key=lambda item: item[1])
        slower = plan.iteration_seconds / best.iteration_seconds - 1
        parts.append(f"{plan.kind} {plan.iteration_seconds:.1f} s (+{slower:.0%}: "
                     f"overlaps {plan.overlap_seconds:.1f} s, {plan.idle_fraction():.0%} of device time idle, "
                     f"{{{idle[0]}}} idle {idle[1]:.1f} s of {plan.iteration_seconds:.1f})")
    return "; ".join(parts)


def _forward_only_merge(plan: Plan, dataflow: Dataflow) -> tuple[list[int], int] | None:
    """Indices of ``plan``'s sets that hold only forward-only models, and the set to merge them into."""
    stages = {role: [s for s in dataflow.stages if s.role == role] for role in dataflow.roles}
    forward_only = {role for role, own in stages.items() if own and all(s.kind == "infer" for s in own)}
    generating = {s.role for s in dataflow.stages if s.kind == "generate"}
    targets = [role for role in dataflow.roles if role in dataflow.trainable and role not in generating] \
        or sorted(generating)
    merged = [i for i, group in enumerate(plan.placement) if set(group) <= forward_only]
    into = next((i for role in targets for i, group in enumerate(plan.placement) if role in group), None)
    if not merged or into is None or into in merged:
        return None
    return merged, into


def _apply_merge(plan: Plan, merged: list[int], into: int) -> tuple[Placement, tuple[int, ...]]:
    keep = [i for i in range(len(plan.placement)) if i not in merged]
    moved = tuple(role for i in merged for role in plan.placement[i])
    placement = tuple(plan.placement[i] + (moved if i == into else ()) for i in keep)
    devices = tuple(plan.devices[i] + (sum(plan.devices[j] for j in merged) if i == into else 0) for i in keep)
    return placement, devices


def merge_forward_only_sets(plan: Plan, dataflow: Dataflow) -> tuple[Placement, tuple[int, ...]] | None:
    """``plan``'s placement with every set of forward-only models (each stage a forward pass: PPO's reference and
    reward) moved, devices and all, onto the set of the model that trains without generating (the critic; the
    generating model's set if there is none). Same devices, same models: only side by side becomes one after
    another on the union. None if ``plan`` has no such set or nothing to merge it into.

    With stage times that fall as 1/devices the merged plan is never slower: its scoring on the union takes the
    device-weighted mean of the side-by-side times, at most their maximum, and the target model gains devices.
    """
    found = _forward_only_merge(plan, dataflow)
    return None if found is None else _apply_merge(plan, *found)


def explain_standalone(simulator: Simulator, dataflow: Dataflow, models: Mapping[str, ModelSpec], plan: Plan
                       ) -> tuple[Plan, str] | None:
    """Re-time ``plan`` (standalone, or any plan with sets of forward-only models) with those sets merged as
    :func:`merge_forward_only_sets` does, and say what the separate devices bought: the merged plan and a one-line
    comparison, or None if there is nothing to merge or the merged sets do not fit."""
    found = _forward_only_merge(plan, dataflow)
    if found is None:
        return None
    merged, into = found
    planner = LayoutPlanner(simulator, dataflow, models)
    usable = simulator.cluster.device.memory_bytes * simulator.efficiency.usable_memory_fraction
    other, _ = evaluate_placement(planner, *_apply_merge(plan, merged, into), usable)
    if other is None:
        return None
    role = plan.placement[merged[0]][0]
    stage = next(s.name for s in dataflow.stages if s.role == role)
    before, after = plan.layouts[role], other.layouts[role]
    idle = plan.idle_seconds_per_set()
    scoring_idle = min(idle["+".join(plan.placement[i])] for i in merged) / plan.iteration_seconds
    change = other.iteration_seconds / plan.iteration_seconds - 1
    speedup = before.stage_seconds[stage] / after.stage_seconds[stage]
    verdict = ("so scoring side by side saves nothing over one after another on the union, whose devices also "
               f"train {plan.placement[into][0]}, while the separate scoring sets idle ≥ {scoring_idle:.0%} of the "
               "iteration") if change <= 0 else "so here side by side is the faster way to score"
    text = (f"{plan.describe()} {plan.iteration_seconds:.1f} s; on the same devices {other.describe()} "
            f"{other.iteration_seconds:.1f} s ({change:+.0%}): {role}'s {stage} runs {speedup:.1f}× faster on "
            f"{after.devices / before.devices:.1f}× the devices ({before.devices} → {after.devices}), {verdict}")
    return other, text
