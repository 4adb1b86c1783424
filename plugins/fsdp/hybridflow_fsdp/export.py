"""The ``fsdp`` checkpoint exporter: one role's torch distributed checkpoint → an HF ``config.json`` +
``model.safetensors``, read in this process without a process group (``no_dist``), whatever world size wrote it.

Which checkpoint and where to write are :mod:`hybridflow.export`'s; the tokenizer is written there too.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import torch

from hybridflow.errors import CheckpointError

__all__ = ["export_checkpoint", "write_hf_weights"]

_MODEL_KEY = "model"


def _checkpoint_keys(checkpoint: Path) -> set[str]:
    """The flattened state-dict keys a torch distributed checkpoint holds (``model.<param>``, ``optimizer...``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not (checkpoint / ".metadata").exists():
        found = sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else "no directory"
        raise CheckpointError(f"no fsdp checkpoint at {checkpoint}: expected a torch distributed checkpoint "
                              f"(.metadata and *.distcp), got {found}")
    return set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)


def load_checkpoint_model(checkpoint: Path, spec: Any) -> torch.nn.Module:
    """The role's HF model (built as its engine builds it) with the checkpoint's weights loaded."""
    from torch.distributed.checkpoint.state_dict_loader import load

    from hybridflow_fsdp.models import build_model

    model = build_model(spec.engine_config.model, role=spec.role)
    available = _checkpoint_keys(checkpoint)
    state = model.state_dict()
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
        load({_MODEL_KEY: wanted}, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(wanted, strict=False)
    return model


def write_hf_weights(model: torch.nn.Module, out_dir: Path) -> None:
    """``config.json`` (with ``architectures`` and ``use_cache`` on, for generation) and ``model.safetensors``."""
    from safetensors.torch import save_file
    from transformers import PretrainedConfig

    config = cast(PretrainedConfig, model.config)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    config.architectures = [type(model).__name__]
    config.use_cache = True
    config.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def export_checkpoint(*, checkpoint: Path, spec: Any, out_dir: Path) -> None:
    """Checkpoint exporter ``fsdp`` (see :class:`hybridflow.export.CheckpointExporter`)."""
    write_hf_weights(load_checkpoint_model(checkpoint, spec), out_dir)
