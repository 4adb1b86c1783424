"""Checkpoints of the ``deepspeed`` engine (DeepSpeed's own layout: module, ZeRO optimizer partitions per rank,
LR scheduler) plus step count and RNG state per rank, written atomically; and export of an HF model directory.

All ranks must see the same filesystem. Deciding when to checkpoint is the trainer's business.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from hybridflow.checkpoint_files.safe_load import load_torch_file
from hybridflow.errors import CheckpointError
from hybridflow_deepspeed.safe_files import files_read_as_data
from hybridflow_fsdp.checkpoint import TOKENIZER_FILES, rng_state, set_rng_state

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hybridflow_deepspeed.training import DeepSpeedTrainingEngine

__all__ = ["save", "load", "export_hf", "TAG"]

#: the DeepSpeed checkpoint tag (sub-directory) inside a hybridflow checkpoint directory
TAG = "deepspeed"
_EXTRA = "engine_state_rank{rank}.pt"


def save(engine: DeepSpeedTrainingEngine, path: str) -> None:
    """Write ``path`` (a directory) atomically: into ``path.tmp`` first, renamed by rank 0 once every rank is done.

    A frozen role (reference, reward model) has no optimizer and weights that never change from the model spec it
    was built from, so only its step and RNG state are written.
    """
    final, staging = Path(path), Path(f"{path}.tmp")
    if engine.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    if engine.trainable:
        engine.engine.save_checkpoint(str(staging), tag=TAG, client_state={}, save_latest=False)
    extra = {
        "world_size": engine.world_size,
        "role": engine.role,
        "zero_stage": engine.options.zero_stage,
        "version": engine.state_version(),
        "rng": rng_state(),
    }
    torch.save(extra, staging / _EXTRA.format(rank=engine.rank))
    dist.barrier()
    if engine.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    dist.barrier()


def _ignore_module_weights(src: Any, dst: Any) -> None:
    """ZeRO-3 ``custom_load_fn``: its module holds empty partitioned parameters; the optimizer state restores them."""


def load(engine: DeepSpeedTrainingEngine, path: str) -> None:
    """Restore what :func:`save` wrote; the world size, role and ZeRO stage must match the saving run."""
    directory = Path(path)
    extra_file = directory / _EXTRA.format(rank=engine.rank)
    if not extra_file.exists() or (engine.trainable and not (directory / TAG).is_dir()):
        raise CheckpointError(
            f"no complete deepspeed checkpoint at {path}: expected {extra_file.name}"
            f"{f' and {TAG}/' if engine.trainable else ''} (got "
            f"{sorted(p.name for p in directory.iterdir()) if directory.exists() else 'no directory'}). "
            "Pass a directory written by save_checkpoint (a leftover *.tmp is an interrupted save)."
        )
    extra = load_torch_file(extra_file)  # data, never code: tensors and plain values only
    saved = (extra["world_size"], extra["role"], extra["zero_stage"])
    if saved != (engine.world_size, engine.role, engine.options.zero_stage):
        raise CheckpointError(
            f"checkpoint {path} was written by a {saved[1]} on {saved[0]} ranks with ZeRO-{saved[2]}; this engine is "
            f"a {engine.role} on {engine.world_size} ranks with ZeRO-{engine.options.zero_stage}. Resume with the "
            "same role, world size and extra.zero_stage."
        )
    if engine.trainable:
        custom = _ignore_module_weights if engine.options.zero_stage == 3 else None
        with files_read_as_data(engine.engine):  # DeepSpeed's own loader would unpickle with weights_only=False
            loaded, _ = engine.engine.load_checkpoint(str(directory), tag=TAG, load_optimizer_states=True,
                                                      load_lr_scheduler_states=True, custom_load_fn=custom)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint under {directory / TAG}")
    engine._version = int(extra["version"])
    set_rng_state(extra["rng"])
    dist.barrier()


def export_hf(engine: DeepSpeedTrainingEngine, path: str) -> None:
    """Gather the full weights (every rank takes part) and write ``config.json`` + ``model.safetensors``
    (+ tokenizer files) from rank 0."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in engine.full_state_dict()}
    for name, buffer in engine.module.named_buffers():
        module_name, _, leaf = name.rpartition(".")
        owner = engine.module.get_submodule(module_name) if module_name else engine.module
        if leaf not in getattr(owner, "_non_persistent_buffers_set", set()):
            state[name] = buffer.detach().to("cpu", copy=True).contiguous()
    if engine.rank == 0:
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        config = cast("PretrainedConfig", engine.module.config)
        config.architectures = [type(engine.module).__name__]
        config.save_pretrained(directory)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        source = engine.config.model.path
        for name in TOKENIZER_FILES if source else ():
            if source and (Path(source) / name).exists():
                shutil.copy2(Path(source) / name, directory / name)
    del state
    dist.barrier()
