"""AdamW and its learning-rate schedule (linear warmup, then constant, linear or cosine decay) from ``OptimConfig``.

Gradient accumulation, clipping and when to step are the training engine's business.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from hybridflow.engines import OptimConfig
from hybridflow.errors import ConfigError

__all__ = ["build_optimizer", "build_scheduler", "compute_lr_factor", "count_state_bytes"]


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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (the local shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def count_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """What this rank holds, counted from its tensors (local shards): ``weight_bytes`` (every parameter),
    ``trainable_params`` and ``trainable_weight_bytes`` (those with ``requires_grad``), ``optimizer_state_bytes``
    (every tensor in the optimizer's state: AdamW's moments and step counts) and ``optimizer_params`` (parameters
    the optimizer steps)."""
    weights = [_local(p) for p in model.parameters()]
    trainable = [_local(p) for p in model.parameters() if p.requires_grad]
    stepped = [_local(p) for group in optimizer.param_groups for p in group["params"]] if optimizer else []
    state = list(_state_tensors(optimizer)) if optimizer is not None else []
    return {
        "weight_bytes": sum(t.numel() * t.element_size() for t in weights),
        "trainable_params": sum(t.numel() for t in trainable),
        "trainable_weight_bytes": sum(t.numel() * t.element_size() for t in trainable),
        "optimizer_params": sum(t.numel() for t in stepped),
        "optimizer_state_bytes": sum(_local(t).numel() * _local(t).element_size() for t in state),
    }
