"""Methods mixed into every vLLM worker (``LLM(worker_extension_cls=...)``) so weights arrive without touching disk.

It loads Hugging Face-named tensors through the worker's own ``reload_weights``; choosing the weights and keeping
the policy version is :class:`hybridflow_vllm.engine.VllmRolloutEngine`'s job. Imported by vLLM inside the worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["WORKER_EXTENSION", "HybridflowWorkerExtension", "refresh_tied_lm_head"]

#: import path vLLM resolves inside each worker
WORKER_EXTENSION = "hybridflow_vllm.worker_extension.HybridflowWorkerExtension"


def _as_tensors(named_tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    # In-process the tensors arrive as they were sent; across processes vLLM's serializer may turn them into lists.
    for name, value in named_tensors:
        yield name, value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def refresh_tied_lm_head(model: Any) -> bool:
    """Re-run the kernel preparation of an ``lm_head`` that shares its weight with ``embed_tokens``.

    vLLM's layer-wise reload skips a tied ``lm_head`` (it receives no tensor of its own) and puts its old kernel
    tensors back; on CPU those include a packed copy of the weight, so the logits kept using the old embedding.
    Returns whether it refreshed anything.
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight, embed_weight = getattr(lm_head, "weight", None), getattr(embed, "weight", None)
    if weight is None or embed_weight is None or weight.data_ptr() != embed_weight.data_ptr():
        return False
    method = getattr(lm_head, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        return False
    method.process_weights_after_loading(lm_head)
    return True


class HybridflowWorkerExtension:
    """Worker methods called through ``LLM.collective_rpc``; ``self`` is the vLLM worker."""

    def hybridflow_load_weights(self, named_tensors: list[tuple[str, Any]], version: int) -> dict[str, int]:
        """Load checkpoint-format (Hugging Face named, unfused) tensors in place; returns what was loaded."""
        worker: Any = self
        worker.reload_weights(weights_iterator=_as_tensors(named_tensors), is_checkpoint_format=True)
        refresh_tied_lm_head(worker.model_runner.get_model())
        worker._hybridflow_version = version
        return {"tensors": len(named_tensors), "version": version}

    def hybridflow_load_weights_from_path(self, path: str, version: int) -> dict[str, int]:
        """Reload the weights of a Hugging Face directory in place (the fallback through disk)."""
        worker: Any = self
        worker.reload_weights(weights_path=path, is_checkpoint_format=True)
        refresh_tied_lm_head(worker.model_runner.get_model())
        worker._hybridflow_version = version
        return {"version": version}

    def hybridflow_loaded_version(self) -> int:
        """The version of the last weights this worker loaded (-1 before any update)."""
        return int(getattr(self, "_hybridflow_version", -1))
