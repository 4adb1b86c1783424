"""Adapter-only weight sync for LoRA actors: the contract between a training engine that hands over its LoRA factors
and a rollout engine that applies them to a base copy it keeps (TRL #5975, SkyRL #1336, verl #3715).

The actor worker (:mod:`hybridflow.workers.roles`) uses it when both engines implement it and the actor trains
adapters: the first handover (and any after the rollout engine dropped its weights) sends the *base* weights once
plus the adapters; every later one sends only the adapter factors (``….lora_A`` [rank, in], ``….lora_B``
[out, rank] per wrapped module), so the bytes per sync are the adapter's, not the model's. The rollout engine then
keeps its weights between generate calls (it does not sleep): that is the price, the base resident during training.
Both calls carry the policy version, which the rollout engine records as ``weights_version`` as ``update_weights``
does, so the worker's version check is unchanged. Stability: developer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch

__all__ = ["HandsOverAdapters", "LoadsAdapters"]


@runtime_checkable
class HandsOverAdapters(Protocol):
    """Training side. ``adapter_scales()``: wrapped module name → ``alpha / rank``, empty when this engine has no
    adapters to hand over (no LoRA, or adapter sync turned off); ``generation_base_weights(target=...)``: the base
    weights without the adapters, by HF name, full tensors (tg = 1); ``generation_adapters()``: every factor, whole.
    Both are collectives (every rank consumes the whole iterator) and set ``last_handover_stats``."""

    def adapter_scales(self) -> dict[str, float]: ...

    def generation_base_weights(self, *, target: str = "hf") -> Iterable[tuple[str, torch.Tensor]]: ...

    def generation_adapters(self) -> Iterable[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class LoadsAdapters(Protocol):
    """Rollout side. ``update_adapters(named, scales=..., version=...)`` sets every wrapped module's weight to its base
    (the weights the last ``update_weights`` loaded) plus ``B·A·scale``, and records ``version``."""

    def update_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, scales: Mapping[str, float],
                        version: int) -> None: ...
