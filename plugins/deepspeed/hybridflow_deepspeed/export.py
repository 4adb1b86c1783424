"""The ``deepspeed`` checkpoint exporter: one role's DeepSpeed checkpoint (:mod:`hybridflow_deepspeed.checkpoint`'s
layout) → an HF ``config.json`` + ``model.safetensors``, read in this process: no Ray, no process group, whatever
world size wrote it.

- ZeRO-3: every rank's ``*_optim_states.pt`` holds its flat fp32 master partitions (``fp32_flat_groups``); parameter
  ``p`` (in ``param_shapes`` order) is the ``⌈numel/W⌉``-element slice at the same offset on each of the W ranks,
  concatenated and cut to ``numel`` (DeepSpeed's own ``zero_to_fp32`` protocol, every file read as data by
  :mod:`hybridflow_deepspeed.safe_files`).
- ZeRO-1/2: the module weights are whole in ``mp_rank_00_model_states.pt`` (written once, by rank 0).
- A frozen role (reference, reward model) saves no weights: they are the model spec's, rebuilt as the engine built
  them (same path or seed).

The weights are written in the dtype the engine computes with (its fp32 masters cast to bf16 under
``mixed_precision=bf16``), so the exported model equals the trainer's own ``export_hf``. Which checkpoint and where
to write are :mod:`hybridflow.export`'s; the tokenizer is written there too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from hybridflow.checkpoint_files.safe_load import load_torch_file
from hybridflow.errors import CheckpointError
from hybridflow_deepspeed.safe_files import load_deepspeed_file

__all__ = ["export_checkpoint", "load_checkpoint_state"]

_WHOLE_MODEL_STATES = "mp_rank_00_model_states.pt"
_MODEL_STATES = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
_OPTIM_STATES = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


def _rank_files(directory: Path, pattern: re.Pattern[str], world_size: int, what: str) -> list[Path]:
    found = {int(m.group(1)): p for p in directory.iterdir() if (m := pattern.fullmatch(p.name))}
    if sorted(found) != list(range(world_size)):
        raise CheckpointError(f"deepspeed checkpoint {directory} should hold {what} files of ranks 0..{world_size - 1}"
                              f" (the world size it was written with); it holds ranks {sorted(found)}")
    return [found[rank] for rank in range(world_size)]


def _zero3_state(directory: Path, model_states: dict[str, Any], world_size: int) -> dict[str, torch.Tensor]:
    """Full fp32 parameters reassembled from every rank's flat ZeRO-3 partitions."""
    flats = []
    for path in _rank_files(directory, _OPTIM_STATES, world_size, "optimizer-state"):
        groups = load_deepspeed_file(path)["optimizer_state_dict"]["fp32_flat_groups"]
        flats.append(torch.cat([group.reshape(-1) for group in groups]))
    shapes = {name: torch.Size(shape) for group in model_states["param_shapes"] for name, shape in group.items()}
    state, offset = {}, 0
    for name, shape in shapes.items():
        partition = -(-shape.numel() // world_size)
        state[name] = torch.cat([flat[offset:offset + partition] for flat in flats])[:shape.numel()].view(shape)
        offset += partition
    if any(flat.numel() != offset for flat in flats):
        raise CheckpointError(f"deepspeed checkpoint {directory}: the parameter shapes need {offset} elements per rank,"
                              f" the ranks hold {[flat.numel() for flat in flats]}; the files do not belong together")
    module = model_states["module"]
    for name in model_states.get("buffer_names") or ():  # ZeRO-3 keeps buffers whole in the module state
        state[name] = module[name]
    return state


def load_checkpoint_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor] | None, int]:
    """``(state dict, ZeRO stage)`` of a role's checkpoint; the state is None for a frozen role (no weights saved)."""
    from hybridflow_deepspeed.checkpoint import TAG

    extra_file = checkpoint / "engine_state_rank0.pt"
    if not extra_file.exists():
        found = sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else "no directory"
        raise CheckpointError(f"no deepspeed checkpoint at {checkpoint}: expected engine_state_rank0.pt (and "
                              f"{TAG}/ for a trained role), got {found}")
    extra = load_torch_file(extra_file)  # hybridflow's own: tensors and plain values only
    world_size, stage = int(extra["world_size"]), int(extra["zero_stage"])
    directory = checkpoint / TAG
    if not directory.is_dir():
        return None, stage
    if stage == 3:
        model_states = load_deepspeed_file(_rank_files(directory, _MODEL_STATES, world_size, "model-state")[0])
        return _zero3_state(directory, model_states, world_size), stage
    whole = directory / _WHOLE_MODEL_STATES  # ZeRO-1/2: rank 0 writes the module once
    if not whole.exists():
        raise CheckpointError(f"deepspeed ZeRO-{stage} checkpoint {directory} has no {_WHOLE_MODEL_STATES} (it "
                              f"holds {sorted(p.name for p in directory.iterdir())}); the save was incomplete")
    return dict(load_deepspeed_file(whole)["module"]), stage


def export_checkpoint(*, checkpoint: Path, spec: Any, out_dir: Path) -> None:
    """Checkpoint exporter ``deepspeed`` (see :class:`hybridflow.export.CheckpointExporter`)."""
    from hybridflow_fsdp.export import write_hf_weights
    from hybridflow_fsdp.models import build_model

    state, stage = load_checkpoint_state(checkpoint)
    model = build_model(spec.engine_config.model, role=spec.role)  # the frozen role's weights are exactly these
    if state is not None:
        expected = model.state_dict()
        tied = set(getattr(model, "_tied_weights_keys", None) or ()) if getattr(
            model.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(expected) - set(state) - tied)
        unexpected = sorted(set(state) - set(expected))
        wrong = sorted(name for name in set(state) & set(expected) if state[name].shape != expected[name].shape)
        if missing or unexpected or wrong:
            raise CheckpointError(
                f"deepspeed (ZeRO-{stage}) checkpoint {checkpoint} does not fit the {type(model).__name__} the run's "
                f"config describes (missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {wrong[:3]}); "
                "it was written for another model, or the config in the run's manifest.json was changed")
        model.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=False)
    if spec.engine_config.mixed_precision == "bf16":  # the engine's module (and its export_hf) is bf16 then
        model.to(torch.bfloat16)
    write_hf_weights(model, out_dir)
