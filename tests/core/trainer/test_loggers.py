"""``trainer.loggers``: metrics reach each selected logger (JSONL, TensorBoard, W&B offline, MLflow file store) and
only those; an unavailable logger is a clear error. W&B and MLflow are tested where they are installed (they are
not dependencies of hybridflow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.trainer.progress import MetricsWriter, read_metrics

ROWS = [(0, {"reward/mean": 0.25, "val-core/arith/acc/mean@8": 0.5}), (1, {"reward/mean": 0.75})]


def write_rows(writer: MetricsWriter) -> None:
    try:
        for step, metrics in ROWS:
            writer.write(step, metrics)
    finally:
        writer.close()


def test_default_loggers_are_console_jsonl_tensorboard_and_only_selected_ones_write(tmp_path: Path) -> None:
    assert load_config(None, []).trainer.loggers == ["console", "jsonl", "tensorboard"]
    write_rows(MetricsWriter(tmp_path / "both", loggers=["jsonl", "tensorboard"]))
    assert [row["reward/mean"] for row in read_metrics(tmp_path / "both")] == [0.25, 0.75]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "both" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.25), (1, 0.75)]

    write_rows(MetricsWriter(tmp_path / "tb_only", loggers=["tensorboard"]))
    assert not (tmp_path / "tb_only" / "metrics.jsonl").exists() and (tmp_path / "tb_only" / "tensorboard").is_dir()
    write_rows(MetricsWriter(tmp_path / "jsonl_only", loggers=["jsonl"]))
    assert not (tmp_path / "jsonl_only" / "tensorboard").exists()


def test_unknown_or_missing_logger_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.loggers"):
        load_config(None, ["trainer.loggers=[jsonl, neptune]"])
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"import wandb.*pip install wandb, or remove wandb"):
            MetricsWriter(tmp_path, loggers=["jsonl", "wandb"])


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb to test the wandb logger)")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the logger's default: offline, files only
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path, loggers=["wandb"], config={"trainer": {"total_steps": 2}})
    run = writer.backends["wandb"].run  # type: ignore[attr-defined]
    assert run.offline and run.config["trainer"] == {"total_steps": 2}
    for step, metrics in ROWS:
        writer.write(step, metrics)
    # step 0's row (both of its metrics) is committed once step 1 is logged; step 1's when the run finishes
    assert run.summary["reward/mean"] == 0.25 and run.summary["val-core/arith/acc/mean@8"] == 0.5
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))  # the run's records, for `wandb sync` later
    assert len(runs) == 1 and sum(p.stat().st_size for p in runs[0].glob("run-*.wandb")) > 0


def test_mlflow_file_store_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow-skinny to test it)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the logger's default: RUN_DIR/mlruns
    writer = MetricsWriter(tmp_path, loggers=["mlflow"], config={"actor": {"optim": {"lr": 0.003}}})
    run_id = writer.backends["mlflow"].run_id  # type: ignore[attr-defined]
    write_rows(writer)
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(0, 0.25), (1, 0.75)]
    assert [m.value for m in client.get_metric_history(run_id, "val-core/arith/acc/mean_at_8")] == [0.5]
    run = client.get_run(run_id)
    assert run.data.params["actor.optim.lr"] == "0.003" and run.info.status == "FINISHED"
