"""Padding removal and token-budget micro-batches in the fsdp engine: the packed forward gives the padded forward's
log-probs, entropy, values and gradients (fp32, within 1e-5), budgets cut micro-batches without changing the
loss or the update, and bad budgets are refused with the key, the value and the longest row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
from hybridflow.errors import ConfigError
from hybridflow.presets import tiny_model_config
from hybridflow.testing.contracts.training import sequence_mean_nll
from hybridflow_fsdp import forward, packing
from hybridflow_fsdp.models import build_model
from hybridflow_fsdp.training import LOSS_SCALE_TOKENS, FSDPTrainingEngine

TOLERANCE = 1e-5  # fp32: packed and padded forwards differ only in summation order
PRESETS = {"qwen2": {"num_heads": 4, "num_kv_heads": 2}, "llama": {"architecture": "llama"}}


def skewed_batch(rows: int = 8, prompt: int = 12, response: int = 20, seed: int = 0) -> Batch:
    """Rollout-shaped rows (left-padded prompts, right-padded responses) whose lengths span more than 4x."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 45, (rows, prompt), generator=generator)
    responses = torch.randint(4, 45, (rows, response), generator=generator)
    prompt_mask = torch.zeros(rows, prompt, dtype=torch.long)
    response_mask = torch.zeros(rows, response, dtype=torch.long)
    for row in range(rows):
        prompt_mask[row, prompt - (2 + row * (prompt - 2) // max(rows - 1, 1)):] = 1
        response_mask[row, : 1 + (row * 7) % response] = 1
    prompts, responses = prompts * prompt_mask, responses * response_mask
    return Batch({
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "responses": responses, "response_mask": response_mask,
        "advantages": torch.randn(rows, response, generator=generator),
    }, meta={"policy_version": 0, "iteration": 0})


def token_mean_nll(outputs, micro_batch):
    mask = micro_batch["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / micro_batch.meta[LOSS_SCALE_TOKENS], {}


def engine(role: str = "actor", preset: str = "qwen2", **options) -> FSDPTrainingEngine:
    options.setdefault("optim", OptimConfig(lr=1e-2, eps=1e-2))  # a large eps: the update follows the gradient
    spec = ModelSpec(config=tiny_model_config(**PRESETS[preset]), seed=3)
    return FSDPTrainingEngine(role=role, config=TrainingEngineConfig(model=spec, **options))


def test_the_skewed_batch_spans_four_times() -> None:
    lengths = skewed_batch()["attention_mask"].sum(1)
    assert int(lengths.max()) >= 4 * int(lengths.min())


def equal_length_batch() -> Batch:
    """Each length twice, with different tokens (the attention batches rows of one length in one call)."""
    return Batch.concat([skewed_batch(seed=0), skewed_batch(seed=1)])


@pytest.mark.parametrize("preset, batch_kind", [("qwen2", "skewed"), ("llama", "skewed"),
                                                ("qwen2", "equal_lengths")])
def test_packed_forward_equals_padded_forward_and_gradients(preset: str, batch_kind: str) -> None:
    """Same model, same rows: packed and padded log-probs/entropy and parameter gradients agree within 1e-5."""
    packing.register_varlen_attention()
    model = build_model(ModelSpec(config=tiny_model_config(**PRESETS[preset]), seed=1), role="actor",
                        attn_implementation=packing.VARLEN_ATTENTION)
    batch = skewed_batch() if batch_kind == "skewed" else equal_length_batch()
    mask = batch["response_mask"].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        if packed:
            outputs = packing.packed_forward_outputs(model, batch, torch.device("cpu"), role="actor",
                                                     with_entropy=True)
        else:
            logits = forward.response_logits(model, batch, torch.device("cpu"))
            outputs = {"log_probs": forward.compute_token_log_probs(logits, batch["responses"]),
                       "entropy": forward.compute_entropy(logits)}
        ((outputs["log_probs"] + outputs["entropy"]) * weights * mask).sum().backward()
        results.append((outputs, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (padded, padded_grads), (packed_out, packed_grads) = results
    for column in ("log_probs", "entropy"):
        gap = (padded[column] - packed_out[column])[mask].abs().max().item()
        assert gap < TOLERANCE, f"{column} differ by {gap}"
        assert packed_out[column][~mask].abs().max().item() == 0  # padding positions hold 0
    gap = max((padded_grads[n] - packed_grads[n]).abs().max().item() for n in padded_grads)
    scale = max(g.abs().max().item() for g in padded_grads.values())
    assert scale > 1e-3 and gap < TOLERANCE * scale, f"gradients differ by {gap} (largest {scale})"


@pytest.mark.parametrize("role, method, column", [("actor", "compute_log_probs", "log_probs"),
                                                  ("reference", "compute_log_probs", "log_probs"),
                                                  ("critic", "compute_values", "values")])
def test_engine_packed_outputs_equal_the_padded_engine(role: str, method: str, column: str) -> None:
    batch = skewed_batch()
    mask = batch["response_mask"].bool()
    padded = getattr(engine(role, use_remove_padding=False, extra={"lean_forward": False}), method)(batch)[column]
    packed_engine = engine(role)
    assert packed_engine.packed and packed_engine.model.config._attn_implementation == packing.VARLEN_ATTENTION
    packed = getattr(packed_engine, method)(batch)[column]
    assert (padded - packed)[mask].abs().max().item() < TOLERANCE


@pytest.mark.parametrize("lean", [True, False], ids=["default", "lean_forward_off"])
def test_packing_removes_the_padded_tokens_from_the_forward(lean: bool) -> None:
    """Rows that share no prompt (the default engine too: the lean forward takes micro-batches that repeat prompts)
    reach the HF model as one sequence of the valid tokens, positions restarting at 0 in each row."""
    actor = engine(extra={"lean_forward": lean})
    assert actor.resolved_options()["forward"] == ("lean_packed" if lean else "hf_packed")
    seen = []
    actor.model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape))
    batch = skewed_batch()
    actor.compute_log_probs(batch)
    assert seen == [torch.Size([1, int(batch["attention_mask"].sum())])]
    packed = packing.pack_rows(batch["input_ids"], batch["attention_mask"], None, batch["responses"])
    starts = packed.cu_seqlens[:-1].long()
    assert packed.position_ids[0, starts].eq(0).all() and packed.targets.numel() == int(batch["response_mask"].sum())


class LinearRows(torch.overrides.TorchFunctionMode):
    """Records the rows of every ``F.linear`` input (all leading dimensions flattened) and the (batch, queries,
    keys) of every SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []
        self.attention: list[tuple[int, int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # by name: DeepSpeed's ZeRO-3 (run earlier in the same test process) may leave F.linear rebound to its wrapper
        name = getattr(func, "__name__", "")
        if name == "linear":
            self.rows.append(int(args[0].numel() // args[0].shape[-1]))
        elif name == "scaled_dot_product_attention":
            self.attention.append((args[0].shape[0], args[0].shape[-2], args[1].shape[-2]))
        return func(*args, **(kwargs or {}))


def shared_prompt_batch() -> Batch:
    """Four samples of each of two prompts (as rollouts lay them out), responses of skewed lengths."""
    batch = skewed_batch()
    prompt = batch["attention_mask"].shape[1] - batch["responses"].shape[1]
    for column in ("input_ids", "attention_mask"):
        values = batch[column].clone()
        values[:, :prompt] = values[[0, 0, 0, 0, 7, 7, 7, 7], :prompt]
        batch[column] = values
    return batch


def test_the_lean_forward_removes_padding_on_the_default_path() -> None:
    """The default actor (use_remove_padding on, a Qwen2 model) scores and trains a rollout's micro-batch (n samples
    per prompt) through the lean forward, whose linear layers see only the valid tokens (each shared prompt once)
    and whose LM head runs only where a valid response token is predicted; log-probs equal the padded HF forward's
    within 1e-5 and hold 0 at padding, and a train step updates as the HF packed forward does."""
    batch = shared_prompt_batch()
    actor = engine()
    assert actor.resolved_options()["forward"] == "lean_packed"
    mask = batch["response_mask"].bool()
    prompt = batch["attention_mask"].shape[1] - mask.shape[1]
    distinct = [0, 4]
    stream = int(batch["attention_mask"][distinct, :prompt].sum()) + int(mask.sum())
    with LinearRows() as seen:
        log_probs = actor.compute_log_probs(batch)["log_probs"]
    layers = actor.model.config.num_hidden_layers
    assert len(seen.rows) == 5 * layers + 1  # q/k/v, o, gate, up, down per layer, then the LM head
    assert seen.rows[:-1] == [stream] * (5 * layers)  # valid tokens only, each distinct prompt once
    assert seen.rows[-1] == int(mask.sum())  # the LM head: valid response tokens only
    # the responses attend in groups of similar length, each over its own width: well under the padded grid's area
    responses = [(b, q, k) for b, q, k in seen.attention if k > q]  # (the prompts' own attention is square)
    assert sum(b for b, _, _ in responses) == len(batch) * layers and len(responses) > layers
    padded_area = len(batch) * mask.shape[1] * (prompt + mask.shape[1]) * layers
    assert sum(b * q * k for b, q, k in responses) < 0.5 * padded_area
    padded = engine(use_remove_padding=False, extra={"lean_forward": False}).compute_log_probs(batch)["log_probs"]
    assert (padded - log_probs)[mask].abs().max().item() < TOLERANCE
    assert log_probs[~mask].abs().max().item() == 0
    weights = []
    for extra in ({}, {"lean_forward": False}):
        trained = engine(micro_batch_size=4, extra=extra)
        trained.train_step(batch, loss_fn=token_mean_nll)
        weights.append(dict(trained.generation_weights()))
    gap = max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0])
    assert gap < TOLERANCE, f"lean packed and HF packed updates differ by {gap}"


@pytest.mark.parametrize("loss_fn", [sequence_mean_nll, token_mean_nll], ids=["seq_mean", "token_mean"])
def test_token_budget_micro_batches_give_the_fixed_path_update(loss_fn) -> None:
    """Micro-batches cut by a token budget (several, uneven) give the loss and update of fixed micro-batches."""
    batch = skewed_batch()
    tokens = packing.count_row_tokens(batch)
    budget = max(tokens) + 4
    runs = []
    for options in ({"micro_batch_size": 3}, {"max_tokens_per_micro_batch": budget}):
        actor = engine(**options)
        forwards: list[int] = []
        actor.model.model.embed_tokens.register_forward_hook(lambda _m, args, _o, s=forwards: s.append(args[0].numel()))
        metrics = actor.train_step(batch, loss_fn=loss_fn, mini_batch_size=4)
        runs.append((metrics, {n: p.detach().clone() for n, p in actor.model.named_parameters()}, forwards))
    (fixed, fixed_weights, _), (dynamic, dynamic_weights, forwards) = runs
    assert len(forwards) > 4 and max(forwards) <= budget  # more than one micro-batch per mini-batch, none over budget
    assert sum(forwards) == sum(tokens)
    assert dynamic["loss"] == pytest.approx(fixed["loss"], rel=1e-5)
    assert dynamic["grad_norm"] == pytest.approx(fixed["grad_norm"], rel=1e-5)
    gap = max((fixed_weights[n] - dynamic_weights[n]).abs().max().item() for n in fixed_weights)
    assert gap < 1e-6, f"token-budget micro-batches changed the update by {gap}"


def test_token_budget_keeps_the_row_order_of_log_probs() -> None:
    batch = skewed_batch()
    fixed = engine(micro_batch_size=8).compute_log_probs(batch, with_entropy=True)
    dynamic = engine(max_tokens_per_micro_batch=max(packing.count_row_tokens(batch))).compute_log_probs(
        batch, with_entropy=True)
    for column in ("log_probs", "entropy"):
        assert (fixed[column] - dynamic[column]).abs().max().item() < TOLERANCE


def test_a_budget_below_the_longest_row_is_refused() -> None:
    batch = skewed_batch()
    longest = max(packing.count_row_tokens(batch))
    actor = engine(max_tokens_per_micro_batch=longest - 1)
    with pytest.raises(ConfigError, match=rf"actor\.max_tokens_per_micro_batch={longest - 1} .*longest row .*"
                                          rf"\({longest} tokens\).*>= {longest}"):
        actor.train_step(batch, loss_fn=token_mean_nll)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch must be > 0"):
        TrainingEngineConfig(model=ModelSpec(config=tiny_model_config()), max_tokens_per_micro_batch=0)


def test_packing_needs_sdpa_attention() -> None:
    with pytest.raises(ConfigError, match=r"use_remove_padding=true .*'eager'.*use_remove_padding=false"):
        engine(extra={"attn_implementation": "eager"})
    assert not engine(use_remove_padding=False, extra={"attn_implementation": "eager"}).packed


@pytest.mark.parametrize("seed", range(20))
def test_partition_fits_the_budget_and_balances(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (int(torch.randint(1, 30, (1,), generator=generator)),), generator=generator)
    tokens = tokens.tolist()
    budget = max(tokens) + int(torch.randint(0, 60, (1,), generator=generator))
    fewest = packing.count_token_bins(tokens, budget)
    assert fewest >= -(-sum(tokens) // budget)
    for bins in sorted({fewest, min(fewest + 2, len(tokens)), len(tokens)}):
        groups = packing.partition_by_tokens(tokens, budget, bins=bins)
        assert len(groups) == bins and all(groups)
        assert sorted(row for group in groups for row in group) == list(range(len(tokens)))
        assert max(sum(tokens[r] for r in group) for group in groups) <= budget
    with pytest.raises(ValueError, match="micro-batches"):
        packing.partition_by_tokens(tokens, budget, bins=len(tokens) + 1)


def test_partition_balances_when_the_fewest_bins_leave_room() -> None:
    """Longest-first to the least loaded micro-batch: [9, 8, 3, 2, 2] under 12 as 12/12, not 12/9+..."""
    groups = packing.partition_by_tokens([9, 8, 3, 2, 2], 12)
    assert sorted(sum([9, 8, 3, 2, 2][r] for r in g) for g in groups) == [12, 12]
    # where balancing would overflow, first-fit keeps every micro-batch under the budget
    tokens = [6, 4, 4, 3, 3]
    assert all(sum(tokens[r] for r in g) <= 10 for g in packing.partition_by_tokens(tokens, 10))


def test_unsharded_packed_engine_steps_like_fsdp() -> None:
    """The packed forward through FSDP2's module (one gloo rank) updates like the unsharded packed one."""
    base = dataclasses.replace(engine().config, micro_batch_size=4)
    weights = []
    for extra in ({}, {"fsdp_always": True}):
        actor = FSDPTrainingEngine(role="actor", config=dataclasses.replace(base, extra=extra))
        assert actor.sharded == bool(extra) and actor.packed
        actor.train_step(skewed_batch(), loss_fn=token_mean_nll)
        weights.append({name: tensor.clone() for name, tensor in actor.generation_weights()})
    gap = max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0])
    assert gap < 1e-5, f"sharded and unsharded packed engines differ by {gap}"


def test_half_precision_training_attention_runs_in_fp32_on_cpu() -> None:
    """torch's CPU flash-attention backward is 4-10x slower in bf16 than in fp32 at rollout shapes: the packed
    attention upcasts where autograd will run its backward (bf16 out, fp32 inside) and stays bf16 under no-grad."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, 30, 16, generator=generator).bfloat16() for heads in (4, 2, 2))
    cu_seqlens = torch.tensor([0, 10, 20, 30])

    def attention(*tensors: torch.Tensor) -> torch.Tensor:
        out, _ = packing._varlen_sdpa_attention(torch.nn.Module(), *tensors, None, cu_seq_lens_q=cu_seqlens)
        return out

    def per_row(dtype: torch.dtype) -> torch.Tensor:
        q, k, v = (t.to(dtype)[0].view(t.shape[1], 3, 10, 16).transpose(0, 1) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(4, 30, 16).transpose(0, 1).unsqueeze(0).bfloat16()

    trained = attention(*(t.clone().requires_grad_() for t in (query, key, value)))
    assert trained.dtype == torch.bfloat16
    assert torch.equal(trained, per_row(torch.float32))
    assert not torch.equal(trained, per_row(torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(attention(query, key, value), per_row(torch.bfloat16))
