"""Trainer side of the distributed weight handover to an SGLang engine on another resource pool: join the weight
update group as rank 0 and broadcast each bucket while the engine runs ``update_weights_from_distributed``.

The controller runs both sides concurrently (the trainer's ``connect``/``send_bucket`` and the rollout worker's
``init_weights_update_group``/``update_weights_from_distributed``); this module neither schedules that nor owns the
engine. Stability: public.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from hybridflow.errors import EngineError
from hybridflow_sglang.api import load_sglang_backend
from hybridflow_sglang.engine import WeightSpec, iter_weight_buckets

__all__ = ["SGLangWeightSender", "describe_bucket", "plan_weight_buckets", "format_init_method"]


def format_init_method(master_address: str, master_port: int) -> str:
    """``tcp://host:port`` as sglang's receivers build it (IPv6 hosts in brackets)."""
    host = f"[{master_address}]" if ":" in master_address and not master_address.startswith("[") else master_address
    return f"tcp://{host}:{master_port}"


def describe_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[WeightSpec]:
    """The specs the receiving engine needs to allocate a bucket, in broadcast order."""
    return [
        WeightSpec(name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape))
        for name, tensor in bucket
    ]


def plan_weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                        bucket_bytes: int = 512 << 20) -> list[list[tuple[str, torch.Tensor]]]:
    """Split the weights into broadcast buckets (each becomes one ``update_weights_from_distributed`` call)."""
    return list(iter_weight_buckets(named_tensors, bucket_bytes=bucket_bytes))


class SGLangWeightSender:
    """Rank 0 of an SGLang weight update group (stability: public).

    ``init_process_group`` defaults to sglang's ``init_custom_process_group`` (the group the engine's ranks create
    with the same store prefix); tests pass a stand-in.
    """

    def __init__(self, *, init_process_group: Callable[..., Any] | None = None) -> None:
        self._init_process_group = init_process_group
        self._group: Any = None
        self.bytes_sent = 0

    def connect(self, *, master_address: str, master_port: int, world_size: int,
                group_name: str = "hybridflow_weights", backend: str = "nccl") -> None:
        """Create the group (blocks until the engine's ``tp_size`` ranks join)."""
        init = self._init_process_group or load_sglang_backend().init_custom_process_group
        self._group = init(backend=backend, init_method=format_init_method(master_address, master_port),
                           world_size=world_size, rank=0, group_name=group_name)

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Broadcast one bucket tensor by tensor in ``describe_bucket`` order; returns the bytes sent."""
        if self._group is None:
            raise EngineError("SGLangWeightSender.send_bucket before connect(); call connect(...) first.")
        sent = 0
        for _, tensor in bucket:
            tensor = tensor.detach().contiguous()
            torch.distributed.broadcast(tensor, src=0, group=self._group)
            sent += tensor.numel() * tensor.element_size()
        self.bytes_sent += sent
        return sent

    def close(self) -> None:
        """Destroy the group (the engine side calls ``destroy_weights_update_group``)."""
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None
