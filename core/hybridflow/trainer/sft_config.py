"""The configuration of ``hybridflow sft``: its schema (:class:`SFTConfig`, sections named as an RL run names them)
and :func:`load_sft_config` (YAML plus dotted overrides, relative paths anchored at the YAML's folder).
Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from hybridflow.config import (
    ModelConfig,
    OptimSection,
    ParallelSection,
    PoolConfig,
    RayConfig,
)
from hybridflow.config_io import apply_overrides, explain_errors, read_yaml_mapping
from hybridflow.config_sections import PathList, _Section
from hybridflow.errors import ConfigError

__all__ = ["SFTConfig", "SFTDataSection", "load_sft_config"]


# --- configuration -----------------------------------------------------------------------------------------------
class SFTDataSection(_Section):
    train_files: PathList = Field(min_length=1)  # one path or a list, ``~`` expanded (as the RL run's)
    val_files: PathList = Field(default_factory=list)
    prompt_key: str = "prompt"      # verl: data.prompt_key
    response_key: str = "response"  # verl: data.response_key
    # verl: data.prompt_dict_keys / response_dict_keys — keys into a dict column (e.g. prompt_key: extra_info,
    # prompt_dict_keys: [question]); a prompt given as chat messages is rendered with the tokenizer's chat template
    prompt_dict_keys: list[str] = Field(default_factory=list)
    response_dict_keys: list[str] = Field(default_factory=list)
    # verl: data.multiturn.messages_key / tools_key. Set: rows are multi-turn conversations (a list of {role,
    # content}; tool output masked from the loss, tokenized as the agent loop does) instead of prompt + response
    messages_key: str | None = None
    tools_key: str = "tools"
    max_prompt_length: int = Field(default=8, gt=0)
    max_response_length: int = Field(default=8, gt=0)  # response tokens, the EOS appended to each included
    batch_size: int = Field(default=32, gt=0)  # rows per optimizer step over all ranks (verl: train_batch_size)
    shuffle: bool = True


class SFTActorSection(_Section):
    engine: str = "fsdp"
    pool: str = "main"
    parallel: ParallelSection = ParallelSection()
    micro_batch_size: int = Field(default=64, gt=0)
    # as the RL roles' (hybridflow.precision): auto = bf16 compute from 1M fp32 parameters on a native-bf16 device
    mixed_precision: Literal["auto", "none", "bf16"] = "auto"
    gradient_checkpointing: bool = False
    optim: OptimSection = OptimSection()
    extra: dict[str, Any] = Field(default_factory=dict)


class SFTRolloutSection(_Section):
    """The engine that generates the greedy validation answers (colocated with training, as in RL)."""

    engine: str = "hf"
    extra: dict[str, Any] = Field(default_factory=dict)


class SFTRewardSection(_Section):
    # scores the greedy validation answers against the val rows' responses (exact match: acc); null = loss only
    function: str | None = "arithmetic"


class SFTTrainerSection(_Section):
    total_steps: int = Field(default=100, gt=0)
    run_dir: str = "runs/sft"
    seed: int = 0
    val_every: int = Field(default=0, ge=0)  # 0: validate only before the first and after the last step
    progress: bool = True
    tensorboard: bool = True
    deadline_s: float = Field(default=900.0, gt=0)
    threads_per_worker: int = Field(default=1, gt=0)


class SFTConfig(_Section):
    model: ModelConfig = ModelConfig(preset="tiny-qwen2")
    data: SFTDataSection
    actor: SFTActorSection = SFTActorSection()
    rollout: SFTRolloutSection = SFTRolloutSection()
    reward: SFTRewardSection = SFTRewardSection()
    resource_pools: dict[str, PoolConfig] = Field(default_factory=lambda: {"main": PoolConfig(devices_per_node=[2])})
    ray: RayConfig = RayConfig()
    trainer: SFTTrainerSection = SFTTrainerSection()

    @model_validator(mode="after")
    def _pool_and_batch(self) -> SFTConfig:
        if self.actor.pool not in self.resource_pools:
            raise ValueError(f"actor.pool is {self.actor.pool!r}, not one of resource_pools "
                             f"({', '.join(self.resource_pools)})")
        world = self.resource_pools[self.actor.pool].world_size
        if self.data.batch_size % world:
            raise ValueError(f"data.batch_size = {self.data.batch_size} rows must be a multiple of the "
                             f"{world} ranks of pool {self.actor.pool!r} (rows are split over them)")
        return self


def load_sft_config(path: str | Path | None, overrides: Sequence[str] = ()) -> SFTConfig:
    """Read an SFT YAML plus dotted overrides. Relative data files are read from the YAML's folder when the file is
    there, else from the working directory; a ``file.py:function`` reward is anchored as ``hybridflow train`` does."""
    from hybridflow.rewards import resolve_function_path

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
            if isinstance(files.get(key), str):  # one path (as verl takes it) is the one-element list
                files[key] = [files[key]]
            if isinstance(files.get(key), list):
                files[key] = [_anchor(str(file), base) for file in files[key]]
    reward = data.get("reward")
    if isinstance(reward, dict) and isinstance(reward.get("function"), str):
        data["reward"] = {**reward, "function": resolve_function_path(reward["function"], base)}
    try:
        return SFTConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain_errors(exc.errors(), SFTConfig)) from None


def _anchor(file: str, base: Path) -> str:
    """``file`` as the config means it: relative paths are taken from the config's folder when the file is there,
    else from the working directory."""
    if Path(file).is_absolute() or not (base / file).exists():
        return file
    return str(base / file)
