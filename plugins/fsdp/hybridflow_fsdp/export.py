"""The ``fsdp`` checkpoint exporter: one role's torch distributed checkpoint → an HF ``config.json`` +
``model.safetensors``, read in this process without a process group (``no_dist``), whatever world size wrote it.

A LoRA run's checkpoint holds only adapters: the base is rebuilt from the run's model spec (checked against the
fingerprint the checkpoint recorded) and the adapters are merged into it. Which checkpoint and where to write are
:mod:`hybridflow.export`'s; the tokenizer is written there too.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import torch

from hybridflow.checkpoint_files.safe_dcp import load_distributed, read_metadata
from hybridflow.checkpoint_files.safe_load import load_torch_file
from hybridflow.errors import CheckpointError
from hybridflow_fsdp.lora import apply_lora, is_adapter_name, unload_merged

__all__ = ["export_checkpoint", "write_hf_weights"]

_MODEL_KEY = "model"


def _checkpoint_keys(checkpoint: Path) -> set[str]:
    """The flattened state-dict keys a torch distributed checkpoint holds (``model.<param>``, ``optimizer...``)."""
    if not (checkpoint / ".metadata").exists():
        found = sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else "no directory"
        raise CheckpointError(f"no fsdp checkpoint at {checkpoint}: expected a torch distributed checkpoint "
                              f"(.metadata and *.distcp), got {found}")
    return set(read_metadata(checkpoint / ".metadata").state_dict_metadata)  # data, never code


def load_checkpoint_model(checkpoint: Path, spec: Any) -> torch.nn.Module:
    """The role's HF model (built as its engine builds it) with the checkpoint's weights loaded."""
    from hybridflow_fsdp.models import build_model

    model = build_model(spec.engine_config.model, role=spec.role)
    lora = getattr(spec.engine_config, "lora", None)
    if lora is not None:  # the checkpoint holds the adapters; the base comes from the run's model spec
        apply_lora(model, lora, seed=spec.engine_config.model.seed)
        model_spec = spec.engine_config.model
        _check_adapter_base(checkpoint, model, lora,
                            base={"path": model_spec.path, "seed": model_spec.seed, "dtype": model_spec.dtype})
    available = _checkpoint_keys(checkpoint)
    state = model.state_dict()
    if lora is not None:
        state = {name: tensor for name, tensor in state.items() if is_adapter_name(name)}
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if getattr(model.config, "tie_word_embeddings",
                                                                            False) else set()
    wanted = {name: tensor for name, tensor in state.items() if f"{_MODEL_KEY}.{name}" in available}
    missing = sorted(set(state) - set(wanted) - tied)
    if missing:
        raise CheckpointError(f"fsdp checkpoint {checkpoint} lacks {len(missing)} weight(s) of the "
                              f"{type(model).__name__} the run's config describes (first: {missing[:3]}); it was "
                              "written for another model, or the config in the run's manifest.json was changed")
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": exactly what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_distributed({_MODEL_KEY: wanted}, checkpoint, no_dist=True)  # data, never code
    model.load_state_dict(wanted, strict=False)
    unload_merged(model)  # (no adapters: nothing to do)
    return model


def _check_adapter_base(checkpoint: Path, model: torch.nn.Module, lora: Any, *, base: dict[str, Any]) -> None:
    """The checkpoint holds adapters (its rank-0 engine state says so) trained on the base ``model`` now has."""
    from hybridflow_fsdp.lora import check_same_base, describe_adapters

    extra_file = checkpoint / "engine_state_rank0.pt"
    saved = load_torch_file(extra_file).get("lora") if extra_file.exists() else None  # data, never code
    if saved is None:
        state = "has no lora entry" if extra_file.exists() else "is missing"
        raise CheckpointError(f"the run's config trains LoRA adapters (actor.lora) but fsdp checkpoint {checkpoint} "
                              f"records none ({extra_file.name} {state}); it was written by another run, or "
                              "manifest.json was changed")
    mismatch = check_same_base(saved, describe_adapters(model, lora, base=base), where=f"fsdp checkpoint {checkpoint}")
    if mismatch:
        raise CheckpointError(mismatch)


def write_hf_weights(model: torch.nn.Module, out_dir: Path) -> None:
    """``config.json`` (with ``architectures`` and ``use_cache`` on, for generation) and ``model.safetensors`` in the
    checkpoint format transformers' ``save_pretrained`` writes (:func:`hybridflow.model_dir.hf_checkpoint_tensors`:
    MoE experts one tensor each, loadable by vLLM and older transformers too)."""
    from safetensors.torch import save_file
    from transformers import PretrainedConfig

    from hybridflow.model_dir import hf_checkpoint_tensors

    config = cast(PretrainedConfig, model.config)
    state = hf_checkpoint_tensors(model)
    config.architectures = [type(model).__name__]
    config.use_cache = True
    config.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def export_checkpoint(*, checkpoint: Path, spec: Any, out_dir: Path) -> None:
    """Checkpoint exporter ``fsdp`` (see :class:`hybridflow.export.CheckpointExporter`)."""
    write_hf_weights(load_checkpoint_model(checkpoint, spec), out_dir)
