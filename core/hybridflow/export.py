"""``hybridflow export RUN_DIR [--step N] [--role actor] OUT_DIR``: a Hugging Face model directory (config, safetensors,
tokenizer, generation config) from one role of a run's checkpoint, offline: no Ray, no process group.

What a checkpoint holds is its engine's business: the engine's plugin registers a checkpoint exporter under the
engine's name (``hybridflow_register_checkpoint_exporters``) and this module finds it by the engine name the run's
manifest recorded for the role. The tokenizer and generation config are written here, the same for every engine.
Stability: public.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hybridflow.errors import CheckpointError, HybridflowError

if TYPE_CHECKING:
    from hybridflow.config import Config
    from hybridflow.workers import RoleSpec

__all__ = ["CheckpointExporter", "export_run", "checkpoint_steps", "main", "EXPORT_INFO_FILE"]

#: written next to the weights: which run, step, role and engine the directory came from
EXPORT_INFO_FILE = "hybridflow_export.json"
#: roles whose model is a causal LM (tokenizer and generation config make sense for them)
_GENERATING_ROLES = ("actor", "reference", "rollout")
_STEP_PREFIX = "step-"


class CheckpointExporter(Protocol):
    """What a plugin registers per engine name: read one role's checkpoint directory in this process and write
    ``config.json`` + ``model.safetensors`` into ``out_dir`` (which exists and is empty). Stability: public."""

    def __call__(self, *, checkpoint: Path, spec: RoleSpec, out_dir: Path) -> None: ...


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps with a published checkpoint under ``RUN_DIR/checkpoints`` (ascending; empty when none)."""
    from hybridflow.trainer.checkpoint import CHECKSUM_FILE

    root = Path(run_dir) / "checkpoints"
    steps = []
    for path in root.glob(f"{_STEP_PREFIX}*") if root.is_dir() else ():
        suffix = path.name.removeprefix(_STEP_PREFIX)
        if suffix.isdigit() and (path / CHECKSUM_FILE).exists():
            steps.append(int(suffix))
    return sorted(steps)


def _read_manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "manifest.json"
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist. Fix: pass the trainer.run_dir of a run")
    if not path.exists():
        raise CheckpointError(f"{run_dir} has no manifest.json: expected a hybridflow run directory (the trainer "
                              "writes manifest.json when the run starts). Fix: pass the trainer.run_dir of a run")
    try:
        manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg}); the run directory is damaged") from exc
    return manifest


def _select_step(run_dir: Path, step: int | None) -> Path:
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise CheckpointError(f"{run_dir / 'checkpoints'} holds no checkpoint, so there is nothing to export. Fix: "
                              "train with trainer.checkpoint_every > 0 (the trainer then also checkpoints the last "
                              "step)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"no checkpoint of step {step} in {run_dir / 'checkpoints'}; it holds steps "
                              f"{', '.join(map(str, steps))} (older ones are pruned by trainer.keep_checkpoints). "
                              "Fix: pass --step with one of those, or omit it for the latest")
    return run_dir / "checkpoints" / f"{_STEP_PREFIX}{step}"


def _run_config(manifest: dict[str, Any], run_dir: Path) -> Config:
    from hybridflow.config import Config

    try:
        return Config.model_validate(manifest["config"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{run_dir / 'manifest.json'} does not hold a config this hybridflow can read "
                              f"({type(exc).__name__}: {exc}); export with the hybridflow version that trained the "
                              "run") from exc


def _check_reachable(source: str | None, role: str) -> None:
    if source is not None and not Path(source).is_dir():
        raise CheckpointError(f"the run's {role} model came from {source!r}, which is not a directory from here "
                              f"({Path.cwd()}); export reads its config and tokenizer from it. Fix: run export from "
                              "the directory the run was started in, or make that path reachable")


def _role_spec(config: Config, role: str) -> RoleSpec:
    """The spec the run built the role's engine from (same planning as the trainer, no workers)."""
    from hybridflow import registries
    from hybridflow.trainer.build import build_tokenizer, plan_roles
    from hybridflow.workers import RoleSpec

    algorithm = registries.algorithms.get(config.algorithm.name)
    tokenizer = build_tokenizer(config.role_model(config.actor))
    plans = plan_roles(config, algorithm.roles(config), tokenizer=tokenizer, algorithm=algorithm)
    for plan in plans:
        if plan.role == role and isinstance(plan.spec, RoleSpec):  # (a judge has no training engine to export)
            return plan.spec
    raise CheckpointError(f"role {role!r} is not a role of algorithm {config.algorithm.name!r} "
                          f"(its roles: {', '.join(p.role for p in plans)})")


def _write_tokenizer(config: Config, spec: RoleSpec, out_dir: Path) -> list[str]:
    """Save the run's tokenizer (and, for a causal LM, a generation config) into ``out_dir``; return the files."""
    from hybridflow.trainer.build import build_tokenizer

    before = {p.name for p in out_dir.iterdir()}
    tokenizer = build_tokenizer(config.role_model(config.actor))
    tokenizer.save_pretrained(str(out_dir))
    if spec.role in _GENERATING_ROLES:
        source = spec.engine_config.model.path
        if source is not None and (Path(source) / "generation_config.json").exists():
            shutil.copy2(Path(source) / "generation_config.json", out_dir / "generation_config.json")
        else:
            from transformers import GenerationConfig

            GenerationConfig(  # type: ignore[no-untyped-call]  # unannotated in transformers
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out_dir))
    return sorted({p.name for p in out_dir.iterdir()} - before)


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, role: str = "actor",
               overwrite: bool = False) -> Path:
    """Export ``role`` of the checkpoint of ``step`` (the latest when None) of ``run_dir`` as an HF directory.

    Raises:
        CheckpointError: no run directory or checkpoint, a step or role the run did not checkpoint, a checkpoint
            that fails its checksums, or a non-empty ``out_dir`` without ``overwrite``.
        UnknownNameError: the role's engine has no registered exporter.
    """
    from hybridflow import registries
    from hybridflow.plugins import load_plugins
    from hybridflow.trainer.checkpoint import CheckpointManager

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    manifest = _read_manifest(run_dir)
    step_dir = _select_step(run_dir, step)
    roles = sorted(p.name for p in step_dir.iterdir() if p.is_dir())
    if role not in roles:
        raise CheckpointError(f"checkpoint {step_dir} holds no role {role!r}; it holds {', '.join(roles) or 'none'}. "
                              "Fix: pass --role with one of those")
    CheckpointManager(run_dir).verify(step_dir)  # every file against its checksum; names a bad one
    load_plugins()
    config = _run_config(manifest, run_dir)
    _check_reachable(config.role_model(config.actor).path, "actor")  # the tokenizer's source
    spec = _role_spec(config, role)
    _check_reachable(spec.engine_config.model.path, role)
    engine = str(manifest.get("mapping", {}).get(role, {}).get("engine") or spec.engine)
    exporter: CheckpointExporter = registries.checkpoint_exporters.get(engine)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise CheckpointError(f"output directory {out_dir} is not empty. Fix: pass a new directory, or --force "
                                  "to replace its contents")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    exporter(checkpoint=step_dir / role, spec=spec, out_dir=out_dir)
    for required in ("config.json", "model.safetensors"):
        if not (out_dir / required).exists():
            owner = registries.checkpoint_exporters.owner(engine)
            raise CheckpointError(f"the {engine!r} checkpoint exporter ({owner}) wrote no {required} into {out_dir}; "
                                  "report this to the plugin's authors")
    tokenizer_files = _write_tokenizer(config, spec, out_dir)
    info = {"run_dir": str(run_dir.resolve()), "step": int(step_dir.name.removeprefix(_STEP_PREFIX)), "role": role,
            "engine": engine, "config_hash": manifest.get("config_hash"), "tokenizer_files": tokenizer_files}
    (out_dir / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=1), encoding="utf-8")
    return out_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow export",
                                     description="Write a Hugging Face model directory from a run's checkpoint.")
    parser.add_argument("run_dir", help="the run directory (trainer.run_dir)")
    parser.add_argument("out_dir", help="where to write the HF directory (new or empty)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--role", default="actor", help="which role's model (default: actor)")
    parser.add_argument("--force", action="store_true", help="replace the contents of a non-empty OUT_DIR")
    args = parser.parse_args(argv)
    try:
        out = export_run(args.run_dir, args.out_dir, step=args.step, role=args.role, overwrite=args.force)
    except HybridflowError as exc:
        print(f"hybridflow export: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    info = json.loads((out / EXPORT_INFO_FILE).read_text(encoding="utf-8"))
    print(f"exported {info['role']} of step {info['step']} ({info['engine']}) to {out}: "
          + ", ".join(sorted(p.name for p in out.iterdir())))
    return 0
