"""Small helpers the drivers share: decoding responses, π_old from the rollout, averaging per-rank metrics.

The RL math is :mod:`~hybridflow.algorithms.advantages`' and :mod:`~hybridflow.algorithms.losses`'.
"""

from __future__ import annotations

from typing import Any

from hybridflow.batch import Batch

__all__ = ["decode_batch", "fill_old_log_probs", "mean_over_ranks"]


def decode_batch(tokenizer: Any, sequences: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(sequences, skip_special_tokens=True)``; for a fast tokenizer without clean-up, the
    same text straight from its ``backend_tokenizer`` (skipping transformers' per-element input conversion, which
    costs more than the decoding)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch") and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True):
        return list(backend.decode_batch(sequences, skip_special_tokens=True))
    return list(tokenizer.batch_decode(sequences, skip_special_tokens=True))


def fill_old_log_probs(batch: Batch) -> Batch:
    """Use the rollout's log-probs as π_old when the actor did not recompute them (one on-policy pass)."""
    if "old_log_probs" not in batch:
        batch["old_log_probs"] = batch["rollout_log_probs"].detach().clone()
    return batch


def mean_over_ranks(metrics: Any) -> dict[str, float]:
    """Average per-rank metric dicts (a blocking data-parallel call returns one per rank)."""
    if isinstance(metrics, dict):
        return {k: float(v) for k, v in metrics.items()}
    rows = [m for m in metrics if m]
    keys = sorted({k for m in rows for k in m})
    return {k: sum(float(m[k]) for m in rows if k in m) / sum(1 for m in rows if k in m) for k in keys}
