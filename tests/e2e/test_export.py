"""``hybridflow export``: a trained run's checkpoint → an HF directory whose model computes the engine's log-probs.

The run is the README's GRPO job, shortened; the export runs offline in this process (no Ray, no process group) and
is loaded with ``transformers`` as a user would load it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from export_probe import check_round_trip, hf_log_probs, train_and_probe

from hybridflow.export import main as export_main


def test_fsdp_export_round_trip_and_errors(tmp_path: Path, tiny_config, capsys) -> None:
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "trainer.total_steps=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2")
    _, probes = train_and_probe(config, tmp_path / "trainer_export")
    batch, engine_log_probs = probes["batch"], probes["actor"]
    out = tmp_path / "hf"
    check_round_trip(run_dir, out, tmp_path / "trainer_export", probes, step=2)
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


@pytest.mark.slow  # 42 s in the full run of 2026-12-07 (tests/durations.json)
@pytest.mark.megatron
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core not installed (bash scripts/install_megatron.sh .venv)")
def test_megatron_pipeline_parallel_export_round_trip(tmp_path: Path, tiny_config) -> None:  # type: ignore[no-untyped-def]
    """A pipeline-parallel (p = 2) megatron actor's checkpoint shards are reassembled offline into the HF model. (The
    tensor-parallel (t = 2) round trip exports the t = 2 run of tests/e2e/test_megatron_grpo.py.)"""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "actor.engine=megatron", "actor.parallel.pipeline_parallel_size=2",
                         "trainer.total_steps=2", "trainer.checkpoint_every=2")
    _, probes = train_and_probe(config, tmp_path / "trainer_export")
    out = tmp_path / "hf"
    check_round_trip(run_dir, out, tmp_path / "trainer_export", probes, step=2)
    assert json.loads((out / "hybridflow_export.json").read_text())["engine"] == "megatron"
    assert json.loads((run_dir / "checkpoints" / "step-2" / "actor" / "layout.json").read_text())["pp"] == 2
