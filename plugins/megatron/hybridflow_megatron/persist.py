"""Checkpoints of the megatron engine (one file per rank, written to a temp dir then renamed) and HF export.

A checkpoint restores only into the same (tensor, pipeline, data) layout it was written from; loading into another
layout goes through :func:`export_hf` and a fresh engine built from the exported directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.checkpoint_files.safe_load import load_torch_file
from hybridflow.errors import CheckpointError
from hybridflow_megatron import gather
from hybridflow_megatron.model import VALUE_HEAD_ROLES

__all__ = ["save", "load", "export_hf"]

_FORMAT = 1


def _rank_file(root: Path) -> Path:
    return root / f"rank_{dist.get_rank():05d}.pt"


def _layout(engine: Any) -> dict[str, int]:
    placement = engine.placement
    return {"tp": placement.tp_size, "pp": placement.pp_size, "dp": placement.dp_size,
            "world": dist.get_world_size()}


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def save(engine: Any, path: str) -> None:
    """Write every rank's shard under ``path`` atomically (all ranks write into ``path.tmp``, rank 0 renames)."""
    root = Path(path)
    staging = root.with_name(root.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    optimizer = engine.optimizer
    state = {
        "format": _FORMAT,
        "role": engine.role,
        "layout": _layout(engine),
        "version": engine._version,
        "step": engine._step,
        "model": {name: p.detach().clone() for name, p in engine.module.named_parameters()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "optimizer_inner": optimizer.optimizer.state_dict() if optimizer is not None and
        hasattr(optimizer, "optimizer") else None,
        "rng": _rng_state(),
    }
    torch.save(state, _rank_file(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        (staging / "layout.json").write_text(json.dumps({"format": _FORMAT, **_layout(engine)}))
        if root.exists():
            shutil.rmtree(root)
        os.replace(staging, root)
    dist.barrier()


def load(engine: Any, path: str) -> None:
    """Restore what :func:`save` wrote; the layout must be the one it was written from."""
    root = Path(path)
    meta_file = root / "layout.json"
    if not meta_file.exists():
        raise CheckpointError(f"expected a megatron checkpoint directory with layout.json at {root}; got none. "
                              "Pass the directory save_checkpoint wrote.")
    meta = json.loads(meta_file.read_text())
    expected = {"format": _FORMAT, **_layout(engine)}
    if meta != expected:
        raise CheckpointError(f"checkpoint {root} was written with layout {meta}; this engine runs {expected}. "
                              "Export to HF (export_hf) and build the new layout from that directory instead.")
    state = load_torch_file(_rank_file(root))  # data, never code: tensors and plain values only
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            param.copy_(state["model"][name].to(param.device))
    if engine.optimizer is not None:
        engine.optimizer.load_state_dict(state["optimizer"])
        if state["optimizer_inner"] is not None:
            engine.optimizer.optimizer.load_state_dict(state["optimizer_inner"])
        if hasattr(engine.optimizer, "reload_model_params"):
            engine.optimizer.reload_model_params()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["rng"]["torch"])
    get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
    engine._version = int(state["version"])
    engine._step = int(state["step"])
    dist.barrier()


def export_hf(engine: Any, path: str) -> None:
    """Write an HF directory (config + safetensors, tokenizer when the source has one) from global rank 0."""
    state, _ = gather.gather_hf_state(engine.module, arch=engine.arch, placement=engine.placement)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        config = engine.hf_config
        factory = AutoModelForTokenClassification if engine.role in VALUE_HEAD_ROLES else AutoModelForCausalLM
        model = factory.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]  # untyped in HF
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied_ok = set(missing) <= {"lm_head.weight"} and engine.arch.tied_embeddings
        if (missing and not tied_ok) or unexpected:
            raise CheckpointError(f"HF export does not match {type(model).__name__}: missing {missing}, "
                                  f"unexpected {unexpected}")
        model.save_pretrained(path, safe_serialization=True)
        source = engine.config.model.path
        if source is not None:
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (Path(source) / name).exists():
                    shutil.copy(Path(source) / name, Path(path) / name)
    dist.barrier()
