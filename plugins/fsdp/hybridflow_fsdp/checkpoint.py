"""Distributed checkpoints of the FSDP engine (torch.distributed.checkpoint) and export of an HF model directory.

Checkpoints hold model, optimizer, scheduler, optimizer-step count and every RNG state, so a resumed run continues
bit-identically; all ranks must see the same filesystem. With LoRA they hold only the adapters and their optimizer
state, plus a reference to the base (spec and weight fingerprint) that loading checks. Deciding when to checkpoint
is the trainer's business.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.checkpoint_files.safe_dcp import load_distributed
from hybridflow.checkpoint_files.safe_load import load_torch_file
from hybridflow.errors import CheckpointError
from hybridflow_fsdp.lora import check_same_base, describe_adapters, is_adapter_name, lora_modules, merge_state_dict

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hybridflow_fsdp.training import FSDPTrainingEngine

__all__ = ["save", "load", "export_hf", "TOKENIZER_FILES", "rng_state", "set_rng_state"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "generation_config.json", "chat_template.jinja")
_EXTRA = "engine_state_rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    """Every RNG state as tensors and plain Python values, so the file loads with ``weights_only=True``."""
    legacy_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    name, keys, position, has_gauss, cached = legacy_state
    numpy_state = [str(name), torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)]
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # untyped in torch
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _state_dicts(engine: FSDPTrainingEngine) -> dict[str, Any]:
    """Model and optimizer state; with LoRA only the adapters (the frozen base is referenced, not stored)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    lora = engine.config.lora is not None
    model = get_model_state_dict(engine.model, options=StateDictOptions(ignore_frozen_params=lora))
    if lora:  # (ignore_frozen_params keeps a tied head's key: the adapters are all a LoRA checkpoint holds)
        model = {name: tensor for name, tensor in model.items() if is_adapter_name(name)}
    state: dict[str, Any] = {"model": model}
    if engine.optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(engine.model, engine.optimizer)
    return state


def save(engine: FSDPTrainingEngine, path: str) -> None:
    """Write ``path`` (a directory) atomically: into ``path.tmp`` first, renamed by rank 0 once every rank is done."""
    from torch.distributed.checkpoint.state_dict_saver import save as save_distributed

    final, staging = Path(path), Path(f"{path}.tmp")
    if engine.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    save_distributed(_state_dicts(engine), checkpoint_id=str(staging))
    extra = {
        "world_size": engine.world_size,
        "role": engine.role,
        "version": engine.state_version(),
        "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "rng": rng_state(),
        "lora": _adapters(engine),
    }
    torch.save(extra, staging / _EXTRA.format(rank=engine.rank))
    dist.barrier()
    if engine.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    dist.barrier()


def load(engine: FSDPTrainingEngine, path: str) -> None:
    """Restore what :func:`save` wrote; the world size and role must match the saving run."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    directory = Path(path)
    extra_file = directory / _EXTRA.format(rank=engine.rank)
    if not (directory / ".metadata").exists() or not extra_file.exists():
        raise CheckpointError(
            f"no complete fsdp checkpoint at {path}: expected .metadata and {extra_file.name} (got "
            f"{sorted(p.name for p in directory.iterdir()) if directory.exists() else 'no directory'}). "
            "Pass a directory written by save_checkpoint (a leftover *.tmp is an interrupted save)."
        )
    extra = load_torch_file(extra_file)  # data, never code: tensors and plain values only
    if extra["world_size"] != engine.world_size or extra["role"] != engine.role:
        raise CheckpointError(
            f"checkpoint {path} was written by a {extra['role']} on {extra['world_size']} ranks; this engine is a "
            f"{engine.role} on {engine.world_size} ranks. Resume with the same role and world size."
        )
    adapters = _adapters(engine)
    if (extra.get("lora") is None) != (adapters is None):
        have = "LoRA adapters only" if adapters is None else "every weight (full fine-tuning)"
        raise CheckpointError(f"checkpoint {path} holds {have}; this engine "
                              f"{'trains LoRA adapters' if adapters else 'trains every weight'}. Resume with the "
                              "run's actor.lora setting")
    if adapters is not None:
        mismatch = check_same_base(extra["lora"], adapters, where=f"checkpoint {path}")
        if mismatch:
            raise CheckpointError(mismatch)
    state = _state_dicts(engine)
    load_distributed(state, directory)  # .metadata and every .distcp item read as data, never code
    set_model_state_dict(engine.model, state["model"],
                         options=StateDictOptions(strict=adapters is None))
    if engine.optimizer is not None:
        set_optimizer_state_dict(engine.model, engine.optimizer, state["optimizer"])
    if engine.scheduler is not None and extra["scheduler"] is not None:
        engine.scheduler.load_state_dict(extra["scheduler"])
    engine._version = int(extra["version"])
    set_rng_state(extra["rng"])
    dist.barrier()


def _adapters(engine: FSDPTrainingEngine) -> dict[str, Any] | None:
    """The LoRA description a checkpoint records (None without LoRA); a collective (the base fingerprint)."""
    if engine.config.lora is None:
        return None
    spec = engine.config.model
    return describe_adapters(engine.model, engine.config.lora,
                             base={"path": spec.path, "seed": spec.seed, "dtype": spec.dtype})


def _unwrapped_class_name(model: torch.nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule

    return next(cls.__name__ for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def export_hf(engine: FSDPTrainingEngine, path: str) -> None:
    """Gather the full weights to rank 0 and write ``config.json`` + ``model.safetensors`` (+ tokenizer files)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = cast(dict[str, torch.Tensor], get_model_state_dict(engine.model, options=options))
    if engine.rank == 0 and engine.config.lora is not None:  # the base model with the adapters merged in
        state = merge_state_dict(state, {name: module.scale for name, module in lora_modules(engine.model).items()})
    if engine.rank == 0:
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        config = cast("PretrainedConfig", engine.model.config)
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        config.architectures = [_unwrapped_class_name(engine.model)]
        config.save_pretrained(directory)
        tensors = {name: tensor.contiguous() for name, tensor in state.items()}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        source = engine.config.model.path
        for name in TOKENIZER_FILES if source else ():
            if source and (Path(source) / name).exists():
                shutil.copy2(Path(source) / name, directory / name)
    del state
    dist.barrier()
