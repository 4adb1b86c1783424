"""Validation during training: the actor answers held-out prompts greedily (and ``trainer.val_n`` times sampled),
the reward scores them, and the metrics are named as verl names them (``val-core/<data_source>/acc/mean@1``).

It generates through the actor's own ``generate`` with explicit per-call seeds, so the training run's random
streams and policy version are untouched; when it runs is the trainer loop's business.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config import Config
from hybridflow.data import PromptDataset, load_rows
from hybridflow.errors import ConfigError

__all__ = ["VALIDATION_ITERATION", "Validation", "build_validation", "expected_best_of", "summarize_validation"]

#: ``iteration`` meta of validation prompts: beyond any training iteration, so its sampling seeds
#: (``seed + 1000 * iteration + rank``) never repeat a training step's (and stay below 2**31 for runs of up to a
#: million steps, for engines that keep 32-bit seeds), and no fault spec matches it
VALIDATION_ITERATION = 1_000_000
#: a response scoring at least this is counted as correct in ``acc`` (exact match for the shipped arithmetic
#: reward and for verl's GSM8K-style rule rewards, which give 1.0 for the right answer)
CORRECT_SCORE = 1.0


def expected_best_of(values: Sequence[float], k: int) -> float:
    """E[max of k values drawn without replacement from ``values``]: the unbiased best-of-k estimate (for 0/1
    values, the unbiased pass@k of Chen et al. 2021: 1 − C(n−c, k)/C(n, k))."""
    n = len(values)
    if not 1 <= k <= n:
        raise ValueError(f"best-of-{k} needs 1 ≤ k ≤ {n} (the samples per prompt)")
    ordered = sorted(values)
    total = math.comb(n, k)
    return sum(ordered[i] * math.comb(i, k - 1) for i in range(k - 1, n)) / total


def _sample_sizes(n: int) -> list[int]:
    """verl's k for best@k: powers of two below n, then n."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def summarize_validation(data_sources: Sequence[str], uids: Sequence[str], scores: Sequence[float], *,
                         greedy: bool) -> dict[str, float]:
    """verl-named metrics of one validation pass, per data source: ``acc`` (score ≥ 1, exact match) and ``reward``.

    Greedy: ``mean@1``. Sampled (rows sharing a uid are one prompt's samples, n of them): ``mean@n``,
    ``best@k/mean`` (unbiased expected best of k) and, for ``acc``, ``pass@k`` (the same estimate: unbiased pass@k)
    for k = 2, 4, …, n. ``val-core/`` holds the acc headline numbers (greedy mean@1, and mean@n, best@n, pass@n),
    ``val-aux/`` the rest, as verl splits them."""
    grouped: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for source, uid, score in zip(data_sources, uids, scores, strict=True):
        grouped[source][uid].append(float(score))
    metrics: dict[str, float] = {}
    for source, prompts in grouped.items():
        counts = {len(values) for values in prompts.values()}
        if len(counts) != 1:
            raise ValueError(f"validation prompts of {source} have unequal sample counts {sorted(counts)}")
        n = counts.pop()
        if greedy and n != 1:
            raise ValueError(f"a greedy validation pass has one response per prompt, got {n}")
        for variable in ("acc", "reward"):
            per_prompt = [[float(v >= CORRECT_SCORE) for v in values] if variable == "acc" else values
                          for values in prompts.values()]

            def put(name: str, value: float, core: bool, variable: str = variable, source: str = source) -> None:
                section = "val-core" if core and variable == "acc" else "val-aux"
                metrics[f"{section}/{source}/{variable}/{name}"] = value

            put(f"mean@{n}", sum(sum(v) / n for v in per_prompt) / len(per_prompt), core=True)
            if greedy:
                continue
            for k in _sample_sizes(n):
                best = sum(expected_best_of(v, k) for v in per_prompt) / len(per_prompt)
                put(f"best@{k}/mean", best, core=k == n)
                if variable == "acc":
                    put(f"pass@{k}", best, core=k == n)
    return metrics


@dataclass(slots=True)
class Validation:
    """The validation prompts and schedule of a run (``trainer.val_every`` > 0). Stability: experimental."""

    dataset: PromptDataset
    every: int
    samples: int          # trainer.val_n: sampled responses per prompt (1: greedy only)
    rollout_n: int        # the actor's samples per generate call (rollout.n)
    chunk_rows: int       # prompts per generate call (data.batch_size)
    world_size: int       # actor ranks: a call's rows are padded to a multiple of it

    def due(self, step: int, total_steps: int) -> bool:
        """Whether to validate the weights at policy version ``step`` (before training, every ``every`` updates
        and after the last)."""
        return self.every > 0 and (step % self.every == 0 or step == total_steps)

    def describe(self) -> dict[str, Any]:
        return {"prompts": self.dataset.prompt_texts, "ground_truths": self.dataset.ground_truths,
                "every": self.every, "samples": self.samples}

    def run(self, runtime: Any, step: int) -> dict[str, float]:
        """Validate the actor's current weights (policy version ``step``); returns the verl-named metrics."""
        metrics = summarize_validation(*self._generate(runtime, step, greedy=True), greedy=True)
        if self.samples > 1:
            metrics.update(summarize_validation(*self._generate(runtime, step, greedy=False), greedy=False))
        return metrics

    def _generate(self, runtime: Any, step: int, *, greedy: bool) -> tuple[list[str], list[str], list[float]]:
        sources: list[str] = []
        uids: list[str] = []
        scores: list[float] = []
        copies = 1 if greedy else self.samples // self.rollout_n
        per_prompt = 1 if greedy else self.rollout_n
        for start in range(0, len(self.dataset), self.chunk_rows):
            indices = list(range(start, min(start + self.chunk_rows, len(self.dataset))))
            prompts = self.dataset.batch(indices, uids=[f"val-{i}" for i in indices])
            if copies > 1:  # val_n = copies × rollout.n samples per prompt
                prompts = prompts.repeat_interleave(copies)
            rows = len(prompts)
            padding = -rows % self.world_size
            if padding:
                prompts = prompts.index(torch.cat([torch.arange(rows), torch.full((padding,), rows - 1)]))
            prompts = prompts.with_meta(iteration=VALIDATION_ITERATION + step, policy_version=step)
            generated = runtime.gather(runtime.actor.generate(prompts, greedy=True) if greedy
                                       else runtime.actor.generate(prompts))
            generated = generated.index(torch.arange(rows * per_prompt))  # padded rows' responses dropped
            scored = runtime.score(generated)
            sources.extend(scored["data_source"])
            uids.extend(scored["uid"])
            scores.extend(scored["scores"].tolist())
        return sources, uids, scores


def build_validation(config: Config, tokenizer: Any, held_out_rows: list[dict[str, Any]]) -> Validation | None:
    """The run's validation from ``data.val_files`` (or the task's held-out rows) and ``trainer.val_*``; None when
    there are no validation prompts. ConfigError for a schedule without prompts or a ``val_n`` it cannot honour."""
    data, trainer = config.data, config.trainer
    # trainer.val_every=0 is the one switch that turns validation off: trainer.val_n and the held-out prompts stay
    # configured for when it is turned back on (the held-out prompts are still kept out of training)
    rows: list[dict[str, Any]] = []
    for file in data.val_files:
        rows.extend(load_rows(file))
    if data.val_files and held_out_rows:
        raise ConfigError("both data.val_files and data.task.num_val_prompts are set; validate on one: drop "
                          "data.task.num_val_prompts (or the files)")
    rows = rows or held_out_rows
    if not rows:
        if trainer.val_every:
            raise ConfigError(f"trainer.val_every={trainer.val_every} but there are no validation prompts; set "
                              "data.val_files (parquet/jsonl, like data.train_files) or data.task.num_val_prompts")
        return None
    if trainer.val_n > 1 and trainer.val_n % config.rollout.n:
        raise ConfigError(f"trainer.val_n={trainer.val_n} must be a multiple of rollout.n={config.rollout.n} (the "
                          "actor samples rollout.n responses per prompt per call); e.g. trainer.val_n="
                          f"{config.rollout.n * max(1, round(trainer.val_n / config.rollout.n))}")
    source = ", ".join(data.val_files) if data.val_files else "the task's held-out prompts"
    from hybridflow.agent.worker import prompt_tool_schemas

    dataset = PromptDataset.from_rows(rows, tokenizer, max_prompt_length=data.max_prompt_length, source=source,
                                      tools=prompt_tool_schemas(config))
    world_size = config.resource_pools[config.actor.pool].world_size
    return Validation(dataset=dataset, every=trainer.val_every, samples=trainer.val_n, rollout_n=config.rollout.n,
                      chunk_rows=data.batch_size, world_size=world_size)
