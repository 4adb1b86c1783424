"""``hybridflow export`` of runs trained with the ``deepspeed`` engine: the ZeRO checkpoint of 2 ranks → an HF
directory, reassembled offline in this process (no Ray, no process group), loaded with ``transformers`` as a user
would load it: it computes the engine's log-probs and equals the trainer's own ``export_hf``.

(The probe rows and the HF log-probs are tests/e2e/export_probe.py's, as for the fsdp and megatron engines.)
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from export_probe import hf_log_probs, probe_batch

from hybridflow.batch import Batch
from hybridflow.errors import CheckpointError
from hybridflow.export import main as hybridflow_export_main
from hybridflow.trainer import Trainer

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (bash scripts/setup.sh --all)"),
]


def export_main(*arg_lists: list[str]) -> list[int]:
    """``hybridflow export ARGS`` (the CLI's entry point, in this process) for each of ``arg_lists``, in order; their
    exit codes."""
    return [hybridflow_export_main(args) for args in arg_lists]


def _train(config: Any, trainer_export: Path) -> dict[str, torch.Tensor | Batch]:
    """Fit ``config``; return the engines' log-probs of the probe rows and write the trainer's own export."""
    trainer = Trainer(config, progress=False)
    try:
        trainer.fit()
        batch = probe_batch(trainer.tokenizer, trainer.step)
        actor = trainer.groups.role("actor")
        out: dict[str, torch.Tensor | Batch] = {
            "batch": batch, "actor": actor.compute_log_probs(batch).get(timeout=120)["old_log_probs"]}
        if "reference" in trainer.groups.role_pool:
            reference = trainer.groups.role("reference").compute_ref_log_probs(batch).get(timeout=120)
            out["reference"] = reference["ref_log_probs"]
        actor.export_hf(str(trainer_export))
    finally:
        trainer.close()
    return out


def _same_weights(left: Path, right: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(left / "model.safetensors")), load_file(str(right / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.slow  # 45-70 s in the full run of 2026-12-07 (tests/durations.json)
def test_deepspeed_zero3_export_round_trip(tmp_path: Path, tiny_config) -> None:  # type: ignore[no-untyped-def]
    """A ZeRO-3 actor on 2 ranks: its checkpoint holds only flat partitions (the module's tensors are empty), and
    the export reassembles the full model: the trainer's export_hf, tensor for tensor, and the engine's log-probs."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "actor.engine=deepspeed", "actor.extra.zero_stage=3", "trainer.total_steps=2",
                         "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2")
    probes = _train(config, tmp_path / "trainer_export")
    batch, engine_log_probs = probes["batch"], probes["actor"]
    assert isinstance(batch, Batch) and isinstance(engine_log_probs, torch.Tensor)
    checkpoint = run_dir / "checkpoints" / "step-2" / "actor"
    module = torch.load(checkpoint / "deepspeed" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        weights_only=True)["module"]
    assert module and all(tensor.numel() == 0 for tensor in module.values())  # nothing whole on disk

    out, older = tmp_path / "hf", tmp_path / "hf_step1"
    assert export_main([str(run_dir), str(out)], [str(run_dir), "--step", "1", str(older)]) == [0, 0]
    _same_weights(out, tmp_path / "trainer_export")
    log_probs = hf_log_probs(out, batch, dtype=torch.float32)[0]
    assert torch.allclose(log_probs, engine_log_probs, atol=1e-6, rtol=0), (log_probs - engine_log_probs).abs().max()
    info = json.loads((out / "hybridflow_export.json").read_text())
    assert (info["step"], info["role"], info["engine"]) == (2, "actor", "deepspeed")

    # --step 1: the checkpoint one update earlier holds other weights
    assert not torch.allclose(hf_log_probs(older, batch, dtype=torch.float32)[0], engine_log_probs, atol=1e-6, rtol=0)

    # a rank's partitions missing: a clear error naming the ranks, not a silently half-filled model
    from hybridflow.export import _role_spec, _run_config
    from hybridflow_deepspeed.export import export_checkpoint

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    (damaged / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    spec = _role_spec(_run_config(json.loads((run_dir / "manifest.json").read_text()), run_dir), "actor")
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckpointError, match=r"ranks 0\.\.1 .* it holds ranks \[0\]"):
        export_checkpoint(checkpoint=damaged, spec=spec, out_dir=tmp_path / "x")


@pytest.mark.slow
def test_deepspeed_zero1_and_bf16_zero3_with_frozen_reference_export(  # type: ignore[no-untyped-def]
        tmp_path: Path, tiny_config) -> None:
    """ZeRO-1 (module weights whole on disk) round-trips to the engine's log-probs; a bf16 ZeRO-3 actor exports
    its fp32 masters cast to bf16, exactly the trainer's export_hf; a frozen deepspeed reference (no weights saved)
    exports the model it was built from, which computes the reference engine's log-probs."""
    zero1 = tmp_path / "zero1"
    probes = _train(tiny_config(zero1, "actor.engine=deepspeed", "actor.extra.zero_stage=1", "trainer.total_steps=2",
                                "trainer.checkpoint_every=2"), tmp_path / "zero1_trainer_export")
    bf16 = tmp_path / "bf16"
    bf16_probes = _train(tiny_config(bf16, "actor.engine=deepspeed", "actor.mixed_precision=bf16",
                                     "algorithm.kl_coef=0.01", "reference.engine=deepspeed", "trainer.total_steps=2",
                                     "trainer.checkpoint_every=2"), tmp_path / "bf16_trainer_export")
    assert export_main([str(zero1), str(tmp_path / "zero1_hf")], [str(bf16), str(tmp_path / "bf16_hf")],
                       [str(bf16), "--role", "reference", str(tmp_path / "reference_hf")]) == [0, 0, 0]
    batch, engine_log_probs = probes["batch"], probes["actor"]
    assert isinstance(batch, Batch) and isinstance(engine_log_probs, torch.Tensor)
    _same_weights(tmp_path / "zero1_hf", tmp_path / "zero1_trainer_export")
    log_probs = hf_log_probs(tmp_path / "zero1_hf", batch, dtype=torch.float32)[0]
    assert torch.allclose(log_probs, engine_log_probs, atol=1e-6, rtol=0), (log_probs - engine_log_probs).abs().max()

    _same_weights(tmp_path / "bf16_hf", tmp_path / "bf16_trainer_export")
    assert not (bf16 / "checkpoints" / "step-2" / "reference" / "deepspeed").exists()
    batch, reference_log_probs = bf16_probes["batch"], bf16_probes["reference"]
    assert isinstance(batch, Batch) and isinstance(reference_log_probs, torch.Tensor)
    log_probs = hf_log_probs(tmp_path / "reference_hf", batch, dtype=torch.float32)[0]
    assert torch.allclose(log_probs, reference_log_probs, atol=1e-6, rtol=0), (log_probs - reference_log_probs)
