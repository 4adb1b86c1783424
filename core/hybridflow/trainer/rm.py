"""Reward-model training (``hybridflow rm CONFIG``): a Bradley-Terry model on chosen/rejected pairs, written as the
Hugging Face sequence-classification directory (1 label, ``score`` head) that an RL run's reward model loads
(``reward.model.path``), as OpenRLHF's ``train_rm`` and TRL's ``RewardTrainer`` do.

The model starts from an SFT run's directory (``model.path``: the backbone is loaded and a fresh 1-output ``score``
head added, as the training engines build a reward model from a causal LM) or from a config/preset. Each side of a
pair is laid out as a rollout is (:mod:`hybridflow.trainer.rm_data`) and scored as the training engines'
``compute_scores`` scores a rollout: the ``score`` head at the last attended token (the response's EOS), so the
reward the RL run reads is the one trained here. Loss and metrics: :mod:`hybridflow.trainer.rm_loss`.

What it does not do: it trains in this one process on one device (``trainer.device``), without Ray workers,
sharding or data parallelism; a reward model too large for one device needs the FSDP engine to learn a pairwise loss
first. Stability: experimental.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.errors import ConfigError, DatasetError
from hybridflow.trainer.rm_config import RMConfig, load_rm_config
from hybridflow.trainer.rm_data import PairBatch, build_pair_batch, load_preference_pairs
from hybridflow.trainer.rm_loss import bradley_terry_loss, pairwise_metrics

__all__ = ["RMConfig", "RewardModelTrainer", "HF_DIR", "load_rm_config", "build_reward_model", "score_sequences",
           "write_dir_atomically", "main"]

#: the folder of the run directory that holds the reward model as an HF directory (``reward.model.path`` of RL)
HF_DIR = "hf"
#: pairs per forward at validation
_EVAL_CHUNK = 256


def build_reward_model(config: RMConfig, tokenizer: Any) -> torch.nn.Module:
    """``AutoModelForSequenceClassification`` with one label: from ``model.path`` (a causal-LM directory gets a
    fresh ``score`` head, initialised from ``trainer.seed``) or built from ``model.config`` / ``model.preset``."""
    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    transformers.utils.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # unannotated in transformers
    model = config.model
    if model.path is not None:
        hf_config = AutoConfig.from_pretrained(model.path)
    else:
        if model.config is not None:
            values = dict(model.config)
        else:
            from hybridflow.presets import preset_model_config

            assert model.preset is not None  # ModelConfig holds exactly one of path, config, preset
            values = preset_model_config(model.preset)
        model_type = values.pop("model_type", None)
        if not model_type:
            raise ConfigError(f"model.config needs a `model_type` key (e.g. \"qwen2\"); got keys {sorted(values)}")
        values.pop("torch_dtype", None)
        values.pop("architectures", None)
        hf_config = AutoConfig.for_model(model_type, **values)
    hf_config.num_labels = 1
    hf_config.classifier_dropout = 0.0
    if tokenizer.pad_token_id is not None:
        hf_config.pad_token_id = tokenizer.pad_token_id
    dtype = getattr(torch, model.dtype)
    torch.manual_seed(config.trainer.seed)
    if model.path is not None:
        built = AutoModelForSequenceClassification.from_pretrained(model.path, config=hf_config, dtype=dtype)
    else:
        built = AutoModelForSequenceClassification.from_config(  # type: ignore[no-untyped-call]  # untyped in HF
            hf_config, dtype=dtype)
    if getattr(built, "score", None) is None:
        raise ConfigError(f"{type(built).__name__} has no `score` head; the RL run's reward model reads one (the "
                          "Llama/Qwen2/Mistral families have it)")
    built.config.use_cache = False
    return built  # type: ignore[no-any-return]  # looked up by name in transformers


def _last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last attended position of each row (left-padded prompt + right-padded response)."""
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(-1).long().argmax(-1)


def score_sequences(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] rewards: the ``score`` head at each row's last attended token, positions counted from the first
    attended one (what the training engines' ``compute_scores`` returns for a rollout)."""
    from hybridflow.columns import compute_position_ids

    backbone = getattr(model, str(getattr(model, "base_model_prefix", "model")))
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=compute_position_ids(attention_mask), use_cache=False).last_hidden_state
    index = _last_token_index(attention_mask)
    last = hidden[torch.arange(hidden.shape[0], device=hidden.device), index]
    head: torch.nn.Module = model.score  # type: ignore[assignment]  # checked by build_reward_model
    return head(last)[:, 0].float()  # type: ignore[no-any-return]


def _lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warmup, then constant, cosine or
    linear decay to ``min_ratio`` (the training engines' schedule keys)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def write_dir_atomically(target: Path, write: Any) -> None:
    """``write(folder)`` into a fresh sibling folder, then swap it in: a reader of ``target`` sees the old directory
    or the complete new one, never a half-written one (a crash leaves ``target`` as it was)."""
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write(staging)
        for path in staging.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class RewardModelTrainer:
    """One RM run: ``RewardModelTrainer(config).fit()`` → the HF directory. Stability: experimental."""

    def __init__(self, config: RMConfig, *, progress: bool | None = None) -> None:
        from hybridflow.trainer.build import build_tokenizer

        self.config = config
        self.run_dir = Path(config.trainer.run_dir)
        self.tokenizer = build_tokenizer(config.model)
        data = config.data
        margin_key = data.margin_key if config.loss.use_margin else None

        def read(files: list[str]) -> PairBatch:
            pairs = load_preference_pairs(files, prompt_key=data.prompt_key, chosen_key=data.chosen_key,
                                          rejected_key=data.rejected_key, margin_key=margin_key)
            return build_pair_batch(pairs, self.tokenizer, max_prompt_length=data.max_prompt_length,
                                    max_response_length=data.max_response_length)

        self.train_pairs = read(data.train_files)
        self.val_pairs = read(data.val_files) if data.val_files else None
        if data.batch_size > len(self.train_pairs):
            raise DatasetError(f"data.batch_size={data.batch_size} is larger than the {len(self.train_pairs)} "
                               "training pairs; lower it or add pairs")
        if config.trainer.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("trainer.device is cuda but torch sees no CUDA device; set trainer.device=cpu")
        self.device = torch.device(config.trainer.device)
        self.model = build_reward_model(config, self.tokenizer).to(self.device)
        optim = config.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)
        self.show_progress = config.trainer.progress if progress is None else progress
        self.history: list[dict[str, float]] = []
        self.validation_history: list[dict[str, float]] = []

    # --- scoring --------------------------------------------------------------------------------------------
    def _scores(self, pairs: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards of the chosen and the rejected sides, in one forward over both."""
        ids = torch.cat([pairs.chosen["input_ids"], pairs.rejected["input_ids"]]).to(self.device)
        mask = torch.cat([pairs.chosen["attention_mask"], pairs.rejected["attention_mask"]]).to(self.device)
        scores = score_sequences(self.model, ids, mask)
        return scores[:len(pairs)], scores[len(pairs):]

    def _loss(self, chosen: torch.Tensor, rejected: torch.Tensor, pairs: PairBatch) -> torch.Tensor:
        return bradley_terry_loss(chosen, rejected, margin=pairs.margin if self.config.loss.use_margin else None,
                                  center_rewards_coefficient=self.config.loss.center_rewards_coefficient)

    @torch.no_grad()
    def evaluate(self, pairs: PairBatch) -> dict[str, float]:
        """``loss`` and :func:`pairwise_metrics` of ``pairs`` under the current weights."""
        self.model.eval()
        chosen, rejected = [], []
        for start in range(0, len(pairs), _EVAL_CHUNK):
            part = pairs.index(torch.arange(start, min(start + _EVAL_CHUNK, len(pairs))))
            scores = self._scores(part)
            chosen.append(scores[0].cpu())
            rejected.append(scores[1].cpu())
        chosen_all, rejected_all = torch.cat(chosen), torch.cat(rejected)
        loss = self._loss(chosen_all, rejected_all, pairs)
        return {"loss": float(loss), **pairwise_metrics(chosen_all, rejected_all)}

    def validate(self) -> dict[str, float]:
        """``val/loss``, ``val/accuracy`` (held-out pairs the model ranks right), ``val/margin``,
        ``val/chosen_reward``, ``val/rejected_reward``, ``val/reward_mean``, ``val/reward_std``."""
        if self.val_pairs is None:
            return {}
        started = time.perf_counter()
        metrics = {f"val/{key}": value for key, value in self.evaluate(self.val_pairs).items()}
        metrics["timing_s/testing"] = time.perf_counter() - started
        return metrics

    # --- the run --------------------------------------------------------------------------------------------
    def _batches(self) -> Any:
        """Endless seeded epoch-wise shuffled batches of ``data.batch_size`` pairs (a partial tail is skipped)."""
        rows, size = len(self.train_pairs), self.config.data.batch_size
        epoch = 0
        while True:
            order = list(range(rows))
            if self.config.data.shuffle:
                random.Random(self.config.trainer.seed * 1_000_003 + epoch).shuffle(order)
            for start in range(0, rows - size + 1, size):
                yield self.train_pairs.index(torch.tensor(order[start:start + size]))
            epoch += 1

    def train_step(self, pairs: PairBatch, step: int) -> dict[str, float]:
        """One optimizer step on ``pairs``; its ``train/...`` metrics (those of the weights before the step)."""
        optim = self.config.optim
        factor = _lr_factor(step, warmup=optim.warmup_steps, total=self.config.trainer.total_steps,
                            schedule=optim.schedule, min_ratio=optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = optim.lr * factor
        self.model.train()
        chosen, rejected = self._scores(pairs)
        loss = self._loss(chosen, rejected, pairs)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              optim.grad_clip if optim.grad_clip > 0 else float("inf"))
        if torch.isfinite(norm):
            self.optimizer.step()
        metrics = pairwise_metrics(chosen, rejected)
        return {"train/loss": float(loss.detach()), "train/accuracy": metrics["accuracy"],
                "train/margin": metrics["margin"], "train/chosen_reward": metrics["chosen_reward"],
                "train/rejected_reward": metrics["rejected_reward"], "train/lr": optim.lr * factor,
                "train/grad_norm": float(norm)}

    def fit(self) -> Path:
        """Train ``trainer.total_steps`` steps, validating before, every ``trainer.val_every`` steps and after;
        returns the HF directory written (``RUN_DIR/hf``, swapped in whole)."""
        from hybridflow.trainer.checkpoint import archive_previous_logs
        from hybridflow.trainer.progress import MetricsWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        archive_previous_logs(self.run_dir)
        total, every = self.config.trainer.total_steps, self.config.trainer.val_every
        loggers = ("jsonl", "tensorboard") if self.config.trainer.tensorboard else ("jsonl",)
        writer = MetricsWriter(self.run_dir, loggers=loggers, config=self.config.model_dump(mode="json"))
        started = time.perf_counter()
        try:
            self._validate_and_log(writer, 0)
            batches = self._batches()
            for step in range(1, total + 1):
                step_start = time.perf_counter()
                row = self.train_step(next(batches), step - 1)
                row["time/step_s"] = time.perf_counter() - step_start
                writer.write(step, row)
                self.history.append(row)
                if self.show_progress and (step % max(1, total // 10) == 0 or step == total):
                    print(f"rm step {step}/{total}  train/loss={row['train/loss']:.3f}  "
                          f"train/accuracy={row['train/accuracy']:.3f}", flush=True)
                if (every and step % every == 0) or step == total:
                    self._validate_and_log(writer, step)
            target = self.run_dir / HF_DIR
            self.save(target)
            (self.run_dir / "summary.json").write_text(json.dumps({
                "steps": total, "seconds": time.perf_counter() - started, "hf_dir": str(target),
                "last": self.history[-1] if self.history else {},
                "validation": self.validation_history}, indent=1))
        finally:
            writer.close()
        return target

    def save(self, target: Path) -> None:
        """The model and tokenizer as an HF directory at ``target``, written aside and swapped in whole."""
        def write(folder: Path) -> None:
            self.model.save_pretrained(folder)  # type: ignore[operator]  # an HF PreTrainedModel
            self.tokenizer.save_pretrained(folder)

        write_dir_atomically(target, write)

    def close(self) -> None:
        """Nothing to release: the run holds no workers (``fit_and_close`` calls it)."""

    def _validate_and_log(self, writer: Any, step: int) -> None:
        metrics = self.validate()
        if metrics:
            writer.write(step, metrics)
            self.validation_history.append({"step": float(step), **metrics})


# --- the command -------------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """``hybridflow rm CONFIG.yaml [dotted.key=value ...]``."""
    import argparse

    from hybridflow.trainer.cli import fit_and_close, run_guarded, validation_lines

    parser = argparse.ArgumentParser(prog="hybridflow rm", description=(
        "Reward-model training (Bradley-Terry on chosen/rejected pairs); writes RUN_DIR/hf, an HF "
        "sequence-classification directory that an RL run scores with through reward.model.path."))
    parser.add_argument("config", help="RM YAML (e.g. examples/rm_arithmetic.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.total_steps=50")
    parser.add_argument("--no-progress", action="store_true", help="no per-step log lines")
    args = parser.parse_args(argv)

    def run() -> tuple[RewardModelTrainer, Path]:
        trainer = RewardModelTrainer(load_rm_config(args.config, args.overrides), progress=not args.no_progress)
        return trainer, fit_and_close(trainer)

    code, result = run_guarded("hybridflow rm", run, interrupted="interrupted; no model was written")
    if result is None:
        return code
    trainer, target = result
    history = trainer.history
    print(f"done: {len(history)} RM steps; train/loss {history[0]['train/loss']:.3f} → "
          f"{history[-1]['train/loss']:.3f}; reward model in {target} (reward.model.path)")
    for line in validation_lines(trainer.validation_history,
                                 lambda k: k in ("val/loss", "val/accuracy"), digits=3):
        print(line)
    return 0
