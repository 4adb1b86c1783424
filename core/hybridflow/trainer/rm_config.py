"""The configuration of ``hybridflow rm``: its schema (:class:`RMConfig`, sections named as ``hybridflow sft`` names
them; the data keys are OpenRLHF's ``--prompt_key/--chosen_key/--rejected_key`` and TRL's column names) and
:func:`load_rm_config` (YAML plus dotted overrides, relative paths anchored at the YAML's folder).
Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from hybridflow.config import ModelConfig, OptimSection
from hybridflow.config_io import apply_overrides, explain_errors, read_yaml_mapping
from hybridflow.config_sections import PathList, _Section
from hybridflow.errors import ConfigError

__all__ = ["RMConfig", "RMDataSection", "RMLossSection", "load_rm_config"]


class RMDataSection(_Section):
    train_files: PathList = Field(min_length=1)  # one path or a list (jsonl/parquet), ``~`` expanded
    val_files: PathList = Field(default_factory=list)  # held-out pairs: val/accuracy, val/loss
    # column names: TRL's RewardTrainer columns; OpenRLHF's --prompt_key / --chosen_key / --rejected_key
    prompt_key: str | None = "prompt"  # null: implicit prompt (the prompt is inside chosen and rejected, as TRL allows)
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    # TRL's optional `margin` column: the loss is -log σ(r_c - r_r - margin); used when loss.use_margin is true
    margin_key: str = "margin"
    max_prompt_length: int = Field(default=8, gt=0)
    max_response_length: int = Field(default=8, gt=0)  # response tokens, the EOS appended to each included
    batch_size: int = Field(default=32, gt=0)  # pairs per optimizer step
    shuffle: bool = True


class RMLossSection(_Section):
    use_margin: bool = False  # subtract data.margin_key's value from r_c - r_r (TRL: a `margin` column)
    # TRL's center_rewards_coefficient: + coef · mean((r_c + r_r)²), pulling the rewards' mean toward 0
    center_rewards_coefficient: float = Field(default=0.0, ge=0)


class RMTrainerSection(_Section):
    total_steps: int = Field(default=200, gt=0)
    run_dir: str = "runs/rm"
    seed: int = 0
    val_every: int = Field(default=0, ge=0)  # 0: validate only before the first and after the last step
    device: Literal["cpu", "cuda"] = "cpu"
    progress: bool = True
    tensorboard: bool = True


class RMConfig(_Section):
    # where the reward model starts: an SFT run's RUN_DIR/hf (model.path; the backbone is loaded and a fresh 1-output
    # `score` head added) or a config/preset built from model.seed = trainer.seed
    model: ModelConfig = ModelConfig(preset="tiny-qwen2")
    data: RMDataSection
    loss: RMLossSection = RMLossSection()
    optim: OptimSection = OptimSection()
    trainer: RMTrainerSection = RMTrainerSection()


def load_rm_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RMConfig:
    """Read an RM YAML plus dotted overrides. Relative data files are read from the YAML's folder when the file is
    there, else from the working directory (``model.path`` is taken as given, as ``hybridflow sft`` takes it)."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        data = read_yaml_mapping(path)
        base = path.parent
    data = apply_overrides(data, list(overrides))
    files = data.get("data")
    if isinstance(files, dict):
        for key in ("train_files", "val_files"):
            if isinstance(files.get(key), str):
                files[key] = [files[key]]
            if isinstance(files.get(key), list):
                files[key] = [_anchor(str(file), base) for file in files[key]]
    try:
        return RMConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain_errors(exc.errors(), RMConfig)) from None


def _anchor(file: str, base: Path) -> str:
    if Path(file).is_absolute() or not (base / file).exists():
        return file
    return str(base / file)
