"""The run configuration's cluster and model-role sections: Ray, resource pools, models, parallel sizes, optimizers
and the actor / critic / reference / ``roles.<key>`` sections, each refusing the keys it does not read.

The sections of what the run does (rollout, reward, algorithm, data, trainer) and the whole :class:`Config` are
:mod:`hybridflow.config`'s, which re-exports every name here.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["RayConfig", "PoolConfig", "ModelConfig", "ParallelSection", "OptimSection", "LoraSection",
           "RouterReplaySection", "ActorConfig",
           "CriticConfig", "RoleSection", "ReferenceConfig", "PathList", "OneOrMany"]

_Item = TypeVar("_Item")


def _one_or_many(value: Any) -> Any:
    """A single value where a list is expected is the one-element list (verl takes either)."""
    return [value] if isinstance(value, str) else value


def _one_or_many_paths(value: Any) -> Any:
    """File paths: a single path or a list of them (as verl's ``data.train_files``), each with ``~`` expanded."""
    value = _one_or_many(value)
    if not isinstance(value, list):
        raise PydanticCustomError("path_list", "expected a file path or a list of file paths (e.g. "
                                  "~/data/gsm8k/train.parquet or [a.parquet, b.jsonl])")
    return [os.path.expanduser(item) if isinstance(item, str) else item for item in value]


#: a list that also takes one string as the one-element list (``trainer.loggers=wandb``)
OneOrMany = Annotated[list[_Item], BeforeValidator(_one_or_many)]
#: file paths: one path or a list, ``~`` expanded (``data.train_files=~/data/gsm8k/train.parquet``)
PathList = Annotated[list[str], BeforeValidator(_one_or_many_paths)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    #: keys this section refuses with the reason and the fix (keys other sections have, or that were removed)
    rejected_keys: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _reject_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, reason in cls.rejected_keys.items():
                if key in data:
                    raise PydanticCustomError("rejected_key", "{reason}", {"key": key, "reason": reason})
        return data


class RayConfig(_Section):
    address: str | None = None
    num_cpus: int | None = Field(default=None, gt=0)
    object_store_memory: int = Field(default=400_000_000, ge=78_643_200)
    allow_remote_without_auth: bool = False

    @model_validator(mode="after")
    def _sizes_only_for_a_local_ray(self) -> RayConfig:
        if self.address is not None and self.num_cpus is not None:
            raise ValueError(f"ray.num_cpus={self.num_cpus} sizes a local Ray, but ray.address={self.address!r} joins "
                             "a cluster whose resources are fixed; drop ray.num_cpus (or ray.address)")
        return self


class PoolConfig(_Section):
    devices_per_node: list[int] = Field(min_length=1)
    device: Literal["cpu", "cuda"] = "cpu"
    cpus_per_worker: float = Field(default=0.5, gt=0)
    #: seconds to wait for Ray to reserve the pool's bundles, at start and at each restart after a lost worker or
    #: node; raise it where an autoscaler (KubeRay) replaces a lost node
    ready_timeout_s: float = Field(default=60.0, gt=0)

    @model_validator(mode="after")
    def _positive_counts(self) -> PoolConfig:
        if any(n <= 0 for n in self.devices_per_node):
            raise ValueError(f"devices_per_node entries must be > 0, got {self.devices_per_node}")
        return self

    @property
    def world_size(self) -> int:
        return sum(self.devices_per_node)


class ModelConfig(_Section):
    path: str | None = None
    config: dict[str, Any] | None = None
    preset: Literal["tiny-qwen2", "tiny-qwen2-h16", "tiny-llama", "tiny-qwen2-4h"] | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        given = [k for k in ("path", "config", "preset") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of path, config, preset (got {given or 'none'})")
        return self


class ParallelSection(_Section):
    tensor_parallel_size: int = Field(default=1, gt=0)
    pipeline_parallel_size: int = Field(default=1, gt=0)
    data_parallel_size: int = Field(default=0, ge=0)


class OptimSection(_Section):
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    grad_clip: float = Field(default=1.0, ge=0)


class _ModelRole(_Section):
    """What every model-holding role has: engine, pool, model, parallel sizes, micro-batches, precision, extra."""

    engine: str = "fsdp"
    pool: str = "main"
    model: ModelConfig | None = None
    parallel: ParallelSection = ParallelSection()
    micro_batch_size: int = Field(default=64, gt=0)
    # padding removal (fsdp engine): a micro-batch's rows packed into one sequence, attention per row
    # (docs/guide/fsdp.md)
    use_remove_padding: bool = True
    # micro-batches cut by this many tokens per forward (rows' attention-mask counts), replacing micro_batch_size
    max_tokens_per_micro_batch: int | None = Field(default=None, gt=0)
    # bf16 compute with fp32 master weights and reduction; auto: bf16 where it pays (hybridflow.precision)
    mixed_precision: Literal["auto", "none", "bf16"] = "auto"
    extra: dict[str, Any] = Field(default_factory=dict)  # engine-specific options, passed through unchanged
    # worker method → transfer protocol replacing the one it declares (e.g. generate: my_protocol);
    # docs/design/controller.md
    protocols: dict[str, str] = Field(default_factory=dict)


class _TrainedRole(_ModelRole):
    """A role with an optimizer (actor, critic): mini-batches, epochs, loss aggregation, activation checkpointing."""

    optim: OptimSection = OptimSection()
    mini_batch_size: int | None = Field(default=None, gt=0)
    ppo_epochs: int = Field(default=1, gt=0)
    # verl's loss_agg_mode; seq-mean-token-sum-norm is Dr. GRPO's: Σ_rows(token sum) / (rows · loss_scale_factor)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean")
    # seq-mean-token-sum-norm's constant divisor (verl's loss_scale_factor); unset: the longest response the rollout
    # may produce (rollout.max_new_tokens, + rollout.multi_turn.max_tokens with multi-turn)
    loss_scale_factor: float | None = Field(default=None, gt=0)
    gradient_checkpointing: bool = False  # recompute activations in backward (HF gradient_checkpointing_enable)

    @model_validator(mode="after")
    def _scale_factor_needs_sum_norm(self) -> _TrainedRole:
        if self.loss_scale_factor is not None and self.loss_agg != "seq-mean-token-sum-norm":
            raise ValueError(f"loss_scale_factor = {self.loss_scale_factor} is the constant divisor of loss_agg "
                             f"seq-mean-token-sum-norm, but loss_agg is {self.loss_agg} (which divides by a count); "
                             "the key would do nothing. Fix: set loss_agg: seq-mean-token-sum-norm, or remove "
                             "loss_scale_factor")
        return self


_DECIDED_BY_ALGORITHM = {
    "critic": ("does nothing: whether a critic runs follows from algorithm.name (ppo and safe_rlhf "
               "train one; grpo, rloo, remax, reinforce_pp do not). Fix: remove critic.enabled, or choose the "
               "algorithm"),
    "reference": ("does nothing: a reference runs when the algorithm uses a KL term "
                  "(actor.kl_loss_coef > 0, or algorithm.kl_coef > 0 for the algorithms that put KL in the "
                  "reward). Fix: remove reference.enabled and set those coefficients instead"),
}


def _actor_only(key: str, instead: str = "") -> str:
    return (f"{key} is an actor (policy-loss) key; the critic trains on a value loss and never reads it. Fix: set "
            f"actor.{key}{instead}, and remove critic.{key}")


class LoraSection(_Section):
    """``actor.lora``: train low-rank adapters on the actor's linear layers instead of every weight
    (docs/guide/fsdp.md)."""

    rank: int  # the adapters' inner dimension r (required: there is no LoRA without it)
    alpha: float = Field(default=16.0, gt=0)  # the adapters' product is scaled by alpha / rank
    dropout: float = Field(default=0.0, ge=0, lt=1)  # on the adapters' input, in training
    target_modules: list[str] | Literal["all-linear"] = "all-linear"  # module names (q_proj, ...) or every linear

    @model_validator(mode="after")
    def _positive_rank(self) -> LoraSection:
        if self.rank <= 0:
            raise ValueError(f"lora.rank = {self.rank}: the adapters' inner dimension must be a positive integer. "
                             "Fix: set actor.lora.rank to e.g. 8 (or remove actor.lora to train every weight)")
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("lora.target_modules is empty: it must name at least one module. Fix: list module "
                             'names (e.g. [q_proj, v_proj]) or set "all-linear"')
        return self


class RouterReplaySection(_Section):
    """``actor.router_replay`` (verl's section): rollout routing replay for mixture-of-experts actors
    (docs/guide/moe.md)."""

    # disabled: the training forward routes with its own router (the flips are measured: actor/router_flip_ratio);
    # R3: it replays the experts the rollout engine recorded per token and MoE layer (verl's R2 is not built)
    mode: Literal["disabled", "R3"] = "disabled"


class ActorConfig(_TrainedRole):
    lora: LoraSection | None = None  # LoRA adapters (fsdp engine); None: full fine-tuning
    router_replay: RouterReplaySection = RouterReplaySection()  # MoE actors: replay the rollout's routing (R3)
    # MoE actors: the router's load-balancing loss (Megatron's moe_aux_loss_coeff), summed over MoE layers, joins the
    # actor loss; 0: off, still measured (actor/moe/load_balancing_loss)
    router_aux_loss_coef: float = Field(default=0.0, ge=0)
    # MoE actors: the router's z-loss (Megatron's moe_z_loss_coeff), summed over MoE layers; 0: off (actor/moe/z_loss)
    router_z_loss_coef: float = Field(default=0.0, ge=0)
    # the policy loss (verl's policy_loss.loss_mode): vanilla (PPO's clipped surrogate), gspo or cispo
    loss_mode: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    clip_ratio_low: float = Field(default=0.2, ge=0)
    clip_ratio_high: float = Field(default=0.2, ge=0)
    # the dual clip (verl's clip_ratio_c; verl defaults to 3.0): a token with A < 0 loses at most c·|A|; unset: off
    clip_ratio_c: float | None = Field(default=None, gt=1)
    entropy_coef: float = 0.0  # the entropy bonus's coefficient (its starting value with entropy_target)
    # adaptive entropy control (Skywork-OR1): steer the coefficient each step by ± entropy_coef_delta so the mean
    # token entropy (actor/entropy) stays near this target; the bonus is off while the entropy is above it
    entropy_target: float | None = Field(default=None, gt=0)
    entropy_coef_delta: float = Field(default=0.001, gt=0)
    entropy_coef_min: float = Field(default=0.0, ge=0)  # a floor, applied above the target too (a fixed part)
    entropy_coef_max: float | None = Field(default=None, ge=0)
    kl_loss_coef: float = Field(default=0.0, ge=0)
    kl_loss_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    recompute_log_probs: bool = True

    @model_validator(mode="after")
    def _adaptive_entropy(self) -> ActorConfig:
        if self.entropy_target is None:
            # by value, not by the keys given: a dumped config (manifest.json) spells every default out
            fields = type(self).model_fields
            adaptive = [key for key in ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
                        if getattr(self, key) != fields[key].default]
            if adaptive:
                raise ValueError(f"actor.{adaptive[0]} steers the entropy coefficient toward actor.entropy_target, "
                                 "which is not set (the coefficient is fixed at actor.entropy_coef). Fix: set "
                                 f"actor.entropy_target (e.g. 0.1), or remove actor.{adaptive[0]}")
        elif self.entropy_coef < self.entropy_coef_min:
            raise ValueError(f"actor.entropy_coef = {self.entropy_coef}: with actor.entropy_target it is the starting "
                             "value of the entropy bonus and must be ≥ actor.entropy_coef_min "
                             f"({self.entropy_coef_min}) and ≥ 0. Fix: raise it to at least the floor")
        return self

    @model_validator(mode="after")
    def _policy_loss(self) -> ActorConfig:
        mode = self.loss_mode
        if self.clip_ratio_c is not None and mode != "vanilla":
            raise ValueError(f"actor.clip_ratio_c = {self.clip_ratio_c} is the dual clip of PPO's clipped surrogate "
                             f"(actor.loss_mode: vanilla); loss_mode {mode} has none, so the key would do nothing. "
                             "Fix: remove actor.clip_ratio_c, or set actor.loss_mode: vanilla")
        if mode == "gspo" and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(f"actor.loss_mode gspo averages each response's tokens, then the responses (its "
                             f"sequence-level objective, as verl's gspo), but actor.loss_agg is {self.loss_agg}. Fix: "
                             "set actor.loss_agg: seq-mean-token-mean (and clip ratios of GSPO's size, e.g. "
                             "clip_ratio_low: 3e-4, clip_ratio_high: 4e-4)")
        if mode != "cispo" and self.clip_ratio_low >= 1:
            raise ValueError(f"actor.clip_ratio_low = {self.clip_ratio_low}: loss_mode {mode} clips the ratio to "
                             "[1 − clip_ratio_low, 1 + clip_ratio_high], so it must be < 1 (only cispo, whose clip "
                             "bounds a weight, takes ≥ 1: no lower bound). Fix: set it below 1, e.g. 0.2")
        return self


class CriticConfig(_TrainedRole):
    """The critic's own keys: no policy-loss keys (those are the actor's)."""

    rejected_keys: ClassVar[dict[str, str]] = {
        "enabled": _DECIDED_BY_ALGORITHM["critic"],
        "clip_ratio_low": _actor_only("clip_ratio_low", " (critic.value_clip clips the value loss)"),
        "clip_ratio_high": _actor_only("clip_ratio_high", " (critic.value_clip clips the value loss)"),
        "clip_ratio_c": _actor_only("clip_ratio_c", " (critic.value_clip clips the value loss)"),
        "loss_mode": _actor_only("loss_mode"),
        **{key: _actor_only(key) for key in ("entropy_coef", "entropy_target", "entropy_coef_delta",
                                             "entropy_coef_min", "entropy_coef_max")},
        "kl_loss_coef": _actor_only("kl_loss_coef"),
        "kl_loss_kind": _actor_only("kl_loss_kind"),
        "recompute_log_probs": _actor_only("recompute_log_probs"),
    }
    value_clip: float = Field(default=0.2, ge=0)


class RoleSection(CriticConfig):
    """A role an algorithm declares beyond the built-in sections, configured under ``roles.<key>`` (the algorithm's
    docs name the key); its engine reads the keys its kind needs (a reward model: engine, pool, model, parallel)."""


_NOT_TRAINED = ("the reference is frozen (forward passes only, no optimizer or backward pass), so {key} has nothing "
                "to act on. Fix: remove reference.{key} (set it on actor or critic)")


class ReferenceConfig(_ModelRole):
    """The frozen reference policy: a model, where it runs, and how it computes (no training keys)."""

    rejected_keys: ClassVar[dict[str, str]] = {
        "enabled": _DECIDED_BY_ALGORITHM["reference"],
        **{key: _NOT_TRAINED.format(key=key) for key in (
            "optim", "mini_batch_size", "ppo_epochs", "loss_agg", "gradient_checkpointing", "clip_ratio_low",
            "clip_ratio_high", "entropy_coef", "entropy_target", "entropy_coef_delta", "entropy_coef_min",
            "entropy_coef_max",
            "kl_loss_coef", "kl_loss_kind", "recompute_log_probs", "loss_mode", "clip_ratio_c", "loss_scale_factor")},
    }
