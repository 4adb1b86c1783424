"""Two gloo ranks of the fsdp actor engine in its default sharded form — the whole model one FSDP unit running the
lean forward (``extra.fsdp_units: auto``) — compute what the per-layer-unit HF-forward form computes: log-probs,
the weights after a log-prob pass then several micro-batches of training, and the generation weights handed over
after a no-grad forward left the unit gathered."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
from hybridflow.errors import ConfigError
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow_fsdp.training import ONE_UNIT_MAX_BYTES, FSDPTrainingEngine, resolve_fsdp_units

ROWS = 12  # 6 a rank, micro-batches of 2: three backward passes per optimizer step


def _compare_rank(rank: int, world_size: int, out_file: str) -> None:
    base = TrainingEngineConfig(model=ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2), seed=3),
                                # a large eps: the update follows the gradient, not the sign of its rounding noise
                                optim=OptimConfig(lr=1e-2, eps=1e-2), micro_batch_size=2)
    batch = build_training_batch(rows=ROWS).chunk(world_size)[rank]
    results = {}
    for units in ("auto", "layers"):
        engine = FSDPTrainingEngine(role="actor", config=dataclasses.replace(base, extra={"fsdp_units": units}))
        log_probs = engine.compute_log_probs(batch)["log_probs"]
        before = {name: tensor.clone() for name, tensor in engine.generation_weights()}  # after a no-grad forward
        for _ in range(2):
            engine.compute_log_probs(batch)  # leaves the one unit gathered: training must not gather it again
            engine.train_step(batch, loss_fn=sequence_mean_nll)
        after = {name: tensor.clone() for name, tensor in engine.generation_weights()}
        results[units] = {"units": engine.fsdp_units, "lean": engine.lean is not None,
                          "log_probs": log_probs * batch["response_mask"],  # padding positions differ by design
                          "before": before, "after": after, "version": engine.state_version()}
    if rank == 0:
        torch.save(results, out_file)


def test_one_unit_lean_fsdp_matches_per_layer_fsdp(tmp_path: Path) -> None:
    out_file = str(tmp_path / "units.pt")
    run_rank_groups([(_compare_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=240)
    results = torch.load(out_file, weights_only=False)
    one, layers = results["auto"], results["layers"]
    assert (one["units"], one["lean"]) == ("model", True), "the default sharded actor is not one lean FSDP unit"
    assert (layers["units"], layers["lean"]) == ("layers", False)
    assert one["version"] == layers["version"] == 2
    assert (one["log_probs"] - layers["log_probs"]).abs().max().item() < 1e-5
    for name, full in layers["before"].items():
        assert one["before"][name].shape == full.shape and torch.equal(one["before"][name], full), name
    moved = max((layers["after"][n] - layers["before"][n]).abs().max().item() for n in layers["after"])
    assert moved > 1e-3, f"weights barely moved ({moved}); the comparison would be vacuous"
    gap = max((one["after"][n] - layers["after"][n]).abs().max().item() for n in layers["after"])
    # float sums in another order (the lean forward against HF's modules); a wrong reduction (a gradient not
    # averaged over the ranks, a shard stepped twice) moves weights by the size of an update (> 1e-3 here)
    assert gap < 1e-5, f"one-unit lean FSDP diverged from per-layer FSDP by {gap} after 2 steps"


def test_fsdp_units_setting() -> None:
    from hybridflow_fsdp.models import build_model

    model = build_model(ModelSpec(config=tiny_model_config()), role="actor")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert resolve_fsdp_units("auto", size, lean=True) == "model"
    assert resolve_fsdp_units("auto", size, lean=False) == "layers"
    assert resolve_fsdp_units("auto", ONE_UNIT_MAX_BYTES + 1, lean=True) == "layers"  # too large for one unit
    assert resolve_fsdp_units("layers", size, lean=True) == "layers"
    with pytest.raises(ConfigError, match="fsdp_units must be one of"):
        resolve_fsdp_units("layer", size, lean=True)
