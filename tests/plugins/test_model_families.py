"""Each model family against ``transformers`` on the same weights, through every path of this box that claims it.

Families: ``llama``, ``qwen2``, ``qwen3`` (q/k RMSNorm), ``qwen3_moe`` and ``mixtral`` (mixture-of-experts MLPs), each
a tiny config (:func:`hybridflow.presets.tiny_model_config`, 2 layers, hidden 64) whose every weight is moved off its
init (so the norms, q/k norms included, are not ones) and written as an HF directory that the engines load. The
reference is the ``transformers`` model loaded from that directory (fp32, sdpa): token log-probs within ``ATOL``
(1e-5, fp32) and greedy generation token for token. Which path runs a family is asserted too: the lean forward and
lean decoder for :data:`hybridflow_fsdp.lean_forward.LEAN_FAMILIES`, HF's modules (the logged fallback) otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.char_tokenizer import EOS_ID, PAD_ID
from hybridflow.columns import compute_position_ids
from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
from hybridflow.presets import save_tiny_model
from hybridflow.testing.contracts.rollout import build_prompt_batch
from hybridflow_fsdp import lean_forward
from hybridflow_fsdp.lean_forward import LEAN_FAMILIES
from hybridflow_fsdp.rollout import HFRolloutEngine
from hybridflow_fsdp.training import FSDPTrainingEngine

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
ATOL = 1e-5  # fp32: the lean forward reorders no reduction HF does; measured gaps are <= 3e-6


def write_family_model(family: str, path: Path) -> Path:
    """An HF directory of ``family``'s tiny config with every tensor moved by 0.3·N(0, 1) off its init."""
    # qwen3 with its own lm_head: the untied head through every path too
    return save_tiny_model(path, perturb=0.3, architecture=family, tie_word_embeddings=family != "qwen3")


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = str(request.param)
    return family, write_family_model(family, tmp_path_factory.mktemp(family) / "model")


def load_reference(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def reference_log_probs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        responses: torch.Tensor) -> torch.Tensor:
    """Log-probs [B, R] of the last R tokens of each row under ``model`` (one full forward, no cache)."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=compute_position_ids(attention_mask)).logits
    width = responses.shape[1]
    return torch.log_softmax(logits[:, -width - 1:-1].float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def shared_prompt_batch(rows: int = 8, n: int = 2, seed: int = 0) -> Batch:
    """``rows`` rollout rows, ``n`` per prompt (consecutive, as generation returns them): left-padded prompts of
    lengths 3..6, right-padded responses of lengths 1..5."""
    generator = torch.Generator().manual_seed(seed)
    prompt_width, response_width = 6, 5
    prompts = torch.randint(4, 45, (rows // n, prompt_width), generator=generator).repeat_interleave(n, 0)
    prompt_mask = torch.ones_like(prompts)
    for row in range(rows):
        prompt_mask[row, : (row // n) % 4] = 0
    responses = torch.randint(4, 45, (rows, response_width), generator=generator)
    response_mask = torch.ones_like(responses)
    for row in range(rows):
        response_mask[row, 1 + row % response_width:] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, PAD_ID)
    responses = responses.masked_fill(response_mask == 0, PAD_ID)
    return Batch({"input_ids": torch.cat((prompts, responses), 1),
                  "attention_mask": torch.cat((prompt_mask, response_mask), 1),
                  "responses": responses, "response_mask": response_mask},
                 meta={"policy_version": 0, "iteration": 0})


def test_fsdp_training_forward_matches_transformers(family_dir: tuple[str, Path], caplog: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The fsdp actor's log-probs (the default path: padding removed, repeated prompts shared; then distinct prompts)
    equal transformers' on the same weights; the lean forward runs exactly for the lean families, and a family it
    does not run falls back to HF's modules with the reason logged, naming the family."""
    family, path = family_dir
    monkeypatch.setattr(lean_forward, "_logged_reasons", set())  # each reason is logged once per process
    with caplog.at_level(logging.INFO, logger=lean_forward.__name__):
        engine = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(model=ModelSpec(path=str(path))))
    lean = family in LEAN_FAMILIES
    assert engine.resolved_options()["lean_forward"] is lean
    logged = [record.getMessage() for record in caplog.records if record.name == lean_forward.__name__]
    if lean:
        assert not logged, logged
    else:
        assert len(logged) == 1 and repr(family) in logged[0] and "HF's modules run" in logged[0], logged
    reference = load_reference(path)
    for batch in (shared_prompt_batch(), shared_prompt_batch(n=1, seed=1)):
        log_probs = engine.compute_log_probs(batch)["log_probs"]
        expected = reference_log_probs(reference, batch["input_ids"], batch["attention_mask"], batch["responses"])
        mask = batch["response_mask"].bool()
        gap = (log_probs - expected)[mask].abs().max().item()
        assert gap < ATOL, f"{family}: fsdp log-probs differ from transformers by {gap}"


def test_hf_rollout_greedy_and_log_probs_match_transformers(family_dir: tuple[str, Path]) -> None:
    """The hf rollout engine's greedy tokens equal transformers' ``generate`` and its rollout log-probs equal a
    transformers forward of the generated rows; the lean decoder generates exactly for the lean families."""
    family, path = family_dir
    engine = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(path=str(path)), eos_token_id=EOS_ID,
                                                        pad_token_id=PAD_ID))
    assert (engine.decoder is not None) is (family in LEAN_FAMILIES)
    batch = build_prompt_batch()
    out = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    reference = load_reference(path)
    prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        expected = reference.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=False,
                                      max_new_tokens=8, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    expected = expected[:, prompt_ids.shape[1]:]
    responses, mask = out["responses"], out["response_mask"].bool()
    width = expected.shape[1]
    assert torch.equal(responses[:, :width].masked_fill(~mask[:, :width], PAD_ID), expected.masked_fill(
        ~mask[:, :width], PAD_ID)), f"{family}: greedy tokens differ\n{responses}\n{expected}"
    assert mask.sum() > mask.shape[0] * 2, "responses too short to compare"
    log_probs = reference_log_probs(reference, out["input_ids"], out["attention_mask"], responses)
    gap = (out["rollout_log_probs"] - log_probs)[mask].abs().max().item()
    assert gap < ATOL, f"{family}: rollout log-probs differ from transformers by {gap}"


@pytest.mark.deepspeed
def test_deepspeed_forward_matches_transformers(family_dir: tuple[str, Path]) -> None:
    """The deepspeed actor (ZeRO at its default stage, HF's modules for every family) scores the rows as
    transformers does, and one optimizer step moves its log-probs (the engine trains this family)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (bash scripts/setup.sh --all)")
    from deepspeed_in_process import release_stale_deepspeed_groups
    from hybridflow.testing.contracts.training import sequence_mean_nll
    from hybridflow_deepspeed.training import DeepSpeedTrainingEngine

    release_stale_deepspeed_groups()  # built in this pytest process, after whatever ran here before
    family, path = family_dir
    engine = DeepSpeedTrainingEngine(role="actor", config=TrainingEngineConfig(model=ModelSpec(path=str(path))))
    batch = shared_prompt_batch()
    log_probs = engine.compute_log_probs(batch)["log_probs"]
    expected = reference_log_probs(load_reference(path), batch["input_ids"], batch["attention_mask"],
                                   batch["responses"])
    mask = batch["response_mask"].bool()
    gap = (log_probs - expected)[mask].abs().max().item()
    assert gap < ATOL, f"{family}: deepspeed log-probs differ from transformers by {gap}"
    engine.train_step(batch, loss_fn=sequence_mean_nll)
    moved = (engine.compute_log_probs(batch)["log_probs"] - log_probs)[mask].abs().max().item()
    assert moved > 1e-3, f"{family}: a deepspeed train step left the log-probs where they were ({moved})"


def test_the_models_page_matches_the_support_declarations() -> None:
    """docs/guide/models.md is what scripts/gen_model_table.py makes of LEAN_FAMILIES and CONVERTED_FAMILIES."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_model_table", root / "scripts" / "gen_model_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0, "docs/guide/models.md is stale: run python scripts/gen_model_table.py"
    page = (root / "docs" / "guide" / "models.md").read_text(encoding="utf-8")
    for family in FAMILIES:  # every family of this module has its row, its lean cells as the fsdp plugin declares
        row = next(line for line in page.splitlines() if line.startswith(f"| `{family}` |"))
        assert (row.split(" | ")[2] == "lean") is (family in LEAN_FAMILIES), row
