"""The ``megatron`` checkpoint exporter: one role's per-rank checkpoint files (:mod:`hybridflow_megatron.persist`)
→ an HF ``config.json`` + ``model.safetensors``, assembled in this process without a process group.

The rank files of data-parallel replica 0 hold every shard: tensor rank ``tp`` of pipeline stage ``pp`` is global
rank ``pp · t + tp`` (the engine's ``tp-cp-ep-pp-dp`` order). Which checkpoint and where to write are
:mod:`hybridflow.export`'s; the tokenizer is written there too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hybridflow.checkpoint_files.safe_load import load_torch_file
from hybridflow.errors import CheckpointError
from hybridflow_megatron.convert import hf_from_megatron_shards, read_arch_info
from hybridflow_megatron.model import VALUE_HEAD_ROLES
from hybridflow_megatron.spec_names import local_name

__all__ = ["export_checkpoint", "read_checkpoint_hf_state", "build_empty_hf_model"]


def _read_layout(checkpoint: Path) -> dict[str, int]:
    layout_file = checkpoint / "layout.json"
    if not layout_file.exists():
        found = sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else "no directory"
        raise CheckpointError(f"no megatron checkpoint at {checkpoint}: expected layout.json and rank_*.pt, got "
                              f"{found}")
    layout: dict[str, int] = json.loads(layout_file.read_text(encoding="utf-8"))
    return layout


def _load_rank(checkpoint: Path, rank: int) -> dict[str, torch.Tensor]:
    path = checkpoint / f"rank_{rank:05d}.pt"
    if not path.exists():
        raise CheckpointError(f"megatron checkpoint {checkpoint} lacks {path.name} (its layout.json names "
                              "that rank); the checkpoint is incomplete")
    state = load_torch_file(path, mmap=True)  # data, never code; mmap: only the model tensors are read
    return {local_name(name): tensor for name, tensor in state["model"].items()}


def build_empty_hf_model(spec: Any) -> torch.nn.Module:
    """The HF model class and config of the role (causal LM, or a 1-label token classifier for a value head), with
    its weights left at init: the checkpoint's replace them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    model_spec = spec.engine_config.model
    if model_spec.path is not None:
        config = AutoConfig.from_pretrained(model_spec.path)
    else:
        values = dict(model_spec.config)
        values.pop("torch_dtype", None)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    if spec.role in VALUE_HEAD_ROLES:
        config.num_labels = 1
    factory = AutoModelForTokenClassification if spec.role in VALUE_HEAD_ROLES else AutoModelForCausalLM
    model: torch.nn.Module = factory.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    return model


def read_checkpoint_hf_state(checkpoint: Path, *, hf_config: Any, role: str,
                             vocab_multiple: int = 8) -> dict[str, torch.Tensor]:
    """Every HF-named tensor of the checkpoint: tensor shards concatenated per stage, stages in layer order."""
    layout = _read_layout(checkpoint)
    tp, pp = int(layout["tp"]), int(layout["pp"])
    arch = read_arch_info(hf_config, tp_size=tp, vocab_multiple=vocab_multiple, value_head=role in VALUE_HEAD_ROLES)
    full: dict[str, torch.Tensor] = {}
    layer_offset = 0
    for stage in range(pp):
        shards = [_load_rank(checkpoint, stage * tp + tensor_rank) for tensor_rank in range(tp)]
        full.update(hf_from_megatron_shards(shards, arch=arch, layer_offset=layer_offset))
        layer_offset += len({name.split(".")[2] for name in shards[0] if name.startswith("decoder.layers.")})
    if layer_offset != arch.num_layers:
        raise CheckpointError(f"megatron checkpoint {checkpoint} holds {layer_offset} decoder layers over {pp} "
                              f"stage(s); the run's model has {arch.num_layers}")
    if arch.tied_embeddings:
        full.pop("lm_head.weight", None)
    return full


def export_checkpoint(*, checkpoint: Path, spec: Any, out_dir: Path) -> None:
    """Checkpoint exporter ``megatron`` (see :class:`hybridflow.export.CheckpointExporter`)."""
    from safetensors.torch import save_file

    model = build_empty_hf_model(spec)
    state = read_checkpoint_hf_state(checkpoint, hf_config=model.config, role=spec.role,
                                     vocab_multiple=int(spec.engine_config.extra.get("vocab_multiple", 8)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_ok = set(missing) <= {"lm_head.weight"} and bool(getattr(model.config, "tie_word_embeddings", False))
    if (missing and not tied_ok) or unexpected:
        raise CheckpointError(f"megatron checkpoint {checkpoint} does not match {type(model).__name__}: missing "
                              f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    config: Any = model.config
    config.architectures = [type(model).__name__]
    config.use_cache = True
    config.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
