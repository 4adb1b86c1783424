"""The rows the export tests probe a model with, the log-probs an exported HF directory gives them, and a run's final
weights as its actor exports them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.columns import compute_position_ids

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
