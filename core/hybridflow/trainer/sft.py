"""Supervised fine-tuning (``hybridflow sft CONFIG``): masked token NLL on the response tokens of demonstrations,
trained by the same training engine, worker class and pool layout as an RL run's actor, then written out as a
Hugging Face model directory that ``hybridflow train`` starts from (``model.path``), as verl's SFT trainer does.

The actor worker of the hybrid engine does the work: its ``update_policy`` runs ``train_step`` with
:class:`SFTLoss` instead of the policy loss, ``compute_log_probs`` gives the validation loss, ``generate`` the
greedy held-out answers (scored by the task's reward: exact match), and ``export_hf`` the model directory.

Demonstrations are rows with a prompt and a response column (``data.prompt_key`` / ``data.response_key``, verl's
SFT keys), in ``.jsonl`` or ``.parquet``, read and laid out by :mod:`hybridflow.trainer.sft_data`. Stability:
experimental.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.errors import ConfigError, DatasetError
from hybridflow.trainer.sft_config import SFTConfig, load_sft_config
from hybridflow.trainer.sft_data import (
    PROMPT_FIELD,
    RESPONSE_FIELD,
    build_demonstration_batch,
    build_sft_batch,
    load_demonstrations,
)

__all__ = ["SFTConfig", "SFTLoss", "SFTTrainer", "HF_DIR", "load_sft_config", "build_sft_batch", "load_demonstrations",
           "PROMPT_FIELD", "RESPONSE_FIELD", "main"]

#: the folder of the run directory that holds the fine-tuned model as an HF directory (``model.path`` of RL)
HF_DIR = "hf"


class SFTLoss:
    """``loss_fn`` of the training engine for SFT: the NLL of the response tokens, summed and divided by the
    mini-batch's valid tokens over all ranks (``loss_scale_tokens``, the engines' accumulation convention), so the
    micro-batches' losses add up to the token-mean over the whole batch."""

    required_outputs = ("log_probs",)

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Batch) -> tuple[torch.Tensor,
                                                                                           dict[str, float]]:
        mask = micro_batch["response_mask"].to(outputs["log_probs"].device).float()
        nll = -(outputs["log_probs"] * mask).sum()
        scale = float(micro_batch.meta.get("loss_scale_tokens") or mask.sum().clamp(min=1))
        local_tokens = float(mask.sum())
        return nll / scale, {"nll": float(nll.detach()) / max(local_tokens, 1.0)}


def masked_nll(log_probs: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Token-mean NLL of the response tokens."""
    mask = response_mask.float()
    return float(-(log_probs * mask).sum() / mask.sum().clamp(min=1))


# --- the run -----------------------------------------------------------------------------------------------------
class SFTTrainer:
    """One SFT run: ``SFTTrainer(config).fit()`` → the HF directory. Stability: experimental."""

    def __init__(self, config: SFTConfig, *, progress: bool | None = None) -> None:
        from hybridflow.trainer.build import build_model_spec, build_tokenizer

        self.config = config
        self.run_dir = Path(config.trainer.run_dir)
        self.tokenizer = build_tokenizer(config.model)
        data = config.data

        def read(files: list[str]) -> list[dict[str, Any]]:
            return load_demonstrations(files, prompt_key=data.prompt_key, response_key=data.response_key,
                                       prompt_dict_keys=data.prompt_dict_keys,
                                       response_dict_keys=data.response_dict_keys, messages_key=data.messages_key)

        self.train_rows = read(data.train_files)
        self.val_rows = read(data.val_files) if data.val_files else []

        self.train_batch = build_demonstration_batch(self.train_rows, self.tokenizer, data)
        self.val_batch = build_demonstration_batch(self.val_rows, self.tokenizer, data) if self.val_rows else None
        if data.batch_size > len(self.train_rows):
            raise DatasetError(f"data.batch_size={data.batch_size} is larger than the {len(self.train_rows)} "
                               "demonstrations; lower it or add demonstrations")
        self.model_spec = build_model_spec(config.model, seed=config.trainer.seed)
        self.reward_fn = None
        if config.reward.function and self.val_rows:
            from hybridflow.rewards import resolve_reward_function

            self.reward_fn = resolve_reward_function(config.reward.function)
        self.show_progress = config.trainer.progress if progress is None else progress
        self.group: Any = None
        self.pool: Any = None
        self.history: list[dict[str, float]] = []
        self.validation_history: list[dict[str, float]] = []

    # --- building -------------------------------------------------------------------------------------------
    def _spec(self) -> Any:
        from hybridflow.engines import (
            OptimConfig,
            ParallelConfig,
            RolloutEngineConfig,
            SamplingParams,
            TrainingEngineConfig,
        )
        from hybridflow.precision import resolve_mixed_precision
        from hybridflow.trainer.build import rollout_model_spec
        from hybridflow.workers import RoleSpec

        config, actor, data = self.config, self.config.actor, self.config.data
        optim = actor.optim
        device = config.resource_pools[actor.pool].device
        precision = resolve_mixed_precision(actor.mixed_precision, engine=actor.engine, device=device,
                                            model=self.model_spec)
        engine_config = TrainingEngineConfig(
            model=self.model_spec, micro_batch_size=actor.micro_batch_size,
            parallel=ParallelConfig(tensor_parallel_size=actor.parallel.tensor_parallel_size,
                                    pipeline_parallel_size=actor.parallel.pipeline_parallel_size,
                                    data_parallel_size=actor.parallel.data_parallel_size),
            optim=OptimConfig(lr=optim.lr, betas=(optim.betas[0], optim.betas[1]), weight_decay=optim.weight_decay,
                              warmup_steps=optim.warmup_steps, total_steps=config.trainer.total_steps,
                              schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio, grad_clip=optim.grad_clip),
            mixed_precision=precision,
            gradient_checkpointing=actor.gradient_checkpointing, extra=dict(actor.extra))
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        seed = config.trainer.seed
        return RoleSpec(
            role="actor", name="actor", engine=actor.engine, device=device,
            threads=config.trainer.threads_per_worker, engine_config=engine_config, loss=SFTLoss(),
            rollout_engine=config.rollout.engine,
            rollout_config=RolloutEngineConfig(model=rollout_model_spec(self.model_spec, "auto", precision),
                                               max_prompt_length=data.max_prompt_length,
                                               max_new_tokens=data.max_response_length, pad_token_id=pad_id,
                                               eos_token_id=self.tokenizer.eos_token_id, seed=seed,
                                               extra=dict(config.rollout.extra)),
            sampling=SamplingParams(n=1, temperature=1.0, max_new_tokens=data.max_response_length, seed=seed))

    def start(self) -> None:
        from hybridflow.controller import WorkerGroup
        from hybridflow.plugins import load_plugins
        from hybridflow.trainer.build import build_resource_pool, start_ray
        from hybridflow.workers import ActorRolloutWorker

        load_plugins()
        self._check_engines()
        start_ray(self.config.ray)
        pool_name = self.config.actor.pool
        self.pool = build_resource_pool(pool_name, self.config.resource_pools[pool_name])
        spec = self._spec()
        self.group = WorkerGroup(self.pool, {"actor": ActorRolloutWorker}, init_kwargs={"actor": {"spec": spec}},
                                 name=pool_name, deadline_s=self.config.trainer.deadline_s,
                                 stack_dump_dir=str(self.run_dir / "stacks"))

    def _check_engines(self) -> None:
        from hybridflow import registries

        for key, registry, name in (("actor.engine", registries.training_engines, self.config.actor.engine),
                                    ("rollout.engine", registries.rollout_engines, self.config.rollout.engine)):
            if name not in registry:
                try:
                    registry.get(name)
                except KeyError as exc:
                    raise ConfigError(f"{key}: {exc}") from None

    def close(self) -> None:
        from hybridflow.trainer.build import release_worker_group

        release_worker_group(self.group, self.pool)
        self.group = self.pool = None

    # --- steps ----------------------------------------------------------------------------------------------
    def _batches(self) -> Any:
        """Endless seeded epoch-wise shuffled batches of ``data.batch_size`` rows (a partial tail is skipped)."""
        rows, size = len(self.train_rows), self.config.data.batch_size
        epoch = 0
        while True:
            order = list(range(rows))
            if self.config.data.shuffle:
                random.Random(self.config.trainer.seed * 1_000_003 + epoch).shuffle(order)
            for start in range(0, rows - size + 1, size):
                yield self.train_batch.index(torch.tensor(order[start:start + size]))
            epoch += 1

    def validate(self, step: int) -> dict[str, float]:
        """``val/loss`` (token-mean NLL of the val responses) and, with a reward function, the greedy answers'
        ``val-core/<data_source>/acc/mean@1`` (exact match) and ``val-aux/<data_source>/reward/mean@1``."""
        if self.val_batch is None:
            return {}
        from hybridflow.trainer.validation import summarize_validation

        world = self.pool.world_size
        rows = len(self.val_batch)
        padded = self.val_batch.index(torch.cat([torch.arange(rows), torch.full((-rows % world,), rows - 1)]))
        started = time.perf_counter()
        out = self.group.actor.compute_log_probs(padded).get(timeout=self.config.trainer.deadline_s)
        metrics = {"val/loss": masked_nll(out["old_log_probs"][:rows], self.val_batch["response_mask"])}
        if self.reward_fn is not None:
            sources, uids, scores = self._greedy_scores(padded, rows)
            metrics.update(summarize_validation(sources, uids, scores, greedy=True))
        metrics["timing_s/testing"] = time.perf_counter() - started
        return metrics

    def _greedy_scores(self, padded: Batch, rows: int) -> tuple[list[str], list[str], list[float]]:
        from hybridflow.detokenize import decode_batch
        from hybridflow.rewards import score_responses

        prompts = Batch({"input_ids": padded["prompts"], "attention_mask": padded["attention_mask"][:, :padded[
            "prompts"].shape[1]]}, meta={"iteration": 0, "policy_version": self._policy_version})
        generated = self.group.actor.generate(prompts, greedy=True).get(timeout=self.config.trainer.deadline_s)
        responses = generated["responses"][:rows].tolist()
        masks = generated["response_mask"][:rows].bool().tolist()
        texts = decode_batch(self.tokenizer, [[t for t, keep in zip(r, m) if keep] for r, m in zip(responses, masks)])
        truths = [str((row.get("reward_model") or {}).get("ground_truth", row.get(RESPONSE_FIELD)))
                  for row in self.val_rows]
        sources = [str(row.get("data_source", "sft")) for row in self.val_rows]
        extra = [dict(row.get("extra_info") or {}) for row in self.val_rows]
        assert self.reward_fn is not None
        result = score_responses(self.reward_fn, responses=texts, ground_truths=truths, data_sources=sources,
                                 name="reward", extra=extra)
        return sources, [f"val-{i}" for i in range(rows)], [float(s) for s in result.scores]

    @property
    def _policy_version(self) -> int:
        return len(self.history)

    def fit(self) -> Path:
        """Train ``trainer.total_steps`` steps, validating before, every ``trainer.val_every`` steps and after;
        returns the HF directory written (``RUN_DIR/hf``)."""
        from hybridflow.algorithms.helpers import mean_over_ranks
        from hybridflow.trainer.checkpoint import archive_previous_logs
        from hybridflow.trainer.progress import MetricsWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        archive_previous_logs(self.run_dir)
        if self.group is None:
            self.start()
        total, every = self.config.trainer.total_steps, self.config.trainer.val_every
        loggers = ("jsonl", "tensorboard") if self.config.trainer.tensorboard else ("jsonl",)
        writer = MetricsWriter(self.run_dir, loggers=loggers)
        started = time.perf_counter()
        try:
            self._validate_and_log(writer, 0)
            batches = self._batches()
            for step in range(1, total + 1):
                batch = next(batches)
                step_start = time.perf_counter()
                metrics = mean_over_ranks(self.group.actor.update_policy(batch))
                row = {"train/loss": metrics["loss"], "train/lr": metrics["lr"],
                       "train/grad_norm": metrics["grad_norm"], "time/step_s": time.perf_counter() - step_start}
                writer.write(step, row)
                self.history.append(row)
                if self.show_progress and (step % max(1, total // 10) == 0 or step == total):
                    print(f"sft step {step}/{total}  train/loss={row['train/loss']:.3f}", flush=True)
                if (every and step % every == 0) or step == total:
                    self._validate_and_log(writer, step)
            target = self.run_dir / HF_DIR
            self.group.actor.export_hf(str(target))
            self.tokenizer.save_pretrained(target)
            (self.run_dir / "summary.json").write_text(json.dumps({
                "steps": total, "seconds": time.perf_counter() - started, "hf_dir": str(target),
                "last": self.history[-1] if self.history else {},
                "validation": self.validation_history}, indent=1))
        finally:
            writer.close()
        return target

    def _validate_and_log(self, writer: Any, step: int) -> None:
        metrics = self.validate(step)
        if metrics:
            writer.write(step, metrics)
            self.validation_history.append({"step": float(step), **metrics})


# --- the command -------------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """``hybridflow sft CONFIG.yaml [dotted.key=value ...]``."""
    import argparse

    from hybridflow.trainer.cli import fit_and_close, run_guarded, validation_lines

    parser = argparse.ArgumentParser(prog="hybridflow sft", description=(
        "Supervised fine-tuning (masked response-token NLL) with the FSDP training engine; writes RUN_DIR/hf, an HF "
        "model directory that `hybridflow train` starts from with model.path."))
    parser.add_argument("config", help="SFT YAML (e.g. examples/sft_arithmetic.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.total_steps=50")
    parser.add_argument("--no-progress", action="store_true", help="no per-step log lines")
    args = parser.parse_args(argv)

    def run() -> tuple[SFTTrainer, Path]:
        trainer = SFTTrainer(load_sft_config(args.config, args.overrides), progress=not args.no_progress)
        return trainer, fit_and_close(trainer)

    code, result = run_guarded("hybridflow sft", run, interrupted="interrupted; no model was written")
    if result is None:
        return code
    trainer, target = result
    history = trainer.history
    print(f"done: {len(history)} SFT steps; train/loss {history[0]['train/loss']:.3f} → "
          f"{history[-1]['train/loss']:.3f}; HF model in {target}")
    for line in validation_lines(trainer.validation_history,
                                 lambda k: k == "val/loss" or k.startswith("val-core/"), digits=3):
        print(line)
    return 0
