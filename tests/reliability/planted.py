"""Tampered checkpoints for tests/reliability/test_checkpoint_loads_no_code.py (and megatron_resume.py, its
megatron engine process): a run directory saved the way the trainer saves one, and a payload whose unpickling runs
``touch MARKER`` (``os.system``, pickled as ``posix.system``) planted into one pickle-bearing file of it at a time,
with ``checksums.json`` rewritten to match, as an attacker who can write the directory would."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridflow.config import Config, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"
ROLE = "actor"
STEP = 1
#: how the payload's global reads in a refusal
PAYLOAD_GLOBAL = f"{os.system.__module__}.system"


class Payload:
    """Unpickling this runs ``touch marker``: what a crafted checkpoint file could do on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def run_config(run_dir: Path, engine: str, *overrides: str) -> Config:
    """The tests' GRPO example with a 1-rank ``engine`` actor writing into ``run_dir``."""
    return load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
                                 "resource_pools.main.devices_per_node=[1]", f"actor.engine={engine}",
                                 "actor.micro_batch_size=4", *overrides])


def build_actor(config: Config) -> Any:
    """The actor's training engine, built from the spec the trainer (and ``hybridflow export``) plans for it, as
    its worker builds it."""
    from hybridflow.export import _role_spec
    from hybridflow.plugins import load_plugins
    from hybridflow.workers.base import _build_training_engine

    load_plugins()  # builtin algorithms and the engines' plugins, as the trainer loads them
    if config.actor.engine == "deepspeed":
        from deepspeed_in_process import release_stale_deepspeed_groups

        release_stale_deepspeed_groups()
    return _build_training_engine(_role_spec(config, ROLE))


def train_and_save(config: Config, engine: Any) -> Path:
    """One optimizer step, then the run's manifest and checkpoint ``step-1`` as the trainer writes them (the actor
    worker's ``save_checkpoint``: the engine's files plus ``worker_state.json``); returns the step directory."""
    from hybridflow.manifest import build_manifest, write_manifest
    from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
    from hybridflow.trainer.checkpoint import CheckpointManager

    engine.train_step(build_training_batch(rows=4), loss_fn=sequence_mean_nll, mini_batch_size=4)
    run_dir = Path(config.trainer.run_dir)
    write_manifest(run_dir, build_manifest(config, protocols={}, mapping={ROLE: {"engine": config.actor.engine}}))

    def write_workers(directory: str) -> None:
        target = Path(directory) / ROLE
        engine.save_checkpoint(str(target))
        (target / "worker_state.json").write_text(json.dumps({"policy_version": STEP}))

    return CheckpointManager(run_dir).save(STEP, write_workers, {"policy_version": STEP})


def resume(engine: Any, step_dir: Path) -> None:
    """What resuming from ``step_dir`` runs on the actor: the trainer verifies the checksums, the worker loads its
    engine's checkpoint."""
    from hybridflow.trainer.checkpoint import CheckpointManager

    CheckpointManager(step_dir.parents[1]).verify(step_dir)
    engine.load_checkpoint(str(step_dir / ROLE))


def reseal(step_dir: Path) -> None:
    """Rewrite ``checksums.json`` to the files as they are now (the tampering then passes the checksum check)."""
    index = step_dir / "checksums.json"
    names = json.loads(index.read_text())
    index.write_text(json.dumps({name: hashlib.sha256((step_dir / name).read_bytes()).hexdigest() for name in names},
                                indent=1, sort_keys=True))


def plant_in_torch_file(path: Path, marker: Path) -> None:
    """Add the payload to what a ``torch.save`` file holds (its other contents stay as they were)."""
    state = torch.load(path, map_location="cpu", weights_only=False)  # the test's own file, just written
    torch.save({**state, "planted": Payload(marker)} if isinstance(state, dict) else [state, Payload(marker)], path)


def plant_in_metadata(path: Path, marker: Path) -> None:
    """Add the payload as an attribute of the DCP ``Metadata`` pickled in ``.metadata``."""
    with path.open("rb") as handle:
        metadata = pickle.load(handle)  # the test's own file, just written
    metadata.__dict__["planted"] = Payload(marker)
    with path.open("wb") as handle:
        pickle.dump(metadata, handle)


def plant_in_distcp(directory: Path, marker: Path, *, fqn_prefix: str, tensor: bool) -> Path:
    """Replace the bytes of the first ``fqn_prefix*`` item of a ``.distcp`` file (a tensor, or a non-tensor value
    such as an optimizer hyper-parameter) by ``torch.save(payload)``, moving the items after it and rewriting
    ``.metadata``'s offsets to match; returns the ``.distcp`` file."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with (directory / ".metadata").open("rb") as handle:
        metadata = pickle.load(handle)  # the test's own file, just written
    target = next(index for index in metadata.storage_data if index.fqn.startswith(fqn_prefix) and isinstance(
        metadata.state_dict_metadata[index.fqn], TensorStorageMetadata) == tensor)
    file = directory / metadata.storage_data[target].relative_path
    original = file.read_bytes()
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    items = sorted((info.offset, index) for index, info in metadata.storage_data.items()
                   if info.relative_path == file.name)
    rebuilt = bytearray()
    for _, index in items:
        info = metadata.storage_data[index]
        data = payload.getvalue() if index == target else original[info.offset:info.offset + info.length]
        info.offset, info.length = len(rebuilt), len(data)
        rebuilt += data
    file.write_bytes(bytes(rebuilt))
    with (directory / ".metadata").open("wb") as handle:
        pickle.dump(metadata, handle)
    return file


def distcp_item(file: Path, *, fqn_prefix: str, tensor: bool) -> bytes:
    """The bytes of the item :func:`plant_in_distcp` replaced (read with the test's own unpickler)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with (file.parent / ".metadata").open("rb") as handle:
        metadata = pickle.load(handle)
    index = next(index for index in metadata.storage_data if index.fqn.startswith(fqn_prefix) and isinstance(
        metadata.state_dict_metadata[index.fqn], TensorStorageMetadata) == tensor)
    info = metadata.storage_data[index]
    return file.read_bytes()[info.offset:info.offset + info.length]
