"""Dynamic sampling (DAPO, Yu et al. 2025; verl's ``algorithm.filter_groups``): a step trains only on prompt groups
whose responses disagree on the filter metric — a group whose n rewards are all equal has zero group-relative
advantage and teaches nothing — and draws more prompts from the data loader until the batch is full again.

``algorithm.filter_groups: {enable, metric, max_num_gen_batches}`` as verl names them. ``metric`` is ``score``
(the reward function's per-sequence score, the batch's ``scores``) or any other per-row numeric column of the
scored batch. ``max_num_gen_batches`` bounds the generation batches of one step (≤ 0: unbounded). Where verl raises
once the bound is reached, a step here trains on a full batch: the informative groups found, topped up with the
first uninformative ones in generation order (``train/filter_groups_exhausted`` = 1 says it happened), so the step
keeps its shape and a run that has solved its training prompts carries on.

Metrics (per step): ``train/num_gen_batches`` (verl's name), ``train/informative_group_ratio`` (over every group
generated this step) and ``train/filter_groups_exhausted``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.batch import Batch

__all__ = ["fill_informative_groups", "group_is_informative"]


def group_is_informative(values: torch.Tensor, n: int) -> list[bool]:
    """Per consecutive group of ``n`` rows: do its values differ (max − min > 1e-6)?"""
    if values.dim() != 1 or values.shape[0] % n:
        raise ValueError(f"filter_groups: expected one value per row in groups of rollout.n = {n}, got a tensor of "
                         f"shape {tuple(values.shape)}")
    groups = values.detach().double().view(-1, n)
    return ((groups.max(dim=1).values - groups.min(dim=1).values) > 1e-6).tolist()


def _metric_values(batch: Batch, metric: str) -> torch.Tensor:
    column = "scores" if metric == "score" else metric
    if column not in batch:
        raise ValueError(f"algorithm.filter_groups.metric = {metric!r}: the scored batch has no column {column!r} "
                         f"(columns: {sorted(batch.keys())}). Fix: use 'score' (the reward's per-sequence score) or "
                         "the name of a per-row column the reward writes")
    values = batch[column]
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor([float(v) for v in values])
    return values.reshape(len(batch), -1).sum(dim=1) if values.dim() > 1 else values


def fill_informative_groups(first: Batch, *, n: int, groups_wanted: int, metric: str, max_num_gen_batches: int,
                            generate_more: Callable[[], Batch]) -> tuple[Batch, dict[str, float]]:
    """The step's training batch: ``groups_wanted`` groups of ``n`` rows whose ``metric`` values differ, collected
    from ``first`` and, while too few, from more scored rollouts (``generate_more()``, one generation batch each).
    Stops drawing at ``max_num_gen_batches`` generation batches (≤ 0: never) and then tops the batch up with
    uninformative groups in generation order. Returns (the batch, its metrics)."""
    informative: list[Batch] = []
    spare: list[Batch] = []
    found = seen = 0
    batches = 0
    scored: Batch | None = first
    while scored is not None:
        batches += 1
        flags = group_is_informative(_metric_values(scored, metric), n)
        seen += len(flags)
        keep = [row for group, good in enumerate(flags) if good for row in range(group * n, (group + 1) * n)]
        rest = [row for group, good in enumerate(flags) if not good for row in range(group * n, (group + 1) * n)]
        if keep:
            informative.append(scored.index(keep))
            found += len(keep) // n
        if rest and sum(len(b) for b in spare) < groups_wanted * n:
            spare.append(scored.index(rest))
        scored = None
        if found < groups_wanted and (max_num_gen_batches <= 0 or batches < max_num_gen_batches):
            scored = generate_more()
    exhausted = found < groups_wanted
    parts = informative + (spare if exhausted else [])
    batch = _concat(parts).slice(0, groups_wanted * n)
    metrics = {"train/num_gen_batches": float(batches), "train/informative_group_ratio": found / max(seen, 1),
               "train/filter_groups_exhausted": float(exhausted)}
    return batch, metrics


def _concat(parts: list[Batch]) -> Batch:
    tensors = [key for key in parts[0].keys() if isinstance(parts[0][key], torch.Tensor)]
    widths = {key: {tuple(part[key].shape[1:]) for part in parts} for key in tensors}
    uneven = {key: sorted(shapes) for key, shapes in widths.items() if len(shapes) > 1}
    if uneven:
        raise ValueError(f"filter_groups: generation batches of one step came back with different widths {uneven}; "
                         "dynamic sampling needs the rollout engine to pad responses to rollout.max_new_tokens and "
                         "prompts to data.max_prompt_length, as the shipped engines do")
    return Batch.concat(parts)
