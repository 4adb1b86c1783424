"""Each model family on the trainer's default path (fsdp actor + hf rollout, 2 CPU workers), then ``hybridflow export``.

Per family (issue #42 item 1): a tiny HF directory of that family (every tensor moved off its init) is the
from-scratch example's ``model.path``; 2 GRPO steps run with the lean forward and the lean decoder exactly where the
fsdp plugin claims the family (:data:`hybridflow_fsdp.lean_forward.LEAN_FAMILIES`, read back from the run manifest and
the ``lean_forward_share`` metric), every logged metric finite; the run's checkpoint exported by ``hybridflow export``
loads in ``transformers`` and gives the engine's log-probs (1e-5, fp32) and the trainer's own export's logits (1e-6).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from export_probe import hf_log_probs, probe_batch

from hybridflow.export import main as export_main
from hybridflow.presets import save_tiny_model
from hybridflow.trainer import Trainer
from hybridflow_fsdp.lean_forward import LEAN_FAMILIES

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


@pytest.mark.slow  # a trainer start-up per family: ~25 s each on an idle 2-core box
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_on_the_default_path_and_exports(tmp_path: Path, tiny_config: Any, family: str) -> None:
    model_dir = save_tiny_model(tmp_path / "model", perturb=0.3, architecture=family,
                                tie_word_embeddings=family != "qwen3")
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "model.preset=null", f"model.path={model_dir}", "trainer.total_steps=2",
                         "trainer.checkpoint_every=2", "data.batch_size=8")
    trainer = Trainer(config, progress=False)
    try:
        history = trainer.fit()
        batch = probe_batch(trainer.tokenizer, trainer.step)
        actor = trainer.groups.role("actor")
        engine_log_probs = actor.compute_log_probs(batch).get(timeout=120)["old_log_probs"]
        actor.export_hf(str(tmp_path / "trainer_export"))
    finally:
        trainer.close()
    assert len(history) == 2
    for metrics in history:
        bad = {name: value for name, value in metrics.items()
               if isinstance(value, float) and not math.isfinite(value)}
        assert not bad, f"{family}: non-finite metrics {bad}"
    lean = family in LEAN_FAMILIES
    options = json.loads((run_dir / "manifest.json").read_text())["engine_options"]["actor"]
    assert options["training"]["lean_forward"] is lean, options["training"]
    assert options["training"]["forward"] == ("lean_packed" if lean else "hf_packed"), options["training"]
    assert (options["rollout"]["decoder"] == "lean") is lean, options["rollout"]
    if lean:
        assert [metrics["lean_forward_share"] for metrics in history] == [1.0, 1.0]
    # the export round trip: the run's checkpoint → an HF directory → transformers gives the engine's numbers
    out = tmp_path / "hf"
    assert export_main([str(run_dir), str(out)]) == 0
    log_probs, logits = hf_log_probs(out, batch)
    _, reference_logits = hf_log_probs(tmp_path / "trainer_export", batch)
    gap = (log_probs - engine_log_probs).abs().max().item()
    # the engine's forward (lean or HF's) against transformers on the exported weights: fp32, 1e-5 as in
    # tests/plugins/test_model_families.py (the perturbed weights' larger logits put the lean forward at ~2e-6)
    assert gap < 1e-5, f"{family}: the exported model's log-probs differ from the engine's by {gap}"
    assert torch.allclose(logits, reference_logits, atol=1e-6, rtol=0)
    assert json.loads((out / "config.json").read_text())["model_type"] == family
