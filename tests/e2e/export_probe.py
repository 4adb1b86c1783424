"""The rows the export tests probe a model with, the log-probs an exported HF directory gives them, a run's final
weights as its actor exports them, and a run that is probed and exported at its end (so a learning run of another
test can be the run an export round trip checks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hybridflow.batch import Batch
from hybridflow.columns import compute_position_ids
from hybridflow.export import main as export_main

PROMPTS = ["3+4=", "12+9=", "7+7=", "0+5="]


def probe_batch(tokenizer: Any, version: int) -> Batch:
    """Left-padded prompts followed by a fixed 3-token response (the same rows for engine and export)."""
    encoded = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    responses = torch.tensor([[4 + (i + j) % 10 for j in range(3)] for i in range(len(PROMPTS))])
    input_ids = torch.cat([encoded.input_ids, responses], dim=1)
    attention_mask = torch.cat([encoded.attention_mask, torch.ones_like(responses)], dim=1)
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "responses": responses},
                 meta={"policy_version": version})


def hf_log_probs(model_dir: Path, batch: Batch, **load: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of ``batch``'s responses, full logits) from the HF model loaded from ``model_dir`` (``load``: keyword
    arguments of ``from_pretrained``, e.g. ``dtype``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, **load).eval()
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask,
                       position_ids=compute_position_ids(mask)).logits.float()
    width = batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -width - 1:-1], dim=-1)
    return log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1), logits


def fit_and_export(config: Any, export_dir: Path) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Train ``config`` to the end; its metrics per step and the actor's final weights (exported to ``export_dir``)."""
    from safetensors.torch import load_file

    from hybridflow.trainer import Trainer

    trainer = Trainer(config, progress=False)
    try:
        history = trainer.fit()
        actor = trainer.worker_groups().role("actor")
        assert actor is not None
        actor.export_hf(str(export_dir))
    finally:
        trainer.close()
    return history, load_file(str(export_dir / "model.safetensors"))


class ProbedRun(NamedTuple):
    """A module's trainer run that a learning test reads and an export round trip exports (``train_and_probe``)."""

    run_dir: Path
    trainer_export: Path  # the trainer's own export_hf of the actor at the end
    history: list[dict[str, float]]
    probes: dict[str, Any]  # the probe rows and the actor engine's log-probs of them


def train_and_probe(config: Any, trainer_export: Path, *, reference: bool = False
                    ) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Fit ``config``; its metrics per step and the probe: ``batch`` (the probe rows at the final policy version),
    ``actor`` (the actor engine's log-probs of them) and, with ``reference``, ``reference`` (the reference engine's).
    The trainer's own ``export_hf`` of the actor goes to ``trainer_export``."""
    from hybridflow.trainer import Trainer

    trainer = Trainer(config, progress=False)
    try:
        history = trainer.fit()
        batch = probe_batch(trainer.tokenizer, trainer.step)
        actor = trainer.groups.role("actor")
        probes: dict[str, Any] = {
            "batch": batch, "actor": actor.compute_log_probs(batch).get(timeout=120)["old_log_probs"]}
        if reference:
            probes["reference"] = trainer.groups.role("reference").compute_ref_log_probs(batch).get(
                timeout=120)["ref_log_probs"]
        actor.export_hf(str(trainer_export))
    finally:
        trainer.close()
    return history, probes


def check_round_trip(run_dir: Path, out: Path, trainer_export: Path, probes: dict[str, Any], step: int) -> None:
    """``hybridflow export RUN OUT`` exports the checkpoint of ``step``; loaded with ``transformers`` it computes the
    actor engine's log-probs of the probe rows, and the logits of the trainer's own export."""
    assert export_main([str(run_dir), str(out)]) == 0
    batch, engine_log_probs = probes["batch"], probes["actor"]
    log_probs, logits = hf_log_probs(out, batch)
    _, reference_logits = hf_log_probs(trainer_export, batch)
    assert torch.allclose(log_probs, engine_log_probs, atol=1e-6, rtol=0), (log_probs - engine_log_probs).abs().max()
    assert torch.allclose(logits, reference_logits, atol=1e-6, rtol=0)
    info = json.loads((out / "hybridflow_export.json").read_text())
    assert info["step"] == step and info["role"] == "actor"


def same_weights(left: Path, right: Path) -> None:
    """The two exported directories hold the same tensors (names, dtypes, values)."""
    from safetensors.torch import load_file

    a, b = load_file(str(left / "model.safetensors")), load_file(str(right / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
