"""The single-rank fast paths of the fsdp plugin compute what the slow paths compute: the lean decoder's logits and
gradients equal the HF model's, lean sampling equals HF-cache sampling, unsupported models fall back, and an
unsharded 1-rank engine takes the same optimizer steps as an FSDP-wrapped one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, OptimConfig, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
from hybridflow.testing.contracts.rollout import build_prompt_batch
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow.testing.fixtures import EOS_ID, PAD_ID, tiny_model_config
from hybridflow_fsdp.fast_decode import LeanDecoder, build_lean_decoder
from hybridflow_fsdp.models import build_model, compute_position_ids
from hybridflow_fsdp.prompt_sharing import distinct_prompt_rows
from hybridflow_fsdp.rollout import HFRolloutEngine
from hybridflow_fsdp.sampling import sample_tokens
from hybridflow_fsdp.training import FSDPTrainingEngine

FIXTURES = {"qwen2-h16": {"num_heads": 4, "num_kv_heads": 2}, "qwen2-h32": {}, "llama": {"architecture": "llama"}}


def padded_batch(rows: int = 6, prompt: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 45, (rows, prompt), generator=generator)
    mask = torch.ones(rows, prompt, dtype=torch.long)
    for row in range(rows):
        mask[row, :row] = 0
    return ids.masked_fill(mask == 0, PAD_ID), mask


@pytest.mark.parametrize("fixture", FIXTURES)
def test_lean_decoder_logits_match_hf_with_cache(fixture: str) -> None:
    model = build_model(ModelSpec(config=tiny_model_config(**FIXTURES[fixture]), seed=3), role="rollout").eval()
    ids, mask = padded_batch()
    decoder = LeanDecoder(model)
    errors = []
    with torch.no_grad():
        lean = decoder.prefill(ids, mask, compute_position_ids(mask), 5)
        errors.append((lean - model(input_ids=ids, attention_mask=mask).logits[:, -1]).abs().max().item())
        positions = compute_position_ids(mask)[:, -1]
        for step in range(5):
            tokens = torch.randint(4, 45, (ids.shape[0],), generator=torch.Generator().manual_seed(step))
            positions = positions + 1
            lean = decoder.step(tokens, positions)
            ids = torch.cat([ids, tokens[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            reference = model(input_ids=ids, attention_mask=mask, position_ids=compute_position_ids(mask)).logits
            errors.append((lean - reference[:, -1]).abs().max().item())
    assert max(errors) < 1e-5, f"lean logits differ from HF by {errors}"


def test_lean_training_forward_matches_hf_log_probs_and_gradients() -> None:
    model = build_model(ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2), seed=1), role="actor")
    batch = build_training_batch(rows=8)
    ids, mask, responses = batch["input_ids"], batch["attention_mask"], batch["responses"]
    positions, width = compute_position_ids(mask), responses.shape[1]
    response_mask = batch["response_mask"].float()
    decoder = LeanDecoder(model)
    assert_same_log_probs_and_gradients(
        model, responses, response_mask,
        lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -width - 1 : -1],
        lambda: decoder.forward_logits(ids, mask, positions, last=width + 1)[:, :-1])


def assert_same_log_probs_and_gradients(model, responses, response_mask, *forwards) -> None:  # type: ignore[no-untyped-def]
    """Each forward (returning response logits) gives the same masked log-probs (1e-5) and gradients (1e-6)."""
    results = []
    for forward_logits in forwards:
        model.zero_grad()
        logits = forward_logits()
        log_probs = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1) * response_mask
        (-(log_probs.sum() / response_mask.sum())).backward()
        results.append((log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    for other in results[1:]:
        assert (results[0][0] - other[0]).abs().max() < 1e-5
        gap = max((results[0][1][n] - other[1][n]).abs().max().item() for n in results[0][1])
        assert gap < 1e-6
    assert max(g.abs().max().item() for g in results[0][1].values()) > 1e-3


def test_lean_sampling_equals_hf_cache_sampling() -> None:
    model = build_model(ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2), seed=2), role="rollout").eval()
    ids, mask = padded_batch(rows=8)
    outputs = []
    for decoder in (None, LeanDecoder(model)):
        for temperature in (0.0, 1.0):
            sampling = SamplingParams(temperature=temperature, max_new_tokens=10)
            outputs.append(sample_tokens(model, ids, mask, sampling=sampling, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                                         generator=torch.Generator().manual_seed(5), decoder=decoder))
    for hf, lean in zip(outputs[:2], outputs[2:]):
        assert torch.equal(hf.responses, lean.responses) and torch.equal(hf.response_mask, lean.response_mask)
        assert torch.allclose(hf.log_probs, lean.log_probs, atol=1e-5)


def test_unsupported_models_keep_the_hf_forward() -> None:
    config = tiny_model_config()
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    model = build_model(ModelSpec(config=config), role="rollout")
    assert build_lean_decoder(model) is None
    with pytest.raises(ValueError, match="rope_type"):
        LeanDecoder(model)
    engine = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(config=config), eos_token_id=EOS_ID))
    assert engine.decoder is None
    out = engine.generate(build_prompt_batch(), SamplingParams(max_new_tokens=3, seed=0))
    assert out["responses"].shape[1] == 3


def test_unsharded_single_rank_engine_steps_like_fsdp() -> None:
    base = TrainingEngineConfig(model=ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2)),
                                optim=OptimConfig(lr=1e-2), micro_batch_size=4)
    batch = build_training_batch(rows=8)
    weights = []
    for extra in ({}, {"fsdp_always": True}):  # the same forward either way (through FSDP's module when sharded)
        engine = FSDPTrainingEngine(role="actor", config=dataclasses.replace(base, extra=extra))
        assert engine.sharded == bool(extra) and engine.resolved_options()["forward"] == "lean_packed"
        for _ in range(3):
            engine.train_step(batch, loss_fn=sequence_mean_nll)
        weights.append({name: tensor.clone() for name, tensor in engine.generation_weights()})
    gap = max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0])
    assert gap < 1e-5, f"unsharded and FSDP engines diverged by {gap} after 3 AdamW steps"


@pytest.mark.parametrize("fixture", ["qwen2-h16", "llama"])
def test_shared_prompt_forward_matches_full_forward_and_gradients(fixture: str) -> None:
    """Rows repeating their predecessor's prompt share one prompt forward; logits and gradients are unchanged."""
    model = build_model(ModelSpec(config=tiny_model_config(**FIXTURES[fixture]), seed=4), role="actor")
    prompt_ids, prompt_mask = padded_batch(rows=5, prompt=6, seed=1)
    repeats = torch.tensor([3, 1, 4, 2, 2])  # uneven groups, one prompt alone
    ids, mask = prompt_ids.repeat_interleave(repeats, 0), prompt_mask.repeat_interleave(repeats, 0)
    rows, width = ids.shape[0], 7
    generator = torch.Generator().manual_seed(7)
    responses = torch.randint(4, 45, (rows, width), generator=generator)
    response_mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(rows):  # rows end at different lengths (EOS, then padding)
        end = int(torch.randint(1, width + 1, (1,), generator=generator))
        response_mask[row, end:] = 0
    input_ids = torch.cat([ids, responses.masked_fill(response_mask == 0, PAD_ID)], 1)
    attention_mask = torch.cat([mask, response_mask], 1)
    positions = compute_position_ids(attention_mask)
    decoder = LeanDecoder(model)
    firsts = distinct_prompt_rows(ids, mask, compute_position_ids(mask))  # the shared path is the one taken
    assert firsts is not None and firsts[0].tolist() == [0, 3, 4, 8, 10]
    assert_same_log_probs_and_gradients(
        model, responses, response_mask,
        lambda: decoder.forward_logits(input_ids, attention_mask, positions, last=width + 1)[:, :-1],
        lambda: decoder.response_logits(input_ids, attention_mask, positions, width),
        lambda: decoder.response_logits(input_ids, attention_mask, positions, width, remove_padding=True))
    # without shared prompts too (each row its own prompt), and padding-removed logits hold 0 at padding
    alone = firsts[0]  # one row of each prompt
    ids_a, mask_a, pos_a = input_ids[alone], attention_mask[alone], positions[alone]
    assert distinct_prompt_rows(ids_a[:, :6], mask_a[:, :6], pos_a[:, :6]) is None
    assert_same_log_probs_and_gradients(
        model, responses[alone], response_mask[alone],
        lambda: decoder.forward_logits(ids_a, mask_a, pos_a, last=width + 1)[:, :-1],
        lambda: decoder.response_logits(ids_a, mask_a, pos_a, width, remove_padding=True))
    with torch.no_grad():
        packed = decoder.response_logits(input_ids, attention_mask, positions, width, remove_padding=True)
    assert packed[response_mask == 0].abs().max() == 0 and packed[response_mask == 1].abs().amax(-1).min() > 0


def test_generation_and_inference_outputs_are_ordinary_tensors() -> None:
    """Generation and log-prob inference run in inference mode; nothing that leaves them is an inference tensor
    (those cannot be saved for a backward), so an in-process loss over them trains."""
    spec = ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2))
    rollout = HFRolloutEngine(config=RolloutEngineConfig(model=spec, eos_token_id=EOS_ID, max_new_tokens=6))
    out = rollout.generate(build_prompt_batch(), SamplingParams(n=2, max_new_tokens=6, seed=0))
    engine = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(model=spec, micro_batch_size=4))
    old = engine.compute_log_probs(out)
    assert not any(t.is_inference() for t in (*out.tensors.values(), *old.tensors.values()))
    assert rollout.decoder is not None and not rollout.decoder._cos.is_inference()
    batch = out | Batch({"old_log_probs": old["log_probs"], "advantages": torch.randn(len(out))[:, None]
                         .expand(-1, out["responses"].shape[1]).contiguous()}, batch_size=len(out))
    from hybridflow.algorithms.losses import make_actor_loss_fn

    metrics = engine.train_step(batch, loss_fn=make_actor_loss_fn())
    assert metrics["grad_norm"] > 0 and engine.state_version() == 1
