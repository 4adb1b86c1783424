"""The gradient-accumulation contract between a loss and a training engine (stability: public).

Before each ``loss_fn(outputs, micro_batch)`` a training engine sets ``micro_batch.meta[LOSS_SCALE_TOKENS]`` and
``[LOSS_SCALE_ROWS]`` to the mini-batch's valid response tokens and rows, all-reduced over the data-parallel ranks
and divided by their number (:func:`compute_loss_scale` counts one rank's mini-batch; ``is_padding`` rows excluded),
and calls ``backward()`` on the returned loss unweighted; the loss divides by them, so that micro-batches sum to the
mini-batch's mean whatever their sizes. The losses (:mod:`hybridflow.algorithms.losses`) read the keys; the engines
(plugins) set them: both import this module, neither imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridflow.errors import EngineError

if TYPE_CHECKING:
    from hybridflow.batch import Batch

__all__ = ["LOSS_SCALE_TOKENS", "LOSS_SCALE_ROWS", "compute_loss_scale"]

#: ``meta`` key: the mini-batch's valid response tokens (what ``token-mean`` divides by)
LOSS_SCALE_TOKENS = "loss_scale_tokens"
#: ``meta`` key: the mini-batch's rows with at least one valid response token (what the ``seq-mean-*`` modes divide by)
LOSS_SCALE_ROWS = "loss_scale_rows"


def compute_loss_scale(batch: Batch) -> dict[str, float]:
    """The ``meta`` entries of the accumulation convention for ``batch`` (a whole mini-batch on this rank).

    Raises:
        hybridflow.errors.EngineError: ``batch`` has no ``response_mask`` column (what the loss covers).
    """
    from hybridflow.batch import PADDING_KEY

    if "response_mask" not in batch.tensors.keys():
        raise EngineError(f'the mini-batch has no column "response_mask" (marks the tokens the loss covers); '
                          f"columns: {', '.join(batch.keys())}. Add it in the driver before calling train_step.")
    mask = batch.tensors["response_mask"]
    valid = mask if mask.dtype == torch.bool else mask != 0
    if PADDING_KEY in batch.tensors.keys():
        valid = valid & ~batch.tensors[PADDING_KEY][:, None]
    return {LOSS_SCALE_TOKENS: float(valid.sum()), LOSS_SCALE_ROWS: float(valid.any(dim=1).sum())}
