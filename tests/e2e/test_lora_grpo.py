"""GRPO with LoRA through the trainer (FSDP actor on 2 ranks, HF rollout): the reward rises while only the adapters
train; the rollout generates with the merged weights (the base handed over once, then adapter-only syncs of
LoRA factor bytes); the step metrics and the ledger carry the per-rank memory
counts; checkpoints hold only the adapters; ``hybridflow export`` merges them into an HF directory whose logits are
the engine's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from export_probe import PROMPTS, hf_log_probs

from hybridflow.batch import Batch
from hybridflow.export import main as export_main
from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer

#: a dense reward the tiny random-init model can learn in a few steps: the share of digits in the response
REWARD = '''
def digit_share(*, responses, ground_truths, data_sources, extra=None):
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]
'''
STEPS = 16
# mean reward of the first 4 steps → of the last 8, lr 0.1, rank 8 (all-linear), measured on trainer.seed 0, 1, 2:
#   0.238 → 0.301, 0.262 → 0.318, 0.254 → 0.315   (rises 0.063, 0.056, 0.061; the test runs seed 0)
# (lr 0.03 rises as much in 20 steps: 0.257 → 0.337 over the first/last 4 on seed 0.)
MARGIN = 0.035


def _prompts(tokenizer: Any, version: int) -> Batch:
    encoded = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return Batch({"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask},
                 meta={"policy_version": version, "iteration": version})


@pytest.mark.slow  # one 16-step trainer run and an export: ~40 CPU-seconds
def test_grpo_learns_with_lora_and_exports_the_merged_model(tmp_path: Path, tiny_config,
                                                            preset_weight_bytes) -> None:
    (tmp_path / "digits.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "actor.lora.rank=8", "actor.optim.lr=0.1", f"trainer.total_steps={STEPS}",
                         f"trainer.checkpoint_every={STEPS}", f"reward.function={tmp_path / 'digits.py'}:digit_share",
                         "trainer.seed=0")
    trainer = Trainer(config, progress=False)
    try:
        history = trainer.fit()
        actor = trainer.groups.role("actor")
        generated = actor.generate(_prompts(trainer.tokenizer, trainer.step)).get(timeout=120)
        engine_log_probs = actor.compute_log_probs(generated).get(timeout=120)["old_log_probs"]
        actor.export_hf(str(tmp_path / "trainer_export"))
    finally:
        trainer.close()

    rewards = [m["reward/mean"] for m in history]
    assert sum(rewards[-8:]) / 8 > sum(rewards[:4]) / 4 + MARGIN, rewards
    # the rollout generated with the merged weights W + B·A·scale: its log-probs are the training engine's
    mask = generated["response_mask"].bool()
    assert torch.allclose(generated["rollout_log_probs"][mask], engine_log_probs[mask], atol=1e-4)

    # per-rank memory, counted from tensors: rank-8 adapters on the 7 projections of 2 layers (hidden 64, KV 32,
    # MLP 128) are 16,384 parameters, FSDP gives each rank half of them and of their AdamW moments (+ step counts)
    per_layer = sum(i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)])
    per_rank = 2 * 8 * per_layer // 2
    assert all(m["actor/trainable_params"] == m["actor/optimizer_params"] == per_rank == 8192 for m in history)
    assert all(m["actor/trainable_weight_bytes"] == per_rank * 4 < m["actor/weight_bytes"] for m in history)
    assert all(2 * per_rank * 4 < m["actor/optimizer_state_bytes"] <= 2 * per_rank * 4 + 28 * 8 for m in history)
    ledger = read_ledger(run_dir)
    assert [row["metrics"]["actor/optimizer_state_bytes"] for row in ledger] == \
        [m["actor/optimizer_state_bytes"] for m in history]

    # adapter-only weight sync (the default with LoRA on fsdp + hf): the ledger's handover edge per step and rank is
    # the base model once (each rank receives the half it lacks, through the planner), then only the adapters (each
    # rank all-gathers the half of the 2 · 8192 · 4 adapter bytes it lacks), far below the merged model's half
    model_bytes = preset_weight_bytes("tiny-qwen2")[0]
    adapter_bytes = 2 * per_rank * 4
    edges = [next(e for e in row["edges"] if e["target"] == "actor.rollout_engine") for row in ledger]
    first = edges[0]["bytes_per_rank"]
    assert len(first) == 2 and all(b > 2 * adapter_bytes for b in first), edges[0]
    later = [b for edge in edges[1:] for b in edge["bytes_per_rank"]]
    assert len(later) == 2 * (STEPS - 1) and all(b == adapter_bytes // 2 for b in later), later
    assert max(later) <= 2 * adapter_bytes and 4 * max(later) < model_bytes // 2, (later, model_bytes)

    # the checkpoint holds the adapters only; the export merges them into the base
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    checkpoint = run_dir / "checkpoints" / f"step-{STEPS}" / "actor"
    keys = [k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(k.endswith((".lora_A", ".lora_B")) for k in keys)
    out = tmp_path / "hf"
    assert export_main([str(run_dir), str(out)]) == 0
    from safetensors.torch import load_file

    exported, reference = load_file(out / "model.safetensors"), load_file(tmp_path / "trainer_export" /
                                                                          "model.safetensors")
    assert exported.keys() == reference.keys() and not any("lora" in name for name in exported)
    assert all(torch.equal(exported[name], reference[name]) for name in exported)
    log_probs = hf_log_probs(out, generated)[0]
    gap = (log_probs[mask] - engine_log_probs[mask]).abs().max()
    assert gap < 1e-5, gap
    assert json.loads((out / "hybridflow_export.json").read_text())["step"] == STEPS
