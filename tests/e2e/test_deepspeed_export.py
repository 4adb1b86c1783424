"""``hybridflow export`` of runs trained with the ``deepspeed`` engine: the ZeRO checkpoint of 2 ranks → an HF
directory, reassembled offline in this process (no Ray, no process group), loaded with ``transformers`` as a user
would load it: it computes the engine's log-probs and equals the trainer's own ``export_hf``.

(The probe rows and the HF log-probs are tests/e2e/export_probe.py's, as for the fsdp and megatron engines. The
ZeRO-3 round trip, a missing rank's partitions included, exports the ZeRO-3 learning run of
tests/e2e/test_deepspeed_grpo.py.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from export_probe import hf_log_probs, same_weights, train_and_probe

from hybridflow.batch import Batch
from hybridflow.export import main as hybridflow_export_main

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (bash scripts/setup.sh --all)"),
]


def export_main(*arg_lists: list[str]) -> list[int]:
    """``hybridflow export ARGS`` (the CLI's entry point, in this process) for each of ``arg_lists``, in order; their
    exit codes."""
    return [hybridflow_export_main(args) for args in arg_lists]


@pytest.mark.slow
def test_deepspeed_zero1_and_bf16_zero3_with_frozen_reference_export(  # type: ignore[no-untyped-def]
        tmp_path: Path, tiny_config) -> None:
    """ZeRO-1 (module weights whole on disk) round-trips to the engine's log-probs; a bf16 ZeRO-3 actor exports
    its fp32 masters cast to bf16, exactly the trainer's export_hf; a frozen deepspeed reference (no weights saved)
    exports the model it was built from, which computes the reference engine's log-probs."""
    zero1 = tmp_path / "zero1"
    _, probes = train_and_probe(tiny_config(zero1, "actor.engine=deepspeed", "actor.extra.zero_stage=1",
                                            "trainer.total_steps=2", "trainer.checkpoint_every=2"),
                                tmp_path / "zero1_trainer_export")
    bf16 = tmp_path / "bf16"
    _, bf16_probes = train_and_probe(tiny_config(bf16, "actor.engine=deepspeed", "actor.mixed_precision=bf16",
                                                 "algorithm.kl_coef=0.01", "reference.engine=deepspeed",
                                                 "trainer.total_steps=2", "trainer.checkpoint_every=2"),
                                     tmp_path / "bf16_trainer_export", reference=True)
    assert export_main([str(zero1), str(tmp_path / "zero1_hf")], [str(bf16), str(tmp_path / "bf16_hf")],
                       [str(bf16), "--role", "reference", str(tmp_path / "reference_hf")]) == [0, 0, 0]
    batch, engine_log_probs = probes["batch"], probes["actor"]
    assert isinstance(batch, Batch) and isinstance(engine_log_probs, torch.Tensor)
    same_weights(tmp_path / "zero1_hf", tmp_path / "zero1_trainer_export")
    log_probs = hf_log_probs(tmp_path / "zero1_hf", batch, dtype=torch.float32)[0]
    assert torch.allclose(log_probs, engine_log_probs, atol=1e-6, rtol=0), (log_probs - engine_log_probs).abs().max()

    same_weights(tmp_path / "bf16_hf", tmp_path / "bf16_trainer_export")
    assert not (bf16 / "checkpoints" / "step-2" / "reference" / "deepspeed").exists()
    batch, reference_log_probs = bf16_probes["batch"], bf16_probes["reference"]
    assert isinstance(batch, Batch) and isinstance(reference_log_probs, torch.Tensor)
    log_probs = hf_log_probs(tmp_path / "reference_hf", batch, dtype=torch.float32)[0]
    assert torch.allclose(log_probs, reference_log_probs, atol=1e-6, rtol=0), (log_probs - reference_log_probs)
