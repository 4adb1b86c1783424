"""Rollout-engine contract: output columns, shapes and masks, log-probs of the sampled tokens, seeded determinism,
``update_weights`` ≡ loading the same weights fresh, the weights version on every rollout, sleep/wake keeping outputs.

Each check takes ``make_engine(model_spec) -> RolloutEngine`` (the plugin chooses device, padding/EOS ids from
:mod:`hybridflow.testing.fixtures` and any engine options) and a scratch directory. Stability: public.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, RolloutEngine, SamplingParams, TokenContinuationEngine
from hybridflow.testing.fixtures import EOS_ID, PAD_ID, build_char_tokenizer, save_tiny_model

__all__ = [
    "RolloutEngineMaker",
    "ROLLOUT_CHECKS",
    "build_prompt_batch",
    "prepare_model",
    "read_weights",
    "check_generate_shapes_and_masks",
    "check_log_probs_match_model",
    "check_seeded_determinism",
    "check_update_weights_matches_fresh_load",
    "check_version_reported",
    "check_sleep_wake_keeps_outputs",
    "check_continue_from_tokens",
]

RolloutEngineMaker = Callable[[ModelSpec], RolloutEngine]
PROMPTS = ("1+2=", "12*3=", "a b", "7-5=", "hello", "9")
SAMPLING = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=1234)
OUTPUT_COLUMNS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                  "rollout_log_probs")


def prepare_model(workdir: Path, *, seed: int = 0) -> Path:
    """A tiny HF model directory (default fixture config: 2 heads of 32) under ``workdir``, made once per seed."""
    path = Path(workdir) / f"tiny_model_seed{seed}"
    if not (path / "config.json").exists():
        save_tiny_model(path, seed=seed)
    return path


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of an HF directory."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def build_prompt_batch(prompts: tuple[str, ...] = PROMPTS) -> Batch:
    """Left-padded char-tokenized prompts with a non-tensor ``ground_truth`` column and ``iteration`` meta."""
    encoded = build_char_tokenizer()(list(prompts), padding=True, return_tensors="pt")
    return Batch(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]},
        {"ground_truth": [f"gt{i}" for i in range(len(prompts))]},
        meta={"iteration": 3},
    )


def _assert_same_rollout(a: Batch, b: Batch, *, atol: float = 1e-5, what: str) -> None:
    assert torch.equal(a["responses"], b["responses"]), f"{what}: responses differ\n{a['responses']}\n{b['responses']}"
    assert torch.equal(a["response_mask"], b["response_mask"]), f"{what}: response masks differ"
    gap = (a["rollout_log_probs"] - b["rollout_log_probs"]).abs().max().item()
    assert gap <= atol, f"{what}: rollout_log_probs differ by {gap} > {atol}"


def check_generate_shapes_and_masks(make_engine: RolloutEngineMaker, workdir: Path) -> None:
    """Every documented column, with consistent shapes, masks, padding after EOS and the input rows repeated."""
    engine = make_engine(ModelSpec(path=str(prepare_model(workdir))))
    batch = build_prompt_batch()
    out = engine.generate(batch, SAMPLING)
    rows, width = len(batch) * SAMPLING.n, batch["input_ids"].shape[1]
    assert len(out) == rows, f"expected {rows} rows (n={SAMPLING.n} per prompt), got {len(out)}"
    for column in OUTPUT_COLUMNS:
        assert column in out, f"generate() output lacks column {column!r}; has {out.keys()}"
    length = out["responses"].shape[1]
    assert 0 < length <= SAMPLING.max_new_tokens, f"response width {length} outside (0, {SAMPLING.max_new_tokens}]"
    for column in ("responses", "response_mask", "rollout_log_probs"):
        assert tuple(out[column].shape) == (rows, length), f"{column} has shape {tuple(out[column].shape)}"
    for column in ("input_ids", "attention_mask", "position_ids"):
        assert tuple(out[column].shape) == (rows, width + length), f"{column} has shape {tuple(out[column].shape)}"
    repeated = batch.repeat_interleave(SAMPLING.n)
    assert torch.equal(out["prompts"], repeated["input_ids"]), "prompts are not the input rows repeated interleaved"
    assert list(out["ground_truth"]) == list(repeated["ground_truth"]), "non-tensor columns not repeated interleaved"
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], dim=1))
    mask = out["response_mask"].long()
    assert torch.equal(out["attention_mask"].long(), torch.cat([repeated["attention_mask"].long(), mask], dim=1))
    assert bool((mask[:, 1:] <= mask[:, :-1]).all()), "response_mask must be 1s then 0s"
    assert bool((mask.sum(1) > 0).all()), "every row must have at least one generated token"
    for row in range(rows):
        valid = int(mask[row].sum())
        tokens = out["responses"][row]
        assert bool((tokens[valid:] == PAD_ID).all()), f"row {row}: tokens after the response are not pad"
        eos = (tokens[:valid] == EOS_ID).nonzero().flatten().tolist()
        assert eos in ([], [valid - 1]), f"row {row}: EOS at {eos} but the response (mask) ends at {valid - 1}"
        if valid < length:
            assert eos == [valid - 1], f"row {row} stops at {valid} without EOS"
    log_probs = out["rollout_log_probs"]
    assert bool(torch.isfinite(log_probs).all()) and bool((log_probs <= 1e-6).all()), "log-probs must be finite ≤ 0"
    assert bool((log_probs[mask == 0] == 0).all()), "log-probs must be 0 where response_mask is 0"
    assert out.meta.get("policy_version") == engine.weights_version, f"meta {out.meta} lacks the weights version"
    assert out.meta.get("iteration") == 3, "generate() must carry the input meta"


def check_log_probs_match_model(make_engine: RolloutEngineMaker, workdir: Path, *, atol: float = 1e-3) -> None:
    """``rollout_log_probs`` equal log softmax of the plain HF model's logits at the sampled tokens."""
    from transformers import AutoModelForCausalLM

    path = prepare_model(workdir)
    out = make_engine(ModelSpec(path=str(path))).generate(build_prompt_batch(), SAMPLING)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]  # transformers overrides eval() unannotated
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits
    length = out["responses"].shape[1]
    expected = torch.log_softmax(logits[:, -length - 1 : -1].float(), -1).gather(-1, out["responses"].unsqueeze(-1))
    gap = ((expected.squeeze(-1) - out["rollout_log_probs"]) * out["response_mask"]).abs().max().item()
    assert gap <= atol, f"rollout_log_probs differ from the model's log-probs by {gap} > {atol}"


def check_seeded_determinism(make_engine: RolloutEngineMaker, workdir: Path) -> None:
    """Same seed → same rollout; another seed → another rollout; greedy ignores the seed."""
    engine = make_engine(ModelSpec(path=str(prepare_model(workdir))))
    batch = build_prompt_batch()
    first, again = engine.generate(batch, SAMPLING), engine.generate(batch, SAMPLING)
    _assert_same_rollout(first, again, atol=1e-6, what="same seed")
    other = engine.generate(batch, SamplingParams(n=2, max_new_tokens=8, seed=(SAMPLING.seed or 0) + 1))
    assert not torch.equal(first["responses"], other["responses"]), "a different seed gave the same responses"
    greedy = [engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=8, seed=s)) for s in (1, 2)]
    _assert_same_rollout(greedy[0], greedy[1], atol=1e-6, what="greedy with different seeds")


def check_update_weights_matches_fresh_load(make_engine: RolloutEngineMaker, workdir: Path) -> None:
    """update_weights(W) gives the outputs of an engine built from W, and changes the outputs."""
    engine = make_engine(ModelSpec(path=str(prepare_model(workdir, seed=0))))
    batch = build_prompt_batch()
    before = engine.generate(batch, SAMPLING)
    other_path = prepare_model(workdir, seed=1)
    engine.update_weights(iter(read_weights(other_path).items()), version=7)
    updated = engine.generate(batch, SAMPLING)
    del engine
    fresh = make_engine(ModelSpec(path=str(other_path))).generate(batch, SAMPLING)
    _assert_same_rollout(updated, fresh, what="update_weights vs fresh load")
    assert not torch.equal(before["rollout_log_probs"], updated["rollout_log_probs"]), "update_weights changed nothing"


def check_version_reported(make_engine: RolloutEngineMaker, workdir: Path) -> None:
    """weights_version follows update_weights and every rollout carries it as meta policy_version."""
    path = prepare_model(workdir)
    engine = make_engine(ModelSpec(path=str(path)))
    assert isinstance(engine.weights_version, int), f"weights_version must be an int, got {engine.weights_version!r}"
    for version in (3, 4):
        engine.update_weights(iter(read_weights(path).items()), version=version)
        assert engine.weights_version == version
        out = engine.generate(build_prompt_batch(), SAMPLING)
        assert out.meta["policy_version"] == version, f"rollout meta {out.meta}, expected policy_version {version}"


def check_sleep_wake_keeps_outputs(make_engine: RolloutEngineMaker, workdir: Path) -> None:
    """After sleep → wake → update_weights(same weights) the engine generates exactly what it did before."""
    import pytest

    path = prepare_model(workdir)
    engine = make_engine(ModelSpec(path=str(path)))
    if "sleep" not in engine.capabilities:
        pytest.skip(f"{type(engine).__name__} does not report the 'sleep' capability")
    batch = build_prompt_batch()
    before = engine.generate(batch, SAMPLING)
    engine.sleep()
    engine.wake()
    engine.update_weights(iter(read_weights(path).items()), version=before.meta["policy_version"])
    after = engine.generate(batch, SAMPLING)
    _assert_same_rollout(before, after, atol=0.0, what="sleep/wake")


def check_continue_from_tokens(make_engine: RolloutEngineMaker, workdir: Path) -> None:
    """Capability ``continue_from_tokens``: greedy continuations of variable-length id prefixes are the same in one
    batch as one by one, stop right after a stop id, and agree with ``generate`` on the same prompt."""
    import pytest

    engine = make_engine(ModelSpec(path=str(prepare_model(workdir))))
    if "continue_from_tokens" not in engine.capabilities:
        pytest.skip(f"{type(engine).__name__} does not report the 'continue_from_tokens' capability")
    if not isinstance(engine, TokenContinuationEngine):
        raise AssertionError(f"{type(engine).__name__} reports continue_from_tokens but has no generate_from_tokens")
    generate_from_tokens = engine.generate_from_tokens
    tokenizer = build_char_tokenizer()
    prefixes = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    together = generate_from_tokens(prefixes, greedy)
    alone = [generate_from_tokens([prefix], greedy)[0] for prefix in prefixes]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone], "batching prefixes changed the output"
    reference = engine.generate(build_prompt_batch(), greedy)
    for row, completion in enumerate(together):
        length = int(reference["response_mask"][row].sum())
        assert list(completion.token_ids) == reference["responses"][row, :length].tolist()
        assert len(completion.log_probs) == len(completion.token_ids)
    stop = together[0].token_ids[len(together[0].token_ids) // 2]
    stopped = generate_from_tokens([prefixes[0]], greedy, stop_token_ids=[stop])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop
    assert stop not in stopped.token_ids[:-1]


ROLLOUT_CHECKS: tuple[Callable[[RolloutEngineMaker, Path], None], ...] = (
    check_generate_shapes_and_masks,
    check_log_probs_match_model,
    check_seeded_determinism,
    check_update_weights_matches_fresh_load,
    check_version_reported,
    check_sleep_wake_keeps_outputs,
    check_continue_from_tokens,
)
