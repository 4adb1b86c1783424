"""``trainer.loggers``: metrics reach each selected logger (JSONL, TensorBoard, W&B offline, MLflow file store) and
only those; an unavailable logger is a clear error. W&B and MLflow are not dependencies of hybridflow but are in its
``test`` extra (wandb, mlflow-skinny): their tests read back what the run wrote, and skip only where they are not
installed (a failure under HYBRIDFLOW_REQUIRE_ENGINES=1, see tests/conftest.py)."""

from __future__ import annotations

import json
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_unknown_or_missing_logger_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.loggers"):
        load_config(None, ["trainer.loggers=[jsonl, neptune]"])
    monkeypatch.setitem(sys.modules, name, None)  # `import NAME` raises ImportError, as where it is not installed
    with pytest.raises(ConfigError, match=rf"lists '{name}' but `import {name}` fails .*Fix: pip install {name}, or "
                                          rf"remove {name} from trainer\.loggers"):
        MetricsWriter(tmp_path, loggers=["jsonl", name])


def test_wandb_mode_is_offline_unless_set_and_a_bad_one_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.trainer.loggers import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # wandb's older name for offline
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ConfigError, match=r"WANDB_MODE='ofline' is not a W&B mode; expected one of online, offline"):
        MetricsWriter(tmp_path, loggers=["wandb"])


#: W&B's run file (``run-<id>.wandb``): this header, then LevelDB-log blocks of chunks, each a record or a piece of one
WANDB_HEADER, WANDB_BLOCK, WANDB_CHUNK_HEADER = b":W&B\xe1\xbe\x00", 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """The records (``wandb_internal_pb2.Record``) of an offline run file, each chunk's CRC-32 checked: what ``wandb
    sync`` would upload. wandb ships no reader for it, so this is one (W&B's LevelDB-log layout: 32 KiB blocks of
    chunks with a 4-byte CRC-32 over type and data, a 2-byte length and a type byte; a block's tail shorter than a
    chunk header is padding)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:len(WANDB_HEADER)] == WANDB_HEADER, f"{path} is not a W&B run file: starts {data[:8]!r}"
    position, pending = len(WANDB_HEADER), b""
    while position + WANDB_CHUNK_HEADER <= len(data):
        left = WANDB_BLOCK - position % WANDB_BLOCK
        if left < WANDB_CHUNK_HEADER:
            position += left
            continue
        crc = int.from_bytes(data[position:position + 4], "little")
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        chunk = data[position + WANDB_CHUNK_HEADER:position + WANDB_CHUNK_HEADER + length]
        position += WANDB_CHUNK_HEADER + length
        if kind == 0 and length == 0:  # zero padding
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad CRC at byte {position}"
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (in the test extra: pip install -e '.[test]')")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the logger's default: offline, files only, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path, loggers=["wandb"], config={"trainer": {"total_steps": 2}})
    assert writer.backends["wandb"].run.offline  # type: ignore[attr-defined]
    write_rows(writer)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # the run's records, for `wandb sync` later
    assert len(runs) == 1, runs
    # run.finish() returns when wandb's service has handled the exit; its writer may still hold the file's last block
    # (a loaded CI box read the run record without the history once): wait, bounded, for the exit record on disk
    deadline = time.monotonic() + 60
    while True:
        try:
            records = list(wandb_records(runs[0]))
        except AssertionError:  # a chunk still being written
            records = []
        if any(record.HasField("exit") for record in records):
            break
        assert time.monotonic() < deadline, f"{runs[0]} holds no whole exit record 60 s after run.finish()"
        time.sleep(0.2)
    history = [(record.history.step.num, {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                          for item in record.history.item})
               for record in records if record.HasField("history")]
    assert [(step, {k: v for k, v in row.items() if not k.startswith("_")}) for step, row in history] == ROWS
    assert [row["_step"] for _, row in history] == [0, 1]
    (run,) = [record.run for record in records if record.HasField("run")]
    assert run.project == "hybridflow" and run.display_name == tmp_path.name
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"] == {"total_steps": 2}


def test_mlflow_file_store_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (in the test extra: pip install -e "
                                                  "'.[test]', which has mlflow-skinny)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the logger's default: RUN_DIR/mlruns
    writer = MetricsWriter(tmp_path, loggers=["mlflow"], config={"actor": {"optim": {"lr": 0.003}}})
    run_id = writer.backends["mlflow"].run_id  # type: ignore[attr-defined]
    write_rows(writer)
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(0, 0.25), (1, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val-core/arith/acc/mean_at_8")] == [(0, 0.5)]
    run = client.get_run(run_id)
    assert run.data.params["actor.optim.lr"] == "0.003" and run.info.status == "FINISHED"
    assert run.info.run_name == tmp_path.name
    # and on disk: the file store's metric file, one "timestamp value step" line per step
    (metric_file,) = (tmp_path / "mlruns").glob(f"*/{run_id}/metrics/reward/mean")
    assert [line.split()[1:] for line in metric_file.read_text().splitlines()] == [["0.25", "0"], ["0.75", "1"]]
