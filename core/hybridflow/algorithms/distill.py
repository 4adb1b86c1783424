"""On-policy distillation (Agarwal et al. 2024, GKD at λ = 1 with the reverse KL; Thinking Machines 2025; verl's
``distillation`` with ``loss_mode: k1``, ``use_policy_gradient: true``): the student (the actor) samples, a teacher
(any HF causal LM sharing the student's tokenizer) scores every sampled token, and each token's advantage is
``distillation_loss_coef · (log π_teacher − log π_student)``: the policy gradient lowers the student's per-token
reverse KL to the teacher on its own samples. With ``use_task_rewards`` GRPO's advantage of the task reward is added.

Config (docs/guide/distillation.md)::

    algorithm: {name: on_policy_distill, extra: {distillation_loss_coef: 1.0, use_task_rewards: false}}
    roles: {teacher: {model: {path: runs/grpo-arithmetic/hf}, pool: main}}

The teacher is the reference's worker and engine loaded from ``roles.teacher.model`` (colocated on the actor's pool
or on its own ``resource_pools`` entry); it is frozen, so training keys in ``roles.teacher`` are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.algorithms.advantages import compute_distillation_advantages, compute_grpo_advantages, masked_mean
from hybridflow.algorithms.helpers import mean_over_ranks
from hybridflow.algorithms.roles import RoleDeclaration, Stateful, policy_roles, teacher_role
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch
from hybridflow.errors import ConfigError

__all__ = ["OnPolicyDistill", "DistillationOptions", "distillation_metrics", "check_teacher_tokenizer"]

#: ``roles.teacher`` keys a frozen teacher never reads (a RoleSection accepts them for trained third-party roles)
_TRAINING_KEYS = ("optim", "mini_batch_size", "ppo_epochs", "loss_agg", "loss_scale_factor", "gradient_checkpointing",
                  "value_clip")


@dataclass(frozen=True, slots=True)
class DistillationOptions:
    """``algorithm.extra`` of ``on_policy_distill`` (verl's ``distillation.distillation_loss`` names)."""

    #: the weight of the reverse-KL advantage (verl's ``distillation_loss_coef``)
    distillation_loss_coef: float = 1.0
    #: add GRPO's advantage of ``reward`` (the task reward) to the distillation advantage (verl's ``use_task_rewards``)
    use_task_rewards: bool = False

    @classmethod
    def from_config(cls, config: Any) -> DistillationOptions:
        extra = dict(config.algorithm.extra)
        coef = extra.get("distillation_loss_coef", 1.0)
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not coef > 0:
            raise ConfigError(f"algorithm.extra.distillation_loss_coef must be a number > 0 (the weight of the "
                              f"reverse-KL advantage), got {coef!r}. Fix: set e.g. 1.0")
        task = extra.get("use_task_rewards", False)
        if not isinstance(task, bool):
            raise ConfigError(f"algorithm.extra.use_task_rewards must be true or false, got {task!r}")
        if task and config.rollout.n < 2:
            raise ConfigError(f"algorithm.extra.use_task_rewards adds GRPO's advantage of the task reward, which "
                              f"needs several samples per prompt; rollout.n is {config.rollout.n}. Fix: set "
                              "rollout.n to 2 or more, or use_task_rewards: false")
        return cls(distillation_loss_coef=float(coef), use_task_rewards=task)


def _tokenizer(model: Any, key: str) -> Any:
    """The tokenizer saved with ``model.path``, else the presets' character tokenizer (as the trainer builds it)."""
    if model.path is None:
        from hybridflow.char_tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    from hybridflow.model_dir import load_tokenizer

    try:
        return load_tokenizer(str(model.path))
    except (OSError, ValueError) as exc:  # transformers raises either for a directory without a tokenizer
        raise ConfigError(f"{key} {str(model.path)!r}: no tokenizer could be loaded from it ({exc}); expected a "
                          "Hugging Face model directory with its tokenizer. Fix: point it at one") from exc


def check_teacher_tokenizer(config: Any, section: str = "roles.teacher") -> None:
    """Refuse a teacher whose tokenizer differs from the student's: it scores the student's token ids, so both must
    map every id to the same token (same vocabulary, same special tokens)."""
    teacher_model = config.roles["teacher"].model
    student = _tokenizer(config.role_model(config.actor), "model.path")
    teacher = _tokenizer(teacher_model, f"{section}.model.path")
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    differing = sorted(token for token in set(student_vocab) | set(teacher_vocab)
                       if student_vocab.get(token) != teacher_vocab.get(token))
    specials = {name: (getattr(student, name), getattr(teacher, name))
                for name in ("pad_token_id", "bos_token_id", "eos_token_id")
                if getattr(student, name) != getattr(teacher, name)}
    if differing or specials:
        where = teacher_model.path or teacher_model.preset or "model.config"
        detail = (f"{len(differing)} of {len(student_vocab)} / {len(teacher_vocab)} tokens have other ids "
                  f"(e.g. {differing[:5]})" if differing else f"special token ids differ {specials}")
        raise ConfigError(f"{section}.model ({where}) has a tokenizer other than the student's "
                          f"({config.role_model(config.actor).path or 'the preset char tokenizer'}): {detail}. "
                          "On-policy distillation scores the student's token ids with the teacher, so both must "
                          "share one tokenizer. Fix: pick a teacher trained with the student's tokenizer (same "
                          "model family), or a student built on the teacher's")


def distillation_metrics(batch: Batch) -> dict[str, float]:
    """``distill/reverse_kl``: the mean over response tokens of log π_student − log π_teacher (the k1 estimate of
    KL(π_student ‖ π_teacher) per token, on the student's samples); ``distill/reverse_kl_seq``: its sum per response,
    averaged; ``distill/teacher_log_prob`` and ``distill/student_log_prob``: the mean log-prob of the sampled
    tokens under each."""
    mask = batch["response_mask"].float()
    gap = batch["old_log_probs"].float() - batch["teacher_log_probs"].float()
    return {
        "distill/reverse_kl": float(masked_mean(gap, mask)),
        "distill/reverse_kl_seq": float(torch.where(mask > 0, gap, torch.zeros_like(gap)).sum(-1).mean()),
        "distill/teacher_log_prob": float(masked_mean(batch["teacher_log_probs"].float(), mask)),
        "distill/student_log_prob": float(masked_mean(batch["old_log_probs"].float(), mask)),
    }


class OnPolicyDistill:
    name = "on_policy_distill"
    extra_keys: tuple[str, ...] = ("distillation_loss_coef", "use_task_rewards")

    def roles(self, config: Any) -> list[RoleDeclaration]:
        DistillationOptions.from_config(config)
        teacher = config.roles.get("teacher")
        if teacher is None or teacher.model is None:
            raise ConfigError("algorithm on_policy_distill needs a teacher: set roles.teacher.model.path (an HF "
                              "causal LM directory sharing the student's tokenizer; a preset or config also works)")
        trained = sorted(set(teacher.model_fields_set) & set(_TRAINING_KEYS))
        if trained:
            raise ConfigError(f"roles.teacher.{trained[0]} does nothing: the teacher is frozen (forward passes "
                              f"only). Fix: remove roles.teacher.{{{', '.join(trained)}}}")
        if config.algorithm.kl_coef > 0:
            raise ConfigError(f"algorithm.kl_coef = {config.algorithm.kl_coef} (a KL-to-reference penalty in the "
                              "reward) is not read by on_policy_distill, whose advantage is the KL to the teacher. "
                              "Fix: remove it (actor.kl_loss_coef adds a KL-to-reference loss term)")
        check_teacher_tokenizer(config)
        return [*policy_roles(config, kl_in_reward=False), teacher_role()]

    def build_state(self, config: Any) -> dict[str, Stateful]:
        return {}

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        options = DistillationOptions.from_config(rt.config)
        batch = rt.rollout(prompts)  # the student samples; π_old, π_ref (with a KL loss) and the task reward
        batch["teacher_log_probs"] = rt.gather(rt.teacher.compute_ref_log_probs(batch))["ref_log_probs"]
        mask = batch["response_mask"]
        task = compute_grpo_advantages(rt.outcome_scores(batch), rt.config.rollout.n, mask,
                                       normalize_std=rt.config.algorithm.norm_adv_by_std) \
            if options.use_task_rewards else None
        batch["advantages"] = compute_distillation_advantages(
            batch["teacher_log_probs"], batch["old_log_probs"], mask, coef=options.distillation_loss_coef,
            task_advantages=task)
        actor_metrics = mean_over_ranks(rt.actor.update_policy(batch))
        return {**rt.summarize(batch), **distillation_metrics(batch), **actor_metrics}
