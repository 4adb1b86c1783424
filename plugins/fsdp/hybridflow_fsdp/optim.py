"""AdamW and its learning-rate schedule (linear warmup, then constant, linear or cosine decay) from ``OptimConfig``.

Gradient accumulation, clipping and when to step are the training engine's business.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from hybridflow.engines import OptimConfig
from hybridflow.errors import ConfigError

__all__ = ["build_optimizer", "build_scheduler", "compute_lr_factor"]


def build_optimizer(parameters: Iterable[torch.nn.Parameter], config: OptimConfig, *,
                    foreach: bool = False, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over ``parameters``: the single-tensor path by default (it works on DTensor shards on every device),
    the multi-tensor ``foreach`` path or the ``fused`` kernel (one per parameter, CPU and CUDA) for plain tensors."""
    return torch.optim.AdamW(
        list(parameters), lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
        **({"fused": True} if fused else {"foreach": foreach}),
    )


def compute_lr_factor(step: int, config: OptimConfig) -> float:
    """Multiplier of ``config.lr`` at optimizer step ``step`` (0-based)."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    if config.total_steps <= config.warmup_steps:
        raise ConfigError(
            f'schedule "{config.schedule}" needs total_steps > warmup_steps; got total_steps={config.total_steps}, '
            f"warmup_steps={config.warmup_steps}. Set optim.total_steps to the number of optimizer steps."
        )
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    if config.schedule == "linear":
        decay = 1.0 - progress
    elif config.schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ConfigError(f'schedule must be "constant", "linear" or "cosine", got {config.schedule!r}')
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`compute_lr_factor`; call ``step()`` after every optimizer step."""
    compute_lr_factor(config.total_steps, config)  # validate the schedule now, not at step N
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: compute_lr_factor(step, config))
