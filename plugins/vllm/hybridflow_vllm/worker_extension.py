"""Methods mixed into every vLLM worker (``LLM(worker_extension_cls=...)``) so weights arrive without touching disk.

It loads Hugging Face-named tensors through the worker's own ``reload_weights``; choosing the weights and keeping
the policy version is :class:`hybridflow_vllm.engine.VllmRolloutEngine`'s job. Imported by vLLM inside the worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["WORKER_EXTENSION", "HybridflowWorkerExtension", "mark_presharded", "refresh_tied_lm_head"]

#: import path vLLM resolves inside each worker
WORKER_EXTENSION = "hybridflow_vllm.worker_extension.HybridflowWorkerExtension"


def _as_tensors(named_tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    # In-process the tensors arrive as they were sent; across processes vLLM's serializer may turn them into lists.
    for name, value in named_tensors:
        yield name, value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def mark_presharded(model: Any, presharded: bool) -> int:
    """Make vLLM's weight loaders take this rank's tensor-parallel shards as they are (``presharded``) or narrow full
    tensors to this rank's shard (the default); returns the parameters marked.

    vLLM has no switch for it across its loaders, so each kind is told the way it reads:

    - linear weights (``BasevLLMParameter``, the ``weight_loader_v2`` path) narrow at ``self.tp_rank * shard``:
      a presharded load sets their ``tp_rank`` to 0, the whole shard (the true rank kept in ``_hybridflow_tp_rank``);
    - linear biases (plain parameters, ``weight_loader``) skip narrowing when ``is_sharded_weight`` is set, vLLM's
      own flag for pre-sharded checkpoints;
    - the vocabulary-parallel embedding narrows rows whenever its weight has an ``output_dim``: a presharded load
      hides it (kept in ``_hybridflow_output_dim``), so the shard is copied as is.

    Called from inside a reload, after vLLM put the layers' checkpoint-format parameters back: those are the objects a
    layer-wise reload materialises (attributes included), and they persist to the next reload.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.parameter import BasevLLMParameter

    marked = 0
    for module in model.modules():
        for param in module._parameters.values():
            if param is None:
                continue
            if isinstance(module, LinearBase) and isinstance(param, BasevLLMParameter):
                rank = param.__dict__.setdefault("_hybridflow_tp_rank", param.tp_rank)
                param.tp_rank = 0 if presharded else rank
            elif isinstance(module, LinearBase):
                param.is_sharded_weight = presharded
            elif isinstance(module, VocabParallelEmbedding):
                dim = param.__dict__.setdefault("_hybridflow_output_dim", getattr(param, "output_dim", None))
                param.output_dim = None if presharded else dim
            else:
                continue
            marked += 1
    return marked


def _marked(model: Any, named_tensors: Iterable[tuple[str, Any]], presharded: bool) -> Iterator[tuple[str, Any]]:
    # a generator: its body runs when the reload first pulls a tensor, after vLLM restored the layers for reloading
    mark_presharded(model, presharded)
    yield from _as_tensors(named_tensors)


def _read_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the ``*.safetensors`` files of a Hugging Face directory, file by file."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}; expected a Hugging Face model directory")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


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

    def hybridflow_load_weights(self, named_tensors: list[tuple[str, Any]], version: int,
                                presharded: bool = False) -> dict[str, int]:
        """Load checkpoint-format (Hugging Face named, unfused) tensors in place, full or (``presharded``) this
        rank's tensor-parallel shards; returns what was loaded."""
        worker: Any = self
        model = worker.model_runner.get_model()
        worker.reload_weights(weights_iterator=_marked(model, named_tensors, presharded), is_checkpoint_format=True)
        refresh_tied_lm_head(worker.model_runner.get_model())
        worker._hybridflow_version = version
        return {"tensors": len(named_tensors), "version": version}

    def hybridflow_load_weights_from_path(self, path: str, version: int) -> dict[str, int]:
        """Reload the weights of a Hugging Face directory in place (the fallback through disk): full tensors, which
        vLLM's loaders narrow to this rank's shard."""
        worker: Any = self
        model = worker.model_runner.get_model()
        worker.reload_weights(weights_iterator=_marked(model, _read_safetensors(path), False),
                              is_checkpoint_format=True)
        refresh_tied_lm_head(worker.model_runner.get_model())
        worker._hybridflow_version = version
        return {"version": version}

    def hybridflow_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every parameter of this worker's model as this rank holds it. vLLM's CPU path repacks a
        linear weight into its GEMM kernel and leaves an empty parameter; such a weight reports the
        (output, input) partition the kernel was packed from (the layer's ``output_size_per_partition`` and
        ``input_size_per_partition``)."""
        from vllm.model_executor.layers.linear import LinearBase

        worker: Any = self
        shapes: dict[str, tuple[int, ...]] = {}
        for module_name, module in worker.model_runner.get_model().named_modules():
            for name, param in module.named_parameters(recurse=False):
                shape = tuple(param.shape)
                if isinstance(module, LinearBase) and name == "weight" and param.numel() == 0:
                    linear: Any = module
                    shape = (int(linear.output_size_per_partition), int(linear.input_size_per_partition))
                shapes[f"{module_name}.{name}" if module_name else name] = shape
        return shapes

    def hybridflow_loaded_version(self) -> int:
        """The version of the last weights this worker loaded (-1 before any update)."""
        return int(getattr(self, "_hybridflow_version", -1))
