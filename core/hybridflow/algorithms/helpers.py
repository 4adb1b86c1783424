"""Small helpers the drivers share: decoding responses (:func:`hybridflow.detokenize.decode_batch`), π_old from
the rollout, averaging per-rank metrics.

The RL math is :mod:`~hybridflow.algorithms.advantages`' and :mod:`~hybridflow.algorithms.losses`'.
"""

from __future__ import annotations

from typing import Any

from hybridflow.batch import Batch
from hybridflow.detokenize import decode_batch

__all__ = ["combine_chunk_metrics", "decode_batch", "fill_old_log_probs", "mean_over_chunks_and_ranks",
           "mean_over_ranks", "split_prompt_chunks", "stream_chunk_count"]


def fill_old_log_probs(batch: Batch) -> Batch:
    """Use the rollout's log-probs as π_old when the actor did not recompute them (one on-policy pass)."""
    if "old_log_probs" not in batch:
        batch["old_log_probs"] = batch["rollout_log_probs"].detach().clone()
    return batch


def mean_over_ranks(metrics: Any) -> dict[str, float]:
    """Average per-rank metric dicts (a blocking data-parallel call returns one per rank); the ranks' update tokens
    (:data:`hybridflow.workers.base.RANK_TOKENS_METRIC`) become verl's ``global_seqlen/min|max|minmax_diff|mean``
    (how evenly ``mesh_balanced`` dealt them)."""
    from hybridflow.workers.base import RANK_TOKENS_METRIC

    rows = _rank_rows(metrics)
    keys = sorted({k for m in rows for k in m} - {RANK_TOKENS_METRIC})
    out = {k: sum(float(m[k]) for m in rows if k in m) / sum(1 for m in rows if k in m) for k in keys}
    out.update(_global_seqlen([float(m[RANK_TOKENS_METRIC]) for m in rows if RANK_TOKENS_METRIC in m]))
    return out


def mean_over_chunks_and_ranks(chunks: list[Any]) -> dict[str, float]:
    """One streamed update's metrics from its chunks' per-rank results (in chunk order, each as
    :func:`mean_over_ranks` takes it): the chunks' rank means combined by :func:`combine_chunk_metrics`, and
    ``global_seqlen/*`` of the tokens each rank trained over the whole step (its chunks' counts summed), as a step
    trained in one update reports them."""
    from hybridflow.workers.base import RANK_TOKENS_METRIC

    per_chunk = [_rank_rows(chunk) for chunk in chunks]
    out = combine_chunk_metrics([mean_over_ranks([{k: v for k, v in m.items() if k != RANK_TOKENS_METRIC}
                                                  for m in rows]) for rows in per_chunk])
    totals: dict[int, float] = {}
    for rows in per_chunk:
        for rank, m in enumerate(rows):
            if RANK_TOKENS_METRIC in m:
                totals[rank] = totals.get(rank, 0.0) + float(m[RANK_TOKENS_METRIC])
    out.update(_global_seqlen(list(totals.values())))
    return out


def _rank_rows(metrics: Any) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in metrics.items()}] if isinstance(metrics, dict) else [m for m in metrics if m]


def _global_seqlen(tokens: list[float]) -> dict[str, float]:
    if not tokens:
        return {}
    return {"global_seqlen/min": min(tokens), "global_seqlen/max": max(tokens),
            "global_seqlen/minmax_diff": max(tokens) - min(tokens), "global_seqlen/mean": sum(tokens) / len(tokens)}


def stream_chunk_count(config: Any) -> int:
    """Chunks of a streamed step (``trainer.stream_mini_batches``): one per actor mini-batch; 1 when not streaming."""
    if not config.trainer.stream_mini_batches:
        return 1
    return int(config.data.batch_size * config.rollout.n // config.actor.mini_batch_size)


def split_prompt_chunks(prompts: Batch, chunks: int) -> list[Batch]:
    """``prompts`` in ``chunks`` equal runs of consecutive prompts (whole prompt groups once generated), each tagged
    ``chunk`` (its index) and ``chunks`` in its meta: the rollout pool generates them, the step claims them so."""
    if chunks < 1 or len(prompts) % chunks:
        raise ValueError(f"cannot split {len(prompts)} prompts into {chunks} equal chunks; expected a divisor")
    size = len(prompts) // chunks
    return [prompts.slice(index * size, (index + 1) * size).with_meta(chunk=index, chunks=chunks)
            for index in range(chunks)]


def combine_chunk_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One update's metrics from its chunks' (in order): a training engine reports the mean over its mini-batches,
    so each chunk's (one mini-batch) value is summed in order and divided by the chunks (the sum the engine takes
    over its mini-batches); ``optimizer_steps`` are summed; the learning rate, memory and version are the last
    chunk's (the state after the update)."""
    last = {"lr", "actor/policy_version"}
    out: dict[str, float] = {}
    for key in dict.fromkeys(key for part in parts for key in part):
        values = [part[key] for part in parts if key in part]
        if key == "optimizer_steps":
            out[key] = float(sum(values))
        elif key in last or key.startswith("memory/"):
            out[key] = values[-1]
        else:
            out[key] = sum(values) / len(values)
    return out
