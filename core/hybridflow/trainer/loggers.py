"""The optional metric loggers of ``trainer.loggers`` beyond metrics.jsonl: TensorBoard, Weights & Biases (offline
unless ``WANDB_MODE`` says otherwise) and MLflow (a file store in ``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI``
is set). Each is imported only when selected, and a missing package is a clear error at start.

What is logged and when is :class:`hybridflow.trainer.progress.MetricsWriter`'s.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Literal, Protocol

from hybridflow.errors import ConfigError

__all__ = ["LOGGER_NAMES", "ScalarLogger", "build_logger"]

#: every value ``trainer.loggers`` accepts; ``console`` is the progress display, ``jsonl`` metrics.jsonl
LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


class ScalarLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _missing(name: str, package: str, exc: ImportError) -> ConfigError:
    return ConfigError(f"trainer.loggers lists {name!r} but `import {package}` fails ({exc}). Fix: pip install "
                       f"{package}, or remove {name} from trainer.loggers")


class TensorBoardLogger:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WandbMode = Literal["online", "offline", "disabled", "shared"]
#: ``WANDB_MODE`` values → the mode ``wandb.init`` takes (wandb's settings also read the older dryrun / run)
WANDB_MODES: dict[str, WandbMode] = {"online": "online", "offline": "offline", "disabled": "disabled",
                                     "shared": "shared", "dryrun": "offline", "run": "online"}


def wandb_mode() -> WandbMode:
    """The W&B mode of a run: ``WANDB_MODE``, offline (files only, no network) when unset."""
    given = os.environ.get("WANDB_MODE", "offline")
    if given not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={given!r} is not a W&B mode; expected one of {', '.join(WANDB_MODES)}. Fix: "
                          "set one of those, or unset WANDB_MODE for offline runs (files in RUN_DIR/wandb)")
    return WANDB_MODES[given]


class WandbLogger:
    """One W&B run per training run, in ``RUN_DIR/wandb``; offline (files only) unless ``WANDB_MODE`` is set."""

    def __init__(self, run_dir: Path, config: dict[str, Any] | None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb", exc) from exc
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hybridflow"), name=run_dir.name,
                              dir=str(run_dir), mode=wandb_mode(), config=config, reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({key: float(value) for key, value in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"actor": {"optim": {"lr": 0.1}}}`` → ``{"actor.optim.lr": "0.1"}`` (MLflow params are strings)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:6000]
    return out


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_metric_name(key: str) -> str:
    """MLflow accepts letters, digits, ``_ - . /`` and spaces: ``val-core/x/mean@8`` → ``val-core/x/mean_at_8``."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


class MlflowLogger:
    """One MLflow run per training run; a local file store under ``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI``."""

    def __init__(self, run_dir: Path, config: dict[str, Any] | None) -> None:
        try:
            import mlflow
        except ImportError as exc:
            raise _missing("mlflow", "mlflow", exc) from exc
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a plain directory store next to the run (MLflow ≥ 3.x asks for this opt-in to keep using it)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "hybridflow")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        for key, value in list(_flatten(config or {}).items())[:500]:  # MLflow's limit per batch: 1000 params
            self.client.log_param(self.run_id, key, value)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_metric_name(key), float(value), now, step)
                                                    for key, value in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def build_logger(name: str, run_dir: Path, config: dict[str, Any] | None) -> ScalarLogger | None:
    """The logger ``name`` writes through (None for ``console`` and ``jsonl``, which the trainer handles)."""
    if name == "tensorboard":
        try:
            return TensorBoardLogger(run_dir)
        except ImportError:  # tensorboard is an optional extra, on by default: without it the run logs the rest
            return None
    if name == "wandb":
        return WandbLogger(run_dir, config)
    if name == "mlflow":
        return MlflowLogger(run_dir, config)
    if name in ("console", "jsonl"):
        return None
    raise ConfigError(f"unknown logger {name!r} in trainer.loggers; expected some of {', '.join(LOGGER_NAMES)}")
