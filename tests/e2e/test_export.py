"""``hybridflow export``: a trained run's checkpoint → an HF directory whose model computes the engine's log-probs.

The run is the README's GRPO job, shortened; the export runs offline in this process (no Ray, no process group) and
is loaded with ``transformers`` as a user would load it.
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
from hybridflow.export import main as export_main
from hybridflow.trainer import Trainer


def _train_and_probe(config: Any, reference_dir: Path) -> tuple[torch.Tensor, Batch]:
    """Fit ``config``; return the actor engine's log-probs of the probe rows and write the trainer's own export."""
    trainer = Trainer(config, progress=False)
    try:
        trainer.fit()
        batch = probe_batch(trainer.tokenizer, trainer.step)
        actor = trainer.groups.role("actor")
        engine_log_probs = actor.compute_log_probs(batch).get(timeout=120)["old_log_probs"]
        actor.export_hf(str(reference_dir))
    finally:
        trainer.close()
    return engine_log_probs, batch


def _check_round_trip(run_dir: Path, out: Path, reference_dir: Path, engine_log_probs: torch.Tensor,
                      batch: Batch) -> None:
    assert export_main([str(run_dir), str(out)]) == 0
    log_probs, logits = hf_log_probs(out, batch)
    _, reference_logits = hf_log_probs(reference_dir, batch)
    assert torch.allclose(log_probs, engine_log_probs, atol=1e-6, rtol=0), (log_probs - engine_log_probs).abs().max()
    assert torch.allclose(logits, reference_logits, atol=1e-6, rtol=0)
    info = json.loads((out / "hybridflow_export.json").read_text())
    assert info["step"] == 2 and info["role"] == "actor"


def test_fsdp_export_round_trip_and_errors(tmp_path: Path, tiny_config, capsys) -> None:
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "trainer.total_steps=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2")
    engine_log_probs, batch = _train_and_probe(config, tmp_path / "trainer_export")
    out = tmp_path / "hf"
    _check_round_trip(run_dir, out, tmp_path / "trainer_export", engine_log_probs, batch)
    info = json.loads((out / "hybridflow_export.json").read_text())
    assert info["engine"] == "fsdp"

    # the run's tokenizer and a generation config come along; the tokenizer encodes and decodes as the run's did
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from hybridflow.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    run_tokenizer = build_char_tokenizer()
    for text in ("3+4=7", "twelve plus 9 = 21"):
        assert tokenizer(text).input_ids == run_tokenizer(text).input_ids
        assert tokenizer.decode(tokenizer(text).input_ids) == text
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id) == (EOS_ID, PAD_ID)

    # --step picks an older checkpoint (one update earlier: other weights)
    older = tmp_path / "hf_step1"
    assert export_main([str(run_dir), "--step", "1", str(older)]) == 0
    step1, _ = hf_log_probs(older, batch)
    assert not torch.allclose(step1, engine_log_probs, atol=1e-6, rtol=0)

    # clear errors: bad step, unknown role, non-empty output, no checkpoint, not a run directory
    capsys.readouterr()
    assert export_main([str(run_dir), "--step", "7", str(tmp_path / "x")]) == 2
    assert "no checkpoint of step 7" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert export_main([str(run_dir), "--role", "critic", str(tmp_path / "x")]) == 2
    assert "holds no role 'critic'; it holds actor" in capsys.readouterr().err
    assert export_main([str(run_dir), str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert export_main([str(run_dir), "--force", str(out)]) == 0
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "manifest.json", bare / "manifest.json")
    assert export_main([str(bare), str(tmp_path / "x")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert export_main([str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.megatron
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core not installed (bash scripts/install_megatron.sh .venv)")
@pytest.mark.parametrize(("axis", "overrides"), [
    pytest.param("tp", ["model.preset=tiny-qwen2-h16", "actor.parallel.tensor_parallel_size=2"],
                 marks=pytest.mark.slow),  # 64 s in the full run of 2026-12-07 (tests/durations.json)
    pytest.param("pp", ["actor.parallel.pipeline_parallel_size=2"], marks=pytest.mark.slow),
])
def test_megatron_export_round_trip(tmp_path: Path, tiny_config, axis: str, overrides: list[str]) -> None:
    """A tensor-parallel (t=2) or pipeline-parallel (p=2) megatron actor's checkpoint shards are reassembled offline
    into the HF model."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "actor.engine=megatron", *overrides, "trainer.total_steps=2",
                         "trainer.checkpoint_every=2")
    engine_log_probs, batch = _train_and_probe(config, tmp_path / "trainer_export")
    out = tmp_path / "hf"
    _check_round_trip(run_dir, out, tmp_path / "trainer_export", engine_log_probs, batch)
    assert json.loads((out / "hybridflow_export.json").read_text())["engine"] == "megatron"
    assert json.loads((run_dir / "checkpoints" / "step-2" / "actor" / "layout.json").read_text())[axis] == 2
