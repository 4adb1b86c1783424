"""FSDP's all-gather and reduce-scatter through shared memory on ranks of one host (``extra.comm``, shm_comm.py):
the same weights bit for bit as gloo's collectives, none of their bytes through gloo, nothing left in /dev/shm, and
clear errors where it cannot run. Real gloo ranks, real FSDP2."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.engines import OptimConfig, TrainingEngineConfig
from hybridflow.errors import ConfigError
from hybridflow.testing.collectives import GATHERS, CollectiveCounter
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import even_split_step_inputs, sequence_mean_nll

STEPS = 3


def _engine(spec: Any, comm: str) -> Any:
    from hybridflow_fsdp.training import FSDPTrainingEngine

    return FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, mixed_precision="bf16",
        extra={"fsdp_units": "model", "comm": comm}))


def _rank(rank: int, world_size: int, out_file: str) -> None:
    from hybridflow_fsdp.shm_comm import SHM_DIR

    spec, batch, _prompts = even_split_step_inputs(rank, world_size)
    # the same seed: the same initial weights. shm, not auto: auto leaves a model this small (0.3 MB) on gloo
    engines = {comm: _engine(spec, comm) for comm in ("shm", "gloo")}
    auto_reason = _engine(spec, "auto").shm_comm_unused_reason
    counter = CollectiveCounter()
    weights: dict[str, list[list[torch.Tensor]]] = {comm: [] for comm in engines}
    counts: dict[str, list[dict[str, Any]]] = {comm: [] for comm in engines}
    for _ in range(STEPS):
        for comm, engine in engines.items():
            counter.take()
            counter.phase = "handover"
            dict(engine.generation_weights(park=True))  # the trainer's path: FSDP's all-gather is the handover
            engine.end_generation()
            counter.phase = "update"
            engine.train_step(batch, loss_fn=sequence_mean_nll)
            counts[comm].append(counter.take())
            weights[comm].append([p.to_local().detach().clone() for p in engine.model.parameters()])
    counter.close()
    shm = engines["shm"].model._get_fsdp_state()._fsdp_param_groups[0]
    # every buffer was mapped by both ranks and its file unlinked then: none of this engine's is left
    left = sorted(path.name for path in SHM_DIR.glob(f"{shm._all_gather_comm.shared.prefix}*"))
    torch.save({"weights": weights, "counts": counts, "left": left,
                "reasons": {comm: engine.shm_comm_unused_reason for comm, engine in engines.items()},
                "auto": auto_reason,
                "calls": (shm._all_gather_comm.calls, shm._reduce_scatter_comm.calls,
                          shm._all_gather_comm.fallbacks, shm._reduce_scatter_comm.fallbacks)}, f"{out_file}.{rank}")


def test_shared_memory_collectives_train_bitwise_as_gloo_with_no_bytes_through_it(tmp_path: Path) -> None:
    out_file = str(tmp_path / "shm.pt")
    run_rank_groups([(_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=300)
    for rank in range(2):
        result = torch.load(f"{out_file}.{rank}", weights_only=False)
        assert result["reasons"] == {"shm": None, "gloo": "extra.comm is gloo"}, result["reasons"]
        assert "under auto's 4194304" in result["auto"], result["auto"]
        assert result["left"] == [], result["left"]
        all_gathers, reduce_scatters, *fallbacks = result["calls"]
        # one all-gather a step (the handover; the update's forward reuses it) and one reduce-scatter a micro-batch
        assert all_gathers == STEPS and reduce_scatters >= STEPS and fallbacks == [0, 0], result["calls"]
        for step in range(STEPS):
            shm_counts, gloo_counts = result["counts"]["shm"][step], result["counts"]["gloo"][step]
            for name in (*GATHERS, "reduce_scatter_single", "reduce_scatter_tensor"):
                for phase in ("handover", "update"):
                    assert shm_counts.get(phase, {}).get(name, (0, 0))[1] == 0, (phase, name, shm_counts)
            assert gloo_counts["handover"]["all_gather_single"][1] > 0, gloo_counts
            assert gloo_counts["update"]["reduce_scatter_single"][1] > 0, gloo_counts
            # two ranks: a + b in bf16 either way, so the same gradients, the same AdamW step, the same weights
            for shm_weight, gloo_weight in zip(result["weights"]["shm"][step], result["weights"]["gloo"][step],
                                               strict=True):
                assert torch.equal(shm_weight, gloo_weight)
        first, last = result["weights"]["shm"][0], result["weights"]["shm"][-1]
        assert any(not torch.equal(a, b) for a, b in zip(first, last, strict=True))  # it trained


def test_comm_setting_is_checked_and_shm_where_it_cannot_run_is_an_error() -> None:
    spec, _batch, _prompts = even_split_step_inputs(0, 1)
    with pytest.raises(ConfigError, match=r"actor\.extra\.comm must be one of \['auto', 'shm', 'gloo'\], got 'tcp'"):
        _engine(spec, "tcp")
    # one rank (the in-process group of a single-process engine): nothing to share, auto says why, shm refuses
    assert "one rank" in str(_engine(spec, "auto").shm_comm_unused_reason)
    with pytest.raises(ConfigError, match=r"extra\.comm is shm, but .* one rank: nothing to communicate\. Fix"):
        _engine(dataclasses.replace(spec), "shm")


def test_too_little_shared_memory_is_refused_before_any_buffer_is_written(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """/dev/shm is a tmpfs: writing past its free space is a SIGBUS (Docker's default is 64 MB), so the free space
    is checked first, and a directory that cannot be written is refused."""
    import os

    import torch.distributed as dist

    from hybridflow_fsdp import shm_comm
    from hybridflow_fsdp.distributed import ensure_process_group

    ensure_process_group("cpu")
    free = os.statvfs(shm_comm.SHM_DIR).f_bavail * os.statvfs(shm_comm.SHM_DIR).f_frsize
    group, cpu = dist.group.WORLD, torch.device("cpu")
    assert shm_comm.same_host_reason(group, cpu, need_bytes=free // 2) is None
    reason = shm_comm.same_host_reason(group, cpu, need_bytes=free + (1 << 30))
    assert reason is not None and "MiB free" in reason and "--shm-size" in reason, reason
    assert shm_comm.same_host_reason(group, torch.device("meta")) == "the device is meta, not the CPU"
    monkeypatch.setattr(shm_comm, "SHM_DIR", tmp_path / "missing")
    assert shm_comm.same_host_reason(group, cpu) == f"{tmp_path / 'missing'} is not a writable directory"
