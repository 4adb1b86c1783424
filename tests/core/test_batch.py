"""Batch: columns, splitting, padding, version checks and zero-copy pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from hybridflow.batch import PADDING_KEY, Batch
from hybridflow.errors import VersionMismatchError


def make(n: int = 6, version: int = 1) -> Batch:
    return Batch(
        {"ids": torch.arange(n * 3).view(n, 3), "score": torch.linspace(0, 1, n)},
        {"text": [f"row{i}" for i in range(n)]},
        {"policy_version": version, "iteration": 0},
    )


def test_chunk_concat_roundtrip_and_uneven_error() -> None:
    batch = make(6)
    parts = batch.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert Batch.concat(parts).equals(batch)
    with pytest.raises(ValueError, match="multiple of 4"):
        batch.chunk(4)


def test_padded_chunk_marks_and_drops_padding() -> None:
    batch = make(5)
    parts = batch.chunk(4, pad=True)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert int(sum(p[PADDING_KEY].sum() for p in parts)) == 3
    restored = Batch.concat(parts).drop_padding()
    assert restored.equals(batch)


def test_repeat_interleave_groups_samples_per_prompt() -> None:
    batch = make(3).repeat_interleave(2)
    assert batch["ids"][:, 0].tolist() == [0, 0, 3, 3, 6, 6]
    assert list(batch["text"]) == ["row0", "row0", "row1", "row1", "row2", "row2"]


def test_union_and_select() -> None:
    batch = make(4)
    other = Batch({"reward": torch.ones(4)}, meta={"policy_version": 1})
    merged = batch | other
    assert set(merged.keys()) == {"ids", "score", "text", "reward"}
    assert set(merged.select("ids", "text").keys()) == {"ids", "text"}
    with pytest.raises(KeyError, match="nope"):
        merged.select("nope")


def test_version_mismatch_is_refused() -> None:
    with pytest.raises(VersionMismatchError, match="policy_version: 1 vs 2"):
        Batch.concat([make(2, version=1), make(2, version=2)])
    with pytest.raises(VersionMismatchError):
        _ = make(2, version=1) | make(2, version=3).select("score")


def test_pickle_uses_out_of_band_buffers_not_torch_save() -> None:
    batch = Batch({"x": torch.arange(100_000, dtype=torch.int64), "h": torch.ones(100_000, dtype=torch.bfloat16)})
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    # tensor bytes travel out of band; the in-band payload is tiny
    assert len(payload) < 2_000
    assert sum(memoryview(b).nbytes for b in buffers) == batch.nbytes()
    restored = pickle.loads(payload, buffers=buffers)
    assert restored.equals(batch)
    assert restored["h"].dtype == torch.bfloat16


def test_non_tensor_length_checked() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        Batch({"x": torch.zeros(3)}, {"y": np.array([1, 2])})


def test_mark_padding_marks_the_last_rows_without_touching_the_source() -> None:
    batch = Batch({"x": torch.arange(5)}, meta={"policy_version": 3})
    marked = batch.mark_padding(2)
    assert marked["is_padding"].tolist() == [False, False, False, True, True] and marked.meta == batch.meta
    assert "is_padding" not in batch and batch.mark_padding(0)["is_padding"].sum() == 0
    assert marked["x"].data_ptr() == batch["x"].data_ptr()  # same tensors, new container
