"""Training-engine contract: a few steps lower the loss on a fixed batch, every role computes its columns, a
checkpoint resumes bit-identically, and 2 data-parallel ranks match 1 rank after 3 AdamW steps (fp32).

Single-process checks take ``make_engine(role, config) -> TrainingEngine`` and a scratch directory;
:func:`check_data_parallel_matches_single` takes a picklable (module-level) factory with the
:class:`~hybridflow.engines.TrainingEngineFactory` signature, run on spawned gloo ranks. Stability: public.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngine, TrainingEngineConfig
from hybridflow.testing.contracts.rollout import prepare_model
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.fixtures import CHAR_VOCAB, PAD_ID

__all__ = [
    "TrainingEngineMaker",
    "TRAINING_CHECKS",
    "build_training_batch",
    "sequence_mean_nll",
    "check_train_step_lowers_loss",
    "check_roles_compute_columns",
    "check_checkpoint_resume_is_bit_identical",
    "check_process_reuse",
    "check_data_parallel_matches_single",
    "data_parallel_failures",
]

TrainingEngineMaker = Callable[[str, TrainingEngineConfig], TrainingEngine]
OPTIM = OptimConfig(lr=2e-3, weight_decay=0.01, warmup_steps=1, total_steps=10, schedule="cosine", grad_clip=1.0)


def build_training_batch(rows: int = 8, prompt_length: int = 6, response_length: int = 6, seed: int = 0) -> Batch:
    """A fixed rollout-shaped batch: left-padded prompts, right-padded responses of varying length."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, len(CHAR_VOCAB), (rows, prompt_length), generator=generator)
    responses = torch.randint(4, len(CHAR_VOCAB), (rows, response_length), generator=generator)
    prompt_mask = torch.ones_like(prompts)
    response_mask = torch.ones_like(responses)
    for row in range(rows):
        prompt_mask[row, : row % 3] = 0
        response_mask[row, response_length - row % 4 :] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, PAD_ID)
    responses = responses.masked_fill(response_mask == 0, PAD_ID)
    return Batch({
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "response_mask": response_mask,
        "advantages": torch.randn(rows, response_length, generator=generator),
    }, meta={"policy_version": 0, "iteration": 0})


def sequence_mean_nll(
    outputs: Mapping[str, torch.Tensor] | Batch, micro_batch: Batch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over rows of each row's mean negative log-likelihood of its response tokens (a row-mean loss).

    Normalised by ``meta["loss_scale_rows"]`` (the mini-batch's rows, set by the engine) so that micro-batch losses
    sum to the mini-batch loss — the gradient-accumulation convention of :mod:`hybridflow.algorithms.losses`.
    """
    mask = micro_batch["response_mask"].to(outputs["log_probs"].dtype)
    per_row = -(outputs["log_probs"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    rows = float(micro_batch.meta.get("loss_scale_rows", len(micro_batch)))
    return per_row.sum() / rows, {"nll": float(per_row.mean().detach())}


def value_regression(
    outputs: Mapping[str, torch.Tensor] | Batch, micro_batch: Batch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Row-mean squared error of ``values`` against the ``advantages`` column (a stand-in return target)."""
    mask = micro_batch["response_mask"].to(outputs["values"].dtype)
    error = ((outputs["values"] - micro_batch["advantages"]) ** 2 * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return error.sum() / float(micro_batch.meta.get("loss_scale_rows", len(micro_batch))), {}


def _config(path: Path, **options: Any) -> TrainingEngineConfig:
    return TrainingEngineConfig(model=ModelSpec(path=str(path)), optim=OPTIM, micro_batch_size=2, **options)


def check_train_step_lowers_loss(make_engine: TrainingEngineMaker, workdir: Path) -> None:
    """Three actor steps lower the NLL of a fixed batch; three critic steps lower its value error."""
    path = prepare_model(workdir)
    batch = build_training_batch()
    actor = make_engine("actor", _config(path))
    before = sequence_mean_nll(actor.compute_log_probs(batch), batch)[0].item()
    version = actor.state_version()
    for _ in range(3):
        metrics = actor.train_step(batch, loss_fn=sequence_mean_nll)
    after = sequence_mean_nll(actor.compute_log_probs(batch), batch)[0].item()
    assert after < before - 1e-3, f"actor NLL went {before:.5f} → {after:.5f} after 3 steps; it must fall"
    assert actor.state_version() == version + 3, f"state_version {actor.state_version()} after 3 steps from {version}"
    assert "grad_norm" in metrics and torch.isfinite(torch.tensor(metrics["grad_norm"])), f"metrics {metrics}"
    critic = make_engine("critic", _config(path))
    errors = []
    for _ in range(4):
        errors.append(value_regression(critic.compute_values(batch), batch)[0].item())
        critic.train_step(batch, loss_fn=value_regression)
    assert errors[-1] < errors[0], f"critic value error did not fall: {errors}"


def check_roles_compute_columns(make_engine: TrainingEngineMaker, workdir: Path) -> None:
    """Reference log-probs equal the actor's on the same weights; entropy, values and scores have their shapes."""
    path = prepare_model(workdir)
    batch = build_training_batch()
    rows, length = batch["responses"].shape
    actor_out = make_engine("actor", _config(path)).compute_log_probs(batch, with_entropy=True)
    reference_out = make_engine("reference", _config(path)).compute_log_probs(batch)
    assert tuple(actor_out["log_probs"].shape) == (rows, length) and tuple(actor_out["entropy"].shape) == (rows, length)
    assert torch.allclose(actor_out["log_probs"], reference_out["log_probs"], atol=1e-5), "reference ≠ actor"
    assert bool((actor_out["entropy"] >= 0).all()) and bool((actor_out["log_probs"] <= 0).all())
    assert actor_out.meta.get("policy_version") == 0, "outputs must carry the input meta"
    values = make_engine("critic", _config(path)).compute_values(batch)["values"]
    assert tuple(values.shape) == (rows, length) and bool(torch.isfinite(values).all())
    reward_model = make_engine("reward_model", _config(path))
    scores = reward_model.compute_scores(batch)["scores"]
    assert tuple(scores.shape) == (rows,) and bool(torch.isfinite(scores).all())
    # the score sits on the last real token: changing padding after it must not change it
    extra = torch.full((rows, 2), PAD_ID, dtype=batch["input_ids"].dtype)
    padded = Batch({
        "input_ids": torch.cat([batch["input_ids"], extra], 1),
        "responses": torch.cat([batch["responses"], extra], 1),
        "attention_mask": torch.cat([batch["attention_mask"], torch.zeros_like(extra)], 1),
    }, meta=batch.meta)
    assert torch.allclose(reward_model.compute_scores(padded)["scores"], scores, atol=1e-5), "score moved with padding"


def check_checkpoint_resume_is_bit_identical(make_engine: TrainingEngineMaker, workdir: Path) -> None:
    """save → step → load → step gives the same weights and loss bit for bit, and restores state_version."""
    path = prepare_model(workdir)
    batch = build_training_batch()
    actor = make_engine("actor", _config(path))
    actor.train_step(batch, loss_fn=sequence_mean_nll)
    checkpoint = str(Path(workdir) / "checkpoint")
    saved_version = actor.state_version()
    actor.save_checkpoint(checkpoint)
    first = actor.train_step(batch, loss_fn=sequence_mean_nll)
    weights = {name: tensor.clone() for name, tensor in actor.generation_weights()}
    actor.load_checkpoint(checkpoint)
    assert actor.state_version() == saved_version, f"state_version after load {actor.state_version()} ≠ {saved_version}"
    second = actor.train_step(batch, loss_fn=sequence_mean_nll)
    assert first["loss"] == second["loss"], f"resumed loss {second['loss']} ≠ {first['loss']}"
    for name, tensor in actor.generation_weights():
        assert torch.equal(tensor, weights[name]), f"{name} differs after resume"


def check_process_reuse(make_engine: TrainingEngineMaker, workdir: Path) -> None:
    """For an engine that declares ``reusable_process`` (TrainingEngineInfo): two steps on an engine, the engine
    closed (its ``close()`` if it has one) and this process restored as a parked worker host restores it
    (hybridflow.controller.process_state), then the same two steps on a new engine in this process give the same
    losses and weights bit for bit, and the first engine left no thread running. Not in :data:`TRAINING_CHECKS`:
    run it for the engines you declare it for."""
    from hybridflow.controller import process_state

    path = prepare_model(workdir)
    batch = build_training_batch()
    baseline, threads = process_state.capture(), process_state.python_threads()

    def two_steps() -> tuple[list[float], dict[str, torch.Tensor]]:
        engine = make_engine("actor", _config(path))
        losses = [float(engine.train_step(batch, loss_fn=sequence_mean_nll)["loss"]) for _ in range(2)]
        weights = {name: tensor.detach().clone() for name, tensor in engine.generation_weights()}
        close = getattr(engine, "close", None)
        if callable(close):
            close()
        return losses, weights

    first_losses, first_weights = two_steps()
    reasons = process_state.restore(baseline, threads)
    assert not reasons, f"the process is unfit for reuse after the engine was closed: {reasons}"
    second_losses, second_weights = two_steps()
    process_state.restore(baseline, threads)
    assert second_losses == first_losses, f"losses on the reused process {second_losses} ≠ fresh {first_losses}"
    for name, tensor in first_weights.items():
        assert torch.equal(second_weights[name], tensor), f"{name} differs on the reused process"


ROWS, MINI_BATCH_ROWS = 8, 4


def _mini_batch_order(rows: int, world_size: int) -> list[int]:
    """Row order whose contiguous split over ``world_size`` ranks puts the same rows in each global mini-batch as
    1 rank has: mini-batch ``k`` is the ``k``-th local slice of every rank (rows of the global batch in order)."""
    local_mini = MINI_BATCH_ROWS // world_size
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for start in range(0, rows, MINI_BATCH_ROWS):
        for rank in range(world_size):
            per_rank[rank].extend(range(start + rank * local_mini, start + (rank + 1) * local_mini))
    return [row for rank_rows in per_rank for row in rank_rows]


def _data_parallel_rank(rank: int, world_size: int, factories: Mapping[str, Callable[..., TrainingEngine]],
                        path: str, out_file: str, steps: int) -> None:
    config = TrainingEngineConfig(model=ModelSpec(path=path), optim=OPTIM, micro_batch_size=2)
    batch = build_training_batch(rows=ROWS).index(_mini_batch_order(ROWS, world_size))
    batch = batch.chunk(world_size)[rank]
    results = {}
    for name, factory in factories.items():  # one engine after the other in the same process group
        engine = factory(role="actor", config=config, device="cpu")
        for _ in range(steps):
            engine.train_step(batch, loss_fn=sequence_mean_nll, mini_batch_size=MINI_BATCH_ROWS)
        weights = {key: tensor.clone() for key, tensor in engine.generation_weights()}
        results[name] = {"weights": weights, "version": engine.state_version()}
        del engine
    if rank == 0:
        torch.save(results, out_file)


def check_data_parallel_matches_single(factory: Callable[..., TrainingEngine], workdir: Path, *,
                                       world_size: int = 2, steps: int = 3, atol: float = 1e-5,
                                       timeout_s: float = 240) -> None:
    """``world_size`` gloo ranks (data-parallel, 8 rows split evenly) end within ``atol`` of 1 rank after ``steps``
    train_step calls of 2 AdamW mini-batch steps each (fp32, micro-batches of 2, grad clipping, warmup + cosine).

    ``mini_batch_size`` counts rows over all ranks; mini-batch ``k`` is the ``k``-th slice of every rank's rows.
    """
    (failure,) = data_parallel_failures({"engine": factory}, workdir, world_size=world_size, steps=steps, atol=atol,
                                        timeout_s=timeout_s).values()
    if failure is not None:
        raise AssertionError(failure)


def data_parallel_failures(factories: Mapping[str, Callable[..., TrainingEngine]], workdir: Path, *,
                           world_size: int = 2, steps: int = 3, atol: float = 1e-5,
                           timeout_s: float = 240) -> dict[str, str | None]:
    """:func:`check_data_parallel_matches_single` for several factories (variants of one engine, say) on one 1-rank
    and one ``world_size``-rank group, each building its engines one after the other (the processes, and their
    imports, are paid once): ``{name: None if it holds, else the failure}``."""
    path = str(prepare_model(workdir))
    out_files = {ranks: str(Path(workdir) / f"dp{ranks}.pt") for ranks in (1, world_size)}
    jobs = [(_data_parallel_rank, ranks, (dict(factories), path, out_files[ranks], steps)) for ranks in (1, world_size)]
    run_rank_groups(jobs, workdir=Path(workdir), timeout_s=timeout_s)
    results = {ranks: torch.load(out_file, weights_only=False) for ranks, out_file in out_files.items()}
    initial = _initial_weights(Path(path))
    failures: dict[str, str | None] = {}
    for name in factories:
        try:
            _compare_data_parallel(results[1][name], results[world_size][name], initial, world_size, steps, atol)
            failures[name] = None
        except AssertionError as error:
            failures[name] = f"{name}: {error}"
    return failures


def _compare_data_parallel(single: dict[str, Any], multi: dict[str, Any], initial: dict[str, torch.Tensor],
                           world_size: int, steps: int, atol: float) -> None:
    assert single["version"] == multi["version"] == 2 * steps, f"versions {single['version']}, {multi['version']}"
    moved = max((single["weights"][n] - initial[n]).abs().max().item() for n in single["weights"] if n in initial)
    assert moved > 1e-4, f"weights barely moved ({moved}); the comparison would be vacuous"
    gaps = {name: (single["weights"][name] - multi["weights"][name]).abs().max().item() for name in single["weights"]}
    # a key bias has no gradient (softmax is invariant to a shift shared by all keys): its "gradient" is rounding
    # noise, which AdamW's normalisation turns into lr-sized steps of either sign, so 1 and N ranks (different
    # summation orders) part there by up to ~lr per step whatever the engine does right; it is checked against that
    noise = {name: gap for name, gap in gaps.items() if name.endswith("k_proj.bias")}
    bound = 2 * steps * OPTIM.lr
    assert all(gap <= bound for gap in noise.values()), f"key biases differ by more than {bound}: {noise}"
    gaps = {name: gap for name, gap in gaps.items() if name not in noise}
    worst = max(gaps, key=gaps.__getitem__)
    assert gaps[worst] <= atol, f"{world_size} ranks differ from 1 rank by {gaps[worst]} on {worst} (> {atol})"


def _initial_weights(path: Path) -> dict[str, torch.Tensor]:
    from hybridflow.testing.contracts.rollout import read_weights

    return read_weights(path)


TRAINING_CHECKS: tuple[Callable[[TrainingEngineMaker, Path], None], ...] = (
    check_train_step_lowers_loss,
    check_roles_compute_columns,
    check_checkpoint_resume_is_bit_identical,
)


def even_split_step_inputs(rank: int, world_size: int) -> tuple[ModelSpec, Batch, Batch]:
    """The inputs of the hybrid engine's step tests on ``world_size`` ranks: a tiny model whose every parameter
    splits evenly over 2 ranks (vocabulary 48: FSDP moves no padding, so bytes = the planner's lower bound), this
    rank's share of an 8-row training batch, and the rollout contract's prompt batch."""
    from hybridflow.testing.contracts.rollout import build_prompt_batch
    from hybridflow.testing.fixtures import tiny_model_config

    spec = ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2, vocab_size=48), seed=3)
    return spec, build_training_batch(rows=8).chunk(world_size)[rank], build_prompt_batch()
