"""What the fsdp actor's train_step on two gloo ranks (the default one FSDP unit) runs besides its compute, counted by
wrapping ``torch.distributed``: one all-reduce of 32 bytes (the mini-batch's global rows and tokens, carrying the
equal-rows check as Σn and Σn²), one of 4 bytes per optimizer step (the gradient norm's summed squares: clipping on
the local shards), FSDP's one all-gather and one reduce-scatter of half the weights — and no ``all_gather_object``
(the equal-rows check used to pickle one every step). With two mini-batches the second one's counts take one more
all-reduce of 16 bytes and its optimizer step one more of 4. Rows differing across ranks still raise on every rank,
naming each rank's rows, before any other collective; the memory metrics stay exact when they are counted once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
from hybridflow.errors import EngineError
from hybridflow.testing.collectives import CollectiveCounter
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow_fsdp.optim import count_state_bytes

ROWS = 8  # 4 a rank


def _update_rank(rank: int, world_size: int, out_file: str) -> None:
    from hybridflow_fsdp.training import FSDPTrainingEngine

    engine = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2, vocab_size=48), seed=3),
        optim=OptimConfig(lr=1e-2), micro_batch_size=2,
        extra={"comm": "gloo"}))  # FSDP's collectives through gloo, counted (shared memory: test_shm_comm.py)
    batch = build_training_batch(rows=ROWS).chunk(world_size)[rank]
    counter = CollectiveCounter()
    results: dict[str, Any] = {"steps": [], "metrics": []}
    for mini_batch_size in (None, None, ROWS // 2):  # one mini-batch, again (state now populated), then two
        counter.take()
        metrics = engine.train_step(batch, loss_fn=sequence_mean_nll, mini_batch_size=mini_batch_size)
        results["steps"].append({name: tuple(value) for name, value in counter.take().get("other", {}).items()})
        counted = {f"actor/{k}": float(v) for k, v in count_state_bytes(engine.model, engine.optimizer).items()}
        results["metrics"].append(({k: metrics.get(k) for k in counted}, counted))  # counted afresh: must agree
    results["model_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # global shapes
    # rows differing across ranks: every rank raises, before FSDP's all-gather (no rank left waiting in it)
    uneven = build_training_batch(rows=ROWS).slice(0, 3 + rank)
    counter.take()
    try:
        engine.train_step(uneven, loss_fn=sequence_mean_nll)
        results["uneven"] = None
    except EngineError as error:
        results["uneven"] = str(error)
    results["uneven_counts"] = {name: tuple(value) for name, value in counter.take().get("other", {}).items()}
    counter.close()
    torch.save(results, f"{out_file}.{rank}")


def test_train_step_runs_one_small_all_reduce_and_no_pickled_collective(tmp_path: Path) -> None:
    out_file = str(tmp_path / "update.pt")
    run_rank_groups([(_update_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=240)
    for rank in range(2):
        results = torch.load(f"{out_file}.{rank}", weights_only=False)
        # every parameter dim 0 splits evenly at vocabulary 48: each rank receives exactly the other half
        half = results["model_bytes"] // 2
        one_mini, again, two_minis = results["steps"]
        for counts in (one_mini, again):
            assert counts == {"all_reduce": (2, 32 + 4), "all_gather_single": (1, half),
                              "reduce_scatter_single": (1, half)}, counts
        # the second mini-batch's counts: one more all-reduce of rows and tokens (no check); the weights are
        # gathered and reduce-scattered once per mini-batch (one optimizer step each, one norm all-reduce each)
        assert two_minis == {"all_reduce": (4, 48 + 2 * 4), "all_gather_single": (2, 2 * half),
                             "reduce_scatter_single": (2, 2 * half)}, two_minis
        for reported, counted in results["metrics"]:
            assert reported == counted, (reported, counted)
        assert results["metrics"][0][1]["actor/optimizer_state_bytes"] > 0
        assert results["uneven"] is not None and "got [3, 4] (by rank)" in results["uneven"], results["uneven"]
        # the fused all-reduce found it; all_gather_object only names the rows on this error path; nothing gathered
        assert results["uneven_counts"] == {"all_reduce": (1, 32), "all_gather_object": (1, 0)}, \
            results["uneven_counts"]
