"""The run configuration: YAML plus dotted ``key=value`` overrides, validated with errors that name the key path.

It describes what to run (algorithm, data, models, engines by registry name, pools); the trainer builds it.
Engine names are checked against the registries after plugins load (:func:`check_registered_names`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from hybridflow.config_checks import check_async, check_generation_layout, check_pool_batches, check_registered_names
from hybridflow.config_env import EnvSection, check_env_conflicts
from hybridflow.config_genrm import GenRMRolloutSection, GenRMSection
from hybridflow.config_io import apply_overrides, explain_errors, read_yaml_mapping
from hybridflow.config_sections import (
    ActorConfig,
    CriticConfig,
    LoraSection,
    ModelConfig,
    OneOrMany,
    OptimSection,
    ParallelSection,
    PathList,
    PoolConfig,
    RayConfig,
    ReferenceConfig,
    RoleSection,
    _Section,
)
from hybridflow.errors import ConfigError

# the checks, the override parser and the cluster / model-role sections live in config_checks / config_io /
# config_sections; they are re-exported here, where callers have always imported them
__all__ = ["Config", "load_config", "apply_overrides", "read_yaml_mapping", "config_hash", "check_registered_names",
           "check_pool_batches", "RayConfig", "PoolConfig", "ModelConfig", "ParallelSection", "OptimSection",
           "LoraSection", "ActorConfig", "AgentSection", "CriticConfig", "RoleSection", "ReferenceConfig",
           "GenRMSection", "GenRMRolloutSection"]


class MultiTurnSection(_Section):
    """Multi-turn agentic rollouts (docs/guide/agent.md): the actor's generate runs the agent loop when ``enable``."""

    enable: bool = False
    max_turns: int = Field(default=4, gt=0)  # model turns per conversation
    max_tokens: int = Field(default=256, gt=0)  # response ids per conversation (model + tool turns): its width
    tools: list[str] = Field(default_factory=list)  # names in the tools registry (`hybridflow plugins`)
    tool_options: dict[str, dict[str, Any]] = Field(default_factory=dict)  # tool name → its factory's options
    tool_timeout_s: float = Field(default=5.0, gt=0)
    max_tool_calls_per_turn: int = Field(default=4, gt=0)
    max_batch_rows: int = Field(default=0, ge=0)  # conversations per generate call (0: all ready ones)
    # a simulated user, "package.module:factory" (hybridflow.agent.interaction); rows opt in with
    # extra_info.interaction_kwargs (verl's Interaction)
    interaction: str | None = None

    @model_validator(mode="after")
    def _options_name_tools(self) -> MultiTurnSection:
        unused = sorted(set(self.tool_options) - set(self.tools))
        if unused:
            raise PydanticCustomError("rejected_key", "{reason}", {"key": f"tool_options.{unused[0]}", "reason": (
                f"options for tool {unused[0]!r}, which is not in rollout.multi_turn.tools ({self.tools}); they "
                "would do nothing. Fix: add the tool to rollout.multi_turn.tools or remove its options")})
        return self


class AgentSection(_Section):
    """Agents as code (docs/guide/agents_as_code.md): each sample's rollout is a user's agent program that calls an
    OpenAI-compatible endpoint in front of the actor's rollout engine; the calls' tokens are what trains."""

    # the agent: "path/to/agent.py:function" or "package.module:function", called as
    # function(base_url=..., api_key=..., sample={...}) -> reward (a number) or None (reward.function scores)
    entry: str
    max_concurrency: int = Field(default=0, ge=0)  # agents running at once per worker (0: all of its samples)
    timeout_s: float = Field(default=60.0, gt=0)  # per agent, wall clock; past it the sample fails (scored 0)
    max_calls: int = Field(default=8, gt=0)  # requests per agent; further ones get HTTP 429 (call_budget_exhausted)
    max_tokens: int = Field(default=256, gt=0)  # response ids per sample (model + tool/user turns): its width
    host: str = "127.0.0.1"  # the endpoint's address (loopback: only this machine's processes reach it)
    port: int = Field(default=0, ge=0, le=65535)  # 0: a free port per worker


class RolloutConfig(_Section):
    engine: str = "hf"
    n: int = Field(default=4, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    max_new_tokens: int = Field(default=16, gt=0)
    tensor_parallel_size: int = Field(default=1, gt=0)
    # the generation weights' dtype (verl's rollout.dtype): auto = bfloat16 when the actor computes in bf16
    # (actor.mixed_precision=bf16), else the actor model's dtype
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # kept (= 1) so placement fragments validate; no rollout engine here generates pipeline-parallel
    pipeline_parallel_size: int = Field(default=1, gt=0)
    extra: dict[str, Any] = Field(default_factory=dict)
    multi_turn: MultiTurnSection = MultiTurnSection()
    # agents as code: an OpenAI-compatible endpoint per actor worker, a user's agent function per sample (None: off)
    agent: AgentSection | None = None
    # an environment served over reset/step (OpenEnv's shape): its observations are the turns, its rewards the score
    env: EnvSection | None = None
    # a pool of its own for generation (split rollout, docs/guide/async.md): None = the actor generates on its own ranks
    pool: str | None = None
    # how the actor's weights reach rollout.pool (docs/guide/async.md): through Ray's object store, or broadcast over a
    # torch.distributed group (gloo on CPU, NCCL on CUDA); in buckets of at most weight_sync_bucket_bytes either way
    weight_sync: Literal["object_store", "collective"] = "object_store"
    weight_sync_bucket_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    # partial rollout (docs/guide/async.md): rollout.pool generates in segments of at most partial_rollout_tokens new
    # tokens per row; weights synced while a generation is in flight are loaded between two segments, and each
    # token keeps the version that sampled it (token_versions)
    partial_rollout: bool = False
    partial_rollout_tokens: int = Field(default=4, gt=0)

    @model_validator(mode="after")
    def _no_pipeline_generation(self) -> RolloutConfig:
        if self.pipeline_parallel_size != 1:
            raise PydanticCustomError("rejected_key", "{reason}", {"key": "pipeline_parallel_size", "reason": (
                f"got {self.pipeline_parallel_size}, but no rollout engine here generates pipeline-parallel "
                "(hf, vllm and sglang engines take tensor_parallel_size only). Fix: set "
                "rollout.pipeline_parallel_size=1 (or remove it; in a `hybridflow plan` fragment too) and use "
                "rollout.tensor_parallel_size")})
        if self.agent is not None and self.multi_turn.enable:
            raise PydanticCustomError("rejected_key", "{reason}", {"key": "agent", "reason": (
                "rollout.agent and rollout.multi_turn.enable both choose how a sample is rolled out (the user's agent "
                "over the endpoint, or the built-in tool loop). Fix: set rollout.multi_turn.enable=false or remove "
                "rollout.agent")})
        if self.agent is not None and (self.pool is not None or self.tensor_parallel_size != 1):
            raise PydanticCustomError("rejected_key", "{reason}", {"key": "agent", "reason": (
                f"rollout.agent serves its endpoint from the actor's own rollout engine at tensor_parallel_size = 1; "
                f"got pool={self.pool!r}, tensor_parallel_size={self.tensor_parallel_size}. Fix: remove rollout.pool "
                "and set rollout.tensor_parallel_size=1")})
        check_env_conflicts(self)
        return self


class _ScoreSection(_Section):
    """What the reward and the cost sections share: a rule function (in the driver, a pool or an endpoint) and a
    scalar-head model role."""

    function: str | None = "arithmetic"
    model: ModelConfig | None = None
    engine: str = "fsdp"
    pool: str = "main"
    parallel: ParallelSection = ParallelSection()
    micro_batch_size: int = Field(default=64, gt=0)
    protocols: dict[str, str] = Field(default_factory=dict)  # of the reward-model worker's methods, as for actor
    num_workers: int = Field(default=0, ge=0)  # rule function in a pool of N processes; 0 = in the driver
    timeout_s: float = Field(default=300.0, gt=0)  # per call of the function in the pool, or of the endpoint
    endpoint: str | None = None  # http://host:port/path scoring each batch in place of `function`

    @model_validator(mode="after")
    def _endpoint_or_function(self) -> _ScoreSection:
        if self.endpoint is not None and "function" in self.model_fields_set and self.function is not None:
            raise ValueError(f"endpoint={self.endpoint!r} replaces the rule function, but function={self.function!r} "
                             "is set too; set function: null, or drop endpoint")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f'endpoint must be an http(s) URL such as "http://host:port/score", got {self.endpoint!r}')
        return self


class RewardConfig(_ScoreSection):
    # a generative reward model (LLM-as-judge): its verdicts score each response; it replaces the default function
    # (set reward.function as well to add a rule score to the verdicts')
    genrm: GenRMSection | None = None

    @model_validator(mode="before")
    @classmethod
    def _judge_replaces_the_default_function(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("genrm") is not None and "function" not in data:
            return {**data, "function": None}
        return data


class CostConfig(_ScoreSection):
    rejected_keys: ClassVar[dict[str, str]] = {"genrm": (
        "a generative reward model scores the reward only (reward.genrm), not a Safe-RLHF cost. Fix: move it to "
        "reward.genrm, or score the cost with cost.function, cost.endpoint or cost.model")}
    function: str | None = "response_length_cost"
    limit: float = 1.0
    lagrange_lr: float = Field(default=0.05, gt=0)
    initial_lambda: float = Field(default=1.0, ge=0)


class FilterGroupsConfig(_Section):
    """Dynamic sampling (DAPO; verl's ``algorithm.filter_groups``): train only on prompt groups whose ``metric``
    differs across the n samples, drawing more prompts until the batch is full (algorithms/dynamic_sampling.py)."""

    enable: bool = False
    metric: str = "score"  # "score" (the reward's per-sequence score) or a per-row column of the scored batch
    max_num_gen_batches: int = 0  # generation batches per step at most (≤ 0: unbounded); then topped up, see module


class AlgorithmConfig(_Section):
    name: str = "grpo"
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=1.0, ge=0, le=1)
    kl_coef: float = Field(default=0.0, ge=0)
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k1"
    adaptive_kl_target: float | None = Field(default=None, gt=0)
    norm_adv_by_std: bool = True
    whiten_advantages: bool = True  # whiten GAE advantages over the batch (PPO, Safe-RLHF), as verl does
    # off-policy correction of the actor loss by π_old / π_rollout per token (docs/guide/async.md): none, tis (truncated
    # at the threshold) or mis (tokens outside [1/threshold, threshold] masked)
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    rollout_correction_threshold: float = Field(default=2.0, gt=1)
    # what the ratio is taken over: token (each token's), sequence (the product over the response's tokens, one
    # weight per row) or geometric (exp of the mean per-token log-ratio, one weight per row)
    rollout_correction_level: Literal["token", "sequence", "geometric"] = "token"
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    extra: dict[str, Any] = Field(default_factory=dict)  # options of a third-party algorithm, passed through unchanged


class TaskConfig(_Section):
    name: Literal["arithmetic"] = "arithmetic"
    num_prompts: int = Field(default=512, gt=0)
    max_operand: int = Field(default=99, ge=0)
    operators: str = "+"
    seed: int = 0
    # held-out prompts for validation (trainer.val_every): distinct prompts that never occur in training
    num_val_prompts: int = Field(default=0, ge=0)


class DataConfig(_Section):
    # one path or a list of them, ``~`` expanded (verl's data.train_files=~/data/gsm8k/train.parquet works as is)
    train_files: PathList = Field(default_factory=list)
    val_files: PathList = Field(default_factory=list)  # validation prompts (same formats), see trainer.val_every
    task: TaskConfig | None = TaskConfig()
    max_prompt_length: int = Field(default=8, gt=0)
    batch_size: int = Field(default=16, gt=0)
    shuffle: bool = True

    @model_validator(mode="after")
    def _some_data(self) -> DataConfig:
        if not self.train_files and self.task is None:
            raise ValueError("set data.train_files (parquet/jsonl) or data.task (a synthetic task)")
        return self


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]
DEFAULT_LOGGERS: tuple[LoggerName, ...] = ("console", "jsonl", "tensorboard")


class TrainerConfig(_Section):
    total_steps: int = Field(default=40, gt=0)
    run_dir: str = "runs/latest"
    checkpoint_every: int = Field(default=10, ge=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    resume: Literal["auto", "never", "must"] = "auto"
    seed: int = 0
    progress: bool = True
    # where metrics go (docs/guide/operations.md): console (the progress display), jsonl (metrics.jsonl, which
    # `hybridflow report` reads), tensorboard, wandb (offline unless WANDB_MODE), mlflow (RUN_DIR/mlruns unless
    # MLFLOW_TRACKING_URI)
    loggers: OneOrMany[LoggerName] = Field(default_factory=lambda: list(DEFAULT_LOGGERS))
    tensorboard: bool = True  # false drops tensorboard from trainer.loggers (the older switch)
    # decoded samples per step appended to RUN_DIR/rollouts.jsonl (prompt, response, reward, length); 0 = off
    log_rollouts: int = Field(default=4, ge=0)
    deadline_s: float = Field(default=900.0, gt=0)
    threads_per_worker: int = Field(default=1, gt=0)
    plan: str | None = None  # plan.json (or its folder) from `hybridflow plan --output DIR`, copied into run_dir
    # auto: search the placement at start-up from this config (its pools' devices, models and workload) and apply it:
    # pools, each role's pool and parallel sizes; RUN_DIR/plan.json feeds the advisor (docs/design/placement.md)
    placement: Literal["manual", "auto"] = "manual"
    # the device profile trainer.placement=auto prices (a100-80gb, h100, h200, cpu, ...); unset: cpu for cpu pools
    placement_profile: str | None = None
    # remap advisor (docs/design/placement.md): every advisor_every steps compare the plan's predicted node times with
    # the ledger's and record in RUN_DIR/advisor.jsonl whether a remap pays (0 = off; needs trainer.plan); advisor_runs:
    # earlier run dirs (plan.json + ledger.jsonl) it calibrates from too, e.g. one at another data-parallel size
    advisor_every: int = Field(default=0, ge=0)
    advisor_runs: list[str] = Field(default_factory=list)
    # dispatch the next iteration's generation while the actor update runs (same calls, same order on the workers;
    # off before a checkpoint and on the last step); see docs/design/controller.md
    lookahead: bool = True
    # verl's balance_batch: the updates' rows are dealt to the data-parallel ranks by token count, whole prompt groups
    # each (protocol mesh_balanced, docs/design/controller.md); false splits them in order (mesh)
    balance_batch: bool = True
    # validation (docs/guide/validation.md): every val_every steps, before the first and after the last (0 = off), on
    # data.val_files or data.task.num_val_prompts; greedy, plus val_n samples per prompt when val_n > 1
    val_every: int = Field(default=0, ge=0)
    val_n: int = Field(default=1, ge=1)
    # asynchronous RL (docs/guide/async.md): with rollout.pool, generation runs up to max_staleness policy versions
    # behind the actor; samples further behind are dropped and counted. 0 = synchronous
    max_staleness: int = Field(default=0, ge=0)
    # streaming (docs/guide/async.md): with rollout.pool, a step's rollout arrives in chunks of actor.mini_batch_size
    # rows and the actor takes each chunk's optimizer step as it arrives (one policy version per step still)
    stream_mini_batches: bool = False


class ReliabilitySection(_Section):
    """Fault injection (off unless listed) and the recovery policy; see docs/guide/operations.md."""

    faults: list[str] = Field(default_factory=list)
    max_retries: int = Field(default=2, ge=0)
    on_hang: Literal["retry", "stop"] = "retry"
    on_worker_failure: Literal["retry", "stop"] = "retry"
    deadlines: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _valid(self) -> ReliabilitySection:
        from hybridflow.reliability.faults import parse_fault_specs

        parse_fault_specs(self.faults)  # ConfigError naming the bad spec and the known points
        bad = {node: s for node, s in self.deadlines.items() if not s > 0}
        if bad:
            raise ValueError(f"deadlines must be positive seconds per node (e.g. actor.update_policy: 60), got {bad}")
        return self


class Config(_Section):
    algorithm: AlgorithmConfig = AlgorithmConfig()
    model: ModelConfig = ModelConfig(preset="tiny-qwen2")
    data: DataConfig = DataConfig()
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    critic: CriticConfig = CriticConfig()
    reference: ReferenceConfig = ReferenceConfig()
    reward: RewardConfig = RewardConfig()
    cost: CostConfig | None = None
    cost_critic: CriticConfig | None = None  # Safe-RLHF's cost value model; keys left unset come from `critic`
    roles: dict[str, RoleSection] = Field(default_factory=dict)  # sections of roles third-party algorithms declare
    resource_pools: dict[str, PoolConfig] = Field(default_factory=lambda: {"main": PoolConfig(devices_per_node=[2])})
    ray: RayConfig = RayConfig()
    trainer: TrainerConfig = TrainerConfig()
    reliability: ReliabilitySection = ReliabilitySection()

    @model_validator(mode="after")
    def _pools_and_batches(self) -> Config:
        # the actor always runs; the roles an algorithm may not use (critic, reference, reward/cost models) are
        # checked the same way when the trainer plans them (check_pool_batches), before any worker starts
        check_pool_batches(self, {"actor": self.actor}, error=ValueError)
        check_generation_layout(self, self.resource_pools[self.actor.pool].world_size)
        check_async(self)
        return self

    def role_model(self, section: Any) -> ModelConfig:
        """The model of a role (its own ``model`` or the top-level one)."""
        return section.model if section.model is not None else self.model


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (numbers by YAML 1.2 rules; or start from defaults), apply overrides, validate.

    Raises:
        ConfigError: naming the key path, what was wrong and the fix.
    """
    data = read_yaml_mapping(Path(path)) if path is not None else {}
    data = _anchor_reward_functions(apply_overrides(data, overrides or []),
                                    Path(path).parent if path is not None else Path.cwd())
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain_errors(exc.errors(), Config)) from None


def _anchor_reward_functions(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """``reward.function``/``cost.function``/``reward.genrm.parser`` as the config file means them: relative
    ``file.py:function`` paths and modules sitting next to the file become absolute file paths (as verl's
    ``custom_reward_function.path``)."""
    from hybridflow.rewards import resolve_function_path

    for section in ("reward", "cost"):
        part = data.get(section)
        if isinstance(part, dict) and isinstance(part.get("function"), str):
            data[section] = {**part, "function": resolve_function_path(part["function"], base_dir)}
    part = data.get("reward")
    judge = part.get("genrm") if isinstance(part, dict) else None
    if isinstance(part, dict) and isinstance(judge, dict) and isinstance(judge.get("parser"), str):
        data["reward"] = {**part, "genrm": {**judge, "parser": resolve_function_path(judge["parser"], base_dir)}}
    return data


def config_hash(config: Config) -> str:
    """A stable short hash of the validated config (for the run manifest)."""
    payload = json.dumps(config.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
