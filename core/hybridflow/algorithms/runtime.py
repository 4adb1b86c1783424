"""What a driver's ``step`` gets: the :class:`Runtime` of role handles it calls, its state and driver-side helpers.

A driver is one ``step(runtime, prompts)`` function over role handles (``runtime.actor.generate(...)``) plus the
shared math; building groups, checkpoints and logging are the trainer's business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.agent.batch import summarize_agent_metrics
from hybridflow.algorithms.advantages import build_token_level_rewards, masked_mean, masked_sum
from hybridflow.algorithms.coefficients import ENTROPY_CONTROLLER
from hybridflow.algorithms.dynamic_sampling import fill_informative_groups
from hybridflow.algorithms.helpers import (
    decode_batch,
    fill_old_log_probs,
    mean_over_chunks_and_ranks,
    mean_over_ranks,
    split_prompt_chunks,
)
from hybridflow.algorithms.loss_terms import ENTROPY_COEF_KEY
from hybridflow.batch import Batch
from hybridflow.errors import ConfigError
from hybridflow.rewards import score_responses

__all__ = ["Runtime", "combine_chunk_reward_metrics", "summarize_verdicts", "compute_response_length_metrics",
           "compute_rollout_probs_diff", "compute_zero_advantage_metrics"]


#: reward metrics that count rows (summed over a streamed step's chunks; the others are means)
_COUNTS = frozenset({"reward/num_failed", "cost/num_failed", *(f"reward/genrm_{name}" for name in (
    "parse_failures", "timeouts", "prompts_too_long", "template_failures", "failed"))})


def summarize_verdicts(status: torch.Tensor) -> dict[str, float]:
    """A judging call's ``genrm_status`` column as metrics: ``reward/genrm_<kind>`` rows of each failure kind
    (:data:`hybridflow.workers.judge.STATUS_CODES`), ``reward/genrm_failed`` rows in all and
    ``reward/genrm_failed_ratio``."""
    from hybridflow.workers.judge import JUDGED, STATUS_CODES

    metrics = {f"reward/genrm_{name}": float((status == code).sum())
               for code, name in STATUS_CODES.items() if code != JUDGED}
    failed = float((status != JUDGED).sum())
    metrics["reward/genrm_failed"] = failed
    metrics["reward/genrm_failed_ratio"] = failed / max(len(status), 1)
    return metrics


def combine_chunk_reward_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """A streamed step's reward metrics from its chunks' (equal in rows): the mean of each per-batch metric, the
    sum of a count (a reward pool's ``reward/num_failed``)."""
    return {key: sum(part[key] for part in parts) / (1 if key in _COUNTS else len(parts)) for key in parts[0]}


@dataclass(slots=True)
class Runtime:
    """The handles of the roles an algorithm declared (``runtime.actor``, ``runtime.cost_critic``: attribute access
    by role name), its state (``runtime.state["lagrange"]``) and driver-side helpers."""

    config: Any
    tokenizer: Any
    roles: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    reward_fn: Any = None
    cost_fn: Any = None
    timeout_s: float = 900.0
    #: rows of each step's batch that :meth:`summarize` keeps readable in :attr:`samples` (``trainer.log_rollouts``)
    log_rollouts: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)
    #: the next prompts of the data loader, tagged for this iteration (``algorithm.filter_groups`` draws them)
    more_prompts: Callable[[], Batch] | None = None
    #: metrics of the step's rollout that :meth:`summarize` adds (dynamic sampling's ``train/num_gen_batches``)
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    #: chunks a step's rollout streams in (``trainer.stream_mini_batches``: :meth:`stream_update`); 1 = not streamed
    stream_chunks: int = 1

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            roles = object.__getattribute__(self, "roles")
        except AttributeError:
            raise AttributeError(name) from None
        if name in roles:
            return roles[name]
        raise AttributeError(f"no role {name!r} in this run; built roles: {sorted(roles)}. Declare it in the "
                             "algorithm's roles(config), or use runtime.roles.get(name) for a role that is optional")

    # --- algorithm state --------------------------------------------------------------------------------------
    def kl_coef(self) -> float:
        """β of the in-reward KL penalty: the ``kl_controller`` state's value, 0 without one."""
        controller = self.state.get("kl_controller")
        return float(controller.value) if controller is not None else 0.0

    # --- data ---------------------------------------------------------------------------------------------
    def gather(self, *parts: Any) -> Batch:
        """Fetch futures (or take batches) and union their columns; versions must agree."""
        batch: Batch | None = None
        for part in parts:
            if part is None:
                continue
            value = part.get(timeout=self.timeout_s) if hasattr(part, "get") and not isinstance(part, Batch) else part
            batch = value if batch is None else batch | value
        if batch is None:
            raise ValueError("gather() needs at least one batch or future")
        return batch

    def decode_responses(self, batch: Batch) -> list[str]:
        # plain lists first: iterating and masking tensors row by row costs more than the decoding itself
        rows, masks = batch["responses"].tolist(), batch["response_mask"].bool().tolist()
        kept = [[token for token, keep in zip(row, mask) if keep] for row, mask in zip(rows, masks)]
        return decode_batch(self.tokenizer, kept)

    def score(self, batch: Batch, *, key: str = "scores", cost: bool = False, model_scores: Any = None,
              verdicts: Any = None) -> Batch:
        """Add ``key`` [B]: the rule function on decoded responses, plus the reward (cost) model and, for the
        reward, the generative reward model's verdicts (``reward.genrm``) when configured.

        ``model_scores`` / ``verdicts``: the model's scores / the judge's verdicts already dispatched
        (:meth:`dispatch_scores`, :meth:`dispatch_verdicts`), else they are asked for now."""
        function = self.cost_fn if cost else self.reward_fn
        model = self.roles.get("cost_model" if cost else "reward_model")
        judge = None if cost else self.roles.get("genrm")
        if function is None and model is None and judge is None:
            raise ConfigError(f"no {'cost' if cost else 'reward'} configured: set {'cost' if cost else 'reward'}"
                              ".function (a registered name or module:function), .endpoint or .model"
                              f"{'' if cost else ' or .genrm'}")
        total = torch.zeros(len(batch))
        if function is not None:
            rule = score_responses(
                function, responses=self.decode_responses(batch), ground_truths=list(batch["ground_truth"]),
                data_sources=list(batch["data_source"]), name="cost" if cost else "reward",
                extra=list(batch["extra_info"]) if "extra_info" in batch else None)
            total += torch.tensor(rule.scores, dtype=torch.float32)
            batch.meta["reward_metrics"] = {**batch.meta.get("reward_metrics", {}), **rule.metrics}
        if model is not None:
            future = model_scores if model_scores is not None else model.compute_scores(batch)
            total += future.get(timeout=self.timeout_s)["costs" if cost else "scores"].float()
        if judge is not None:
            judged = (verdicts if verdicts is not None else judge.judge(batch)).get(timeout=self.timeout_s)
            total += judged["genrm_scores"].float()
            batch.meta["reward_metrics"] = {**batch.meta.get("reward_metrics", {}),
                                            **summarize_verdicts(judged["genrm_status"])}
        if not cost and "agent_rewards" in batch:  # rollout.agent: a reward the agent returned replaces the score
            returned = batch["agent_rewards"].float()
            total = torch.where(torch.isnan(returned), total, returned)
        batch[key] = total
        return batch

    def dispatch_scores(self, generated: Any, *, cost: bool = False) -> Any:
        """Dispatch the reward (cost) model on the rollout now, so it scores while the other roles do (its future,
        for :meth:`score`); None without such a model."""
        model = self.roles.get("cost_model" if cost else "reward_model")
        return None if model is None else model.compute_scores(generated)

    def dispatch_verdicts(self, generated: Any) -> Any:
        """Dispatch the generative reward model's judge on the rollout now, so it judges while the other roles
        compute (its future, for :meth:`score`); None without ``reward.genrm``."""
        judge = self.roles.get("genrm")
        return None if judge is None else judge.judge(generated)

    def token_rewards(self, batch: Batch, key: str = "scores") -> torch.Tensor:
        """``batch[key]`` on each row's last response token minus β·KL(π_old ‖ π_ref) on every token (β from
        :meth:`kl_coef`; no penalty without a reference): verl's ``use_kl_in_reward``."""
        return build_token_level_rewards(batch[key], batch["response_mask"], self.kl_rewards(batch), self.kl_coef())

    def outcome_scores(self, batch: Batch) -> torch.Tensor:
        """One score per row for outcome estimators (GRPO, RLOO, ReMax): the sum of :meth:`token_rewards`, i.e.
        the score minus β·Σ_t KL_t (kept as ``penalized_scores``); the scores themselves when no KL penalty is on."""
        if self.kl_coef() == 0 or "ref_log_probs" not in batch:
            return batch["scores"]  # type: ignore[no-any-return]
        batch["penalized_scores"] = masked_sum(self.token_rewards(batch), batch["response_mask"], dim=-1)
        return batch["penalized_scores"]  # type: ignore[no-any-return]

    def update_kl_controller(self, summary: dict[str, float], rows: int) -> None:
        """Adapt β to this step's measured KL (``kl/actor_ref``), when the algorithm keeps a KL controller."""
        controller = self.state.get("kl_controller")
        if controller is not None and "kl/actor_ref" in summary:
            controller.update(summary["kl/actor_ref"], rows)

    def kl_rewards(self, batch: Batch) -> torch.Tensor | None:
        """Per-token KL(π_old ‖ π_ref) for an in-reward penalty, or None without a reference."""
        if "ref_log_probs" not in batch:
            return None
        from hybridflow.algorithms.losses import kl_penalty

        return kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.config.algorithm.kl_kind,
                          response_mask=batch["response_mask"])

    def rollout(self, prompts: Batch, *, values: tuple[str, ...] = (), cost: bool = False) -> Batch:
        """Generate, then score the rollout: π_old (actor), π_ref (reference, when built), the values of the critic
        roles named in ``values`` and the reward (and with ``cost``, the cost) — all dispatched together, each group
        reading the rollout's shards directly, so roles on disjoint pools compute concurrently — then gathered.
        With ``algorithm.filter_groups.enable``, groups whose rewards are all equal are replaced by groups of more
        prompts (:mod:`hybridflow.algorithms.dynamic_sampling`)."""
        batch = self._rollout_once(prompts, values=values, cost=cost)
        spec = getattr(getattr(self.config, "algorithm", None), "filter_groups", None)
        if spec is None or not spec.enable:
            return batch
        if self.more_prompts is None:
            raise ConfigError("algorithm.filter_groups needs the trainer's data loader to draw more prompts; this "
                              "runtime has none (more_prompts). Fix: run it through hybridflow.trainer.Trainer")
        more = self.more_prompts
        batch, metrics = fill_informative_groups(
            batch, n=self.config.rollout.n, groups_wanted=len(prompts), metric=spec.metric,
            max_num_gen_batches=spec.max_num_gen_batches,
            generate_more=lambda: self._rollout_once(more(), values=values, cost=cost))
        self.rollout_metrics.update(metrics)
        return batch

    def stream_update(self, prompts: Batch, advantages: Callable[[Batch], None]) -> tuple[Batch, dict[str, float]]:
        """A streamed step (``trainer.stream_mini_batches``, docs/guide/async.md): for each chunk of ``prompts`` (whole
        prompt groups), the moment its rollout arrives: score it, set its advantages (``advantages(chunk)``: they
        must need nothing beyond the chunk's prompt groups) and dispatch the actor's update of it, while the rollout
        pool generates the next chunks (the final chunk's update moves the policy version). Returns the chunks'
        rollouts concatenated and the update's metrics
        (:func:`~hybridflow.algorithms.helpers.mean_over_chunks_and_ranks`).
        Without streaming (one chunk) it is :meth:`rollout`, ``advantages`` and ``actor.update_policy``."""
        if self.stream_chunks == 1:
            batch = self.rollout(prompts)
            advantages(batch)
            return batch, mean_over_ranks(self.actor.update_policy(batch))
        chunks = split_prompt_chunks(prompts, self.stream_chunks)
        scored: list[Batch] = []
        updates: list[Any] = []
        for index, chunk in enumerate(chunks):
            batch = self._rollout_once(chunk, values=(), cost=False)
            advantages(batch)
            updates.append(self.actor.update_policy_chunk.submit(batch, final=index == len(chunks) - 1))
            scored.append(batch)
        metrics = mean_over_chunks_and_ranks([update.get(timeout=self.timeout_s) for update in updates])
        batch = Batch.concat(scored)
        for key in ("chunk", "chunks"):
            batch.meta.pop(key, None)
        reward_metrics = [part.meta.get("reward_metrics", {}) for part in scored]
        if reward_metrics[0]:
            batch.meta["reward_metrics"] = combine_chunk_reward_metrics(reward_metrics)
        return batch, metrics

    def _rollout_once(self, prompts: Batch, *, values: tuple[str, ...], cost: bool) -> Batch:
        generated = self.actor.generate(prompts)
        old = self.old_log_probs(generated)
        reference = self.roles.get("reference")
        ref = reference.compute_ref_log_probs(generated) if reference is not None else None
        value_futures = [self.roles[critic].compute_values(generated) for critic in values]
        scores = self.dispatch_scores(generated)
        verdicts = self.dispatch_verdicts(generated)
        costs = self.dispatch_scores(generated, cost=True) if cost else None
        batch = self.score(fill_old_log_probs(self.gather(generated, old, ref, *value_futures)), model_scores=scores,
                           verdicts=verdicts)
        entropy = self.state.get(ENTROPY_CONTROLLER)
        if entropy is not None:  # the bonus coefficient of the update this batch feeds (actor.entropy_target)
            batch.meta[ENTROPY_COEF_KEY] = entropy.coefficient()
        return self.score(batch, key="costs", cost=True, model_scores=costs) if cost else batch

    def old_log_probs(self, generated: Any) -> Any:
        """The actor's log-probs of the sampled tokens (a future), or the rollout's own when recomputing is off."""
        if self.config.actor.recompute_log_probs:
            return self.actor.compute_log_probs(generated)
        return None

    # --- metrics ------------------------------------------------------------------------------------------
    def summarize(self, batch: Batch) -> dict[str, float]:
        """The step's metrics from its scored batch; also keeps :attr:`log_rollouts` readable samples of it."""
        if self.log_rollouts:
            self.samples = self.sample_rows(batch, self.log_rollouts)
        mask = batch["response_mask"].float()
        metrics = {
            "reward/mean": float(batch["scores"].mean()),
            "reward/max": float(batch["scores"].max()),
            "response/length_mean": float(mask.sum(-1).mean()),
            "tokens/prompt_and_response": float(batch["attention_mask"].sum()),
            "policy_version": float(batch.meta.get("policy_version") or 0),
        }
        max_new_tokens = getattr(getattr(self.config, "rollout", None), "max_new_tokens", None)
        metrics.update(compute_response_length_metrics(batch["response_mask"], max_new_tokens))
        metrics.update(batch.meta.get("reward_metrics", {}))  # a per-sample reward's extra keys
        metrics.update(self.rollout_metrics)  # dynamic sampling's (algorithm.filter_groups)
        metrics.update(summarize_agent_metrics(batch))  # num_turns/*, tool_call_counts/* of multi-turn rollouts
        if "rollout_log_probs" in batch and "old_log_probs" in batch:
            metrics.update(compute_rollout_probs_diff(batch["rollout_log_probs"], batch["old_log_probs"], mask))
        if "ref_log_probs" in batch and "old_log_probs" in batch:
            metrics["kl/actor_ref"] = float(masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask))
        if "kl_controller" in self.state:
            metrics["kl/coef"] = self.kl_coef()
        if "penalized_scores" in batch:
            metrics["reward/penalized_mean"] = float(batch["penalized_scores"].mean())
        if "advantages" in batch:
            advantages = batch["advantages"]
            mean = masked_mean(advantages, mask)
            metrics["advantages/mean"] = float(mean)
            metrics["advantages/std"] = float(masked_mean((advantages - mean) ** 2, mask).sqrt())
            if "uid" in batch:
                metrics.update(compute_zero_advantage_metrics(advantages, mask, list(batch["uid"])))
        return metrics

    def sample_rows(self, batch: Batch, count: int) -> list[dict[str, Any]]:
        """``count`` rows spread evenly over the batch (so over its prompt groups), decoded: prompt, response,
        reward, response length in tokens, data source, ground truth and, when computed, the mean advantage over
        the response tokens."""
        rows = len(batch)
        indices = sorted({index * rows // count for index in range(min(count, rows))})
        picked = batch.index(indices)
        responses = self.decode_responses(picked)
        lengths = picked["response_mask"].sum(-1).tolist()
        if "prompt_text" in picked:
            prompts = [str(text) for text in picked["prompt_text"]]
        else:  # left-padded prompt ids: the input ids before the response
            width = picked["input_ids"].shape[1] - picked["responses"].shape[1]
            ids, masks = picked["input_ids"][:, :width].tolist(), picked["attention_mask"][:, :width].bool().tolist()
            prompts = decode_batch(self.tokenizer, [[t for t, keep in zip(row, mask) if keep]
                                                    for row, mask in zip(ids, masks)])
        samples: list[dict[str, Any]] = []
        for position, index in enumerate(indices):
            sample: dict[str, Any] = {"prompt": prompts[position], "response": responses[position],
                                      "reward": float(picked["scores"][position]) if "scores" in picked else None,
                                      "length": int(lengths[position])}
            for column in ("data_source", "ground_truth", "uid"):
                if column in picked:
                    sample[column] = picked[column][position]
            if "advantages" in picked:
                advantages = picked["advantages"][position]
                if advantages.dim() == 0:
                    sample["advantage"] = float(advantages)
                else:
                    sample["advantage"] = float(masked_mean(advantages, picked["response_mask"][position].float()))
            sample["row"] = index
            samples.append(sample)
        return samples


def compute_response_length_metrics(response_mask: torch.Tensor, max_new_tokens: int | None) -> dict[str, float]:
    """verl's ``response_length/{mean,max,min,clip_ratio}``: tokens per response, and the share of responses that
    reached ``max_new_tokens`` (cut off by the limit; the responses' width when no limit is given)."""
    lengths = response_mask.float().sum(-1)
    limit = float(max_new_tokens if max_new_tokens is not None else response_mask.shape[-1])
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= limit).float().mean()),
    }


def compute_rollout_probs_diff(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                               response_mask: torch.Tensor) -> dict[str, float]:
    """verl's ``training/rollout_probs_diff_{mean,max}``: |π_rollout − π_old| per response token (probabilities of
    the sampled tokens: the rollout engine's own against the actor's recomputed ones), over valid tokens. Stale
    weights (an asynchronous rollout) or numerics that differ between the engines make it grow."""
    valid = response_mask.bool()
    diff = (rollout_log_probs.double().exp() - old_log_probs.double().exp()).abs()
    if not bool(valid.any()):
        return {"training/rollout_probs_diff_mean": 0.0, "training/rollout_probs_diff_max": 0.0}
    return {"training/rollout_probs_diff_mean": float(diff[valid].mean()),
            "training/rollout_probs_diff_max": float(diff[valid].max())}


def compute_zero_advantage_metrics(advantages: torch.Tensor, response_mask: torch.Tensor,
                                   uids: list[Any]) -> dict[str, float]:
    """How much of the batch carries no policy gradient: ``critic/advantages/zero_adv_ratio`` (share of responses
    whose advantage is 0 on every response token) and ``critic/zero_adv_group_ratio`` (share of prompt groups,
    rows sharing a ``uid``, in which every response has zero advantage: for GRPO/RLOO the groups whose rewards are
    all equal). A ratio near 1 on most steps means the policy has collapsed: nothing left to learn from."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
        response_mask = torch.ones_like(advantages)
    if len(uids) != advantages.shape[0]:
        raise ValueError(f"{len(uids)} uids for {advantages.shape[0]} rows of advantages; expected one per row")
    zero_rows = ((advantages.abs() <= 1e-8) | (response_mask == 0)).all(dim=-1).tolist()
    groups: dict[Any, bool] = {}
    for uid, zero in zip(uids, zero_rows):
        groups[uid] = groups.get(uid, True) and bool(zero)
    return {
        "critic/advantages/zero_adv_ratio": sum(zero_rows) / max(len(zero_rows), 1),
        "critic/zero_adv_group_ratio": sum(groups.values()) / max(len(groups), 1),
    }
