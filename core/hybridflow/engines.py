"""What a training or rollout engine plugin implements: typed configs and ``typing.Protocol`` interfaces.

Stability: public (plugin authors code against it). The core never builds an engine itself; it looks a factory up
in :mod:`hybridflow.registries` by the name the config gives and calls it inside a worker process.

Batch column conventions (all tensors, batch dim first; P = prompt length, R = response length):

- prompts in: ``input_ids`` [B, P] left-padded, ``attention_mask`` [B, P]
- after ``generate``: ``prompts`` [B, P], ``responses`` [B, R] right-padded with pad id, ``input_ids`` and
  ``attention_mask`` [B, P+R], ``position_ids`` [B, P+R], ``response_mask`` [B, R] (1 on generated tokens up to and
  including EOS), ``rollout_log_probs`` [B, R] (log-prob of each sampled token under the sampling distribution
  before temperature/top-k/top-p, i.e. the policy's own log-prob), and meta ``policy_version``.
- ``compute_log_probs`` returns ``log_probs`` [B, R] (and ``entropy`` [B, R] when asked); ``compute_values``
  returns ``values`` [B, R] (the value of the state before each response token, as in verl); ``compute_scores``
  returns ``scores`` [B] (read at the last attended token). Each returns a Batch holding *only* the new columns and
  the input's ``meta``; the driver joins them with ``batch | out``.

Training contract:

- ``train_step(batch, loss_fn=..., mini_batch_size=...)``: one optimizer step per mini-batch; ``mini_batch_size``
  counts rows over all data-parallel ranks (None: the whole batch in one step); the engine's
  ``micro_batch_size`` counts rows per forward on one rank.
- Gradient accumulation follows :mod:`hybridflow.loss_scale` (the contract losses and engines share): before each
  ``loss_fn(outputs, micro_batch)`` the engine sets ``micro_batch.meta["loss_scale_tokens"]`` and
  ``["loss_scale_rows"]`` to the mini-batch's valid response tokens and rows (all-reduced over data-parallel ranks,
  divided by their number, ``is_padding`` rows excluded) and calls ``backward()`` on the returned loss unweighted.
  ``outputs`` holds what ``loss_fn.required_outputs`` names (default ``("log_probs",)``; ``entropy`` with gradients
  only when asked; an actor engine passes it detached otherwise, for the ``actor/entropy`` metric).
- Capability ``continue_from_tokens`` (:class:`TokenContinuationEngine`): ``generate_from_tokens`` continues
  each given list of token ids (prompts of any lengths; the engine pads them) and returns exactly the ids it
  sampled, their log-probs and why it stopped. Multi-turn rollouts (:mod:`hybridflow.agent`) need it: the token
  stream is never re-tokenized between turns.
- Capability ``kv_cache_reuse`` (on top of ``continue_from_tokens``): ``generate_from_tokens(..., cache_keys=[one
  hashable per prefix])`` keeps each row's keys/values under its key, and a later call with that key whose prefix
  extends the kept ids computes only the new ids (same outputs as without); ``release_cache(keys)`` frees entries
  (the agent loop passes one key per conversation and releases it when the conversation ends).
- Optional capabilities beyond the base Protocols are Protocols of their own (:data:`TRAINING_CAPABILITIES`,
  :data:`ROLLOUT_CAPABILITY_PROTOCOLS`). An engine implements each it offers and **declares** it at registration
  with an info record (``registry.register(name, factory, info=RolloutEngineInfo(...))``); the core asks the
  record, never the engine's attributes: what a run needs and the engine lacks is refused at config time naming
  the capability (:func:`require_capability`), and an engine that declares a capability it does not implement is
  refused when it is built (:func:`verify_declared_capabilities`), neither ever retried as a transient fault.
  docs/guide/plugin-authoring.md's table says which capability the hybrid engine uses for what.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from hybridflow.adapter_sync import HandsOverAdapters, LoadsAdapters
from hybridflow.errors import ConfigError, EngineContractError

if TYPE_CHECKING:
    import torch

    from hybridflow.batch import Batch
    from hybridflow.resharding import ParallelLayout

__all__ = [
    "Role",
    "ModelSpec",
    "ParallelConfig",
    "OptimConfig",
    "LoraConfig",
    "LORA_ALL_LINEAR",
    "TrainingEngineConfig",
    "SamplingParams",
    "RolloutEngineConfig",
    "MeshInfo",
    "LossFn",
    "TrainingEngine",
    "TRAINING_FEATURES",
    "check_training_features",
    "training_features_used",
    "RolloutEngine",
    "TrainingEngineFactory",
    "RolloutEngineFactory",
    "ROLLOUT_CAPABILITIES",
    "TokenCompletion",
    "TokenContinuationEngine",
    "KVCacheReuseEngine",
    "HandoverReport",
    "ReshardsGenerationWeights",
    "ParksTrainingWeights",
    "ReportsHandover",
    "HoldsWeights",
    "BindsGenerationWeights",
    "GeneratesTensorParallel",
    "ReportsParameterShapes",
    "TRAINING_CAPABILITIES",
    "ReplaysRouting",
    "RecordsRouting",
    "ROLLOUT_CAPABILITY_PROTOCOLS",
    "TrainingEngineInfo",
    "RolloutEngineInfo",
    "training_engine_info",
    "rollout_engine_info",
    "require_capability",
    "verify_declared_capabilities",
    "local_mini_batch_rows",
]

Role = Literal["actor", "critic", "reference", "reward_model"]
ROLES: tuple[str, ...] = ("actor", "critic", "reference", "reward_model")

#: the behaviour flags a rollout engine may report in ``capabilities`` (what the core does with each):
#: ``sleep`` - the actor worker calls ``sleep()`` after generating and ``wake()`` before the next handover, so the
#: generation weights and KV cache are freed while training runs; ``seed`` - ``SamplingParams.seed`` makes sampling
#: reproducible (without it the worker warns and samples unseeded); ``continue_from_tokens`` - the engine is a
#: :class:`TokenContinuationEngine` (multi-turn rollouts need it); ``kv_cache_reuse`` - a
#: :class:`KVCacheReuseEngine` (the agent loop passes cache keys). Flags other than these are ignored.
ROLLOUT_CAPABILITIES = ("sleep", "seed", "continue_from_tokens", "kv_cache_reuse")


def _positive(name: str, value: int | float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'≥ 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Which model to build: an HF directory (``path``) or an HF config dict with random init (``config``)."""

    path: str | None = None
    config: Mapping[str, Any] | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.path is None) == (self.config is None):
            raise ConfigError(
                "model needs exactly one of `path` (an HF model directory) or `config` (an HF config dict for "
                f"random init); got path={self.path!r}, config={'set' if self.config else None}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Training layout sizes; data parallel size is what is left of the world size when 0."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 0

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size, allow_zero=True)

    def resolve(self, world_size: int) -> ParallelConfig:
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor_parallel_size × pipeline_parallel_size = "
                f"{model_parallel}; change the pool size or the parallel sizes"
            )
        data = world_size // model_parallel
        if self.data_parallel_size and self.data_parallel_size != data:
            raise ConfigError(
                f"data_parallel_size={self.data_parallel_size} but the pool has {world_size} devices for "
                f"tp={self.tensor_parallel_size} × pp={self.pipeline_parallel_size}, which gives {data}"
            )
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=data,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup then cosine/linear/constant decay."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 0
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("grad_clip", self.grad_clip, allow_zero=True)


#: ``LoraConfig.target_modules`` value meaning every linear layer except the output head (as peft's "all-linear")
LORA_ALL_LINEAR = "all-linear"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """Low-rank adapters (LoRA): each targeted linear layer computes ``x W^T + (x A^T B^T) * alpha / rank``; only
    A [rank, in] and B [out, rank] train, W stays frozen.

    ``target_modules``: module names as peft matches them (a module matches a name equal to its qualified name or to
    its last dotted components, e.g. ``q_proj``), or ``"all-linear"``. ``dropout`` applies to the adapters' input.
    An engine that does not train adapters must refuse a config with ``lora`` set (stability: public).
    """

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = LORA_ALL_LINEAR

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"lora.rank must be a positive integer (the adapters' inner dimension, e.g. 8); got "
                              f"{self.rank!r}")
        _positive("lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1); got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != LORA_ALL_LINEAR:
            raise ConfigError(f'lora.target_modules must be a list of module names (e.g. [q_proj, v_proj]) or '
                              f'"{LORA_ALL_LINEAR}"; got {self.target_modules!r}')
        if not isinstance(self.target_modules, str) and (
                not self.target_modules or not all(isinstance(n, str) and n for n in self.target_modules)):
            raise ConfigError(f"lora.target_modules must name at least one module (e.g. [q_proj, v_proj]); got "
                              f"{list(self.target_modules)!r}")

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor of the adapters' product."""
        return self.alpha / self.rank


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingEngineConfig:
    """Everything a training engine factory needs besides the role and device."""

    model: ModelSpec
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 8
    mixed_precision: Literal["none", "bf16"] = "none"
    gradient_checkpointing: bool = False
    #: train low-rank adapters instead of every weight (actor only; engines without LoRA refuse it)
    lora: LoraConfig | None = None
    #: pack each micro-batch's rows without padding into one sequence (per-row attention) for log-probs, values and
    #: training; engines without a packed forward run the padded one
    use_remove_padding: bool = True
    #: cut micro-batches by a token budget (rows' ``attention_mask`` counts) instead of ``micro_batch_size`` rows
    max_tokens_per_micro_batch: int | None = None
    #: the actor's generation tensor-parallel size tg (``rollout.tensor_parallel_size``): an engine may lay its
    #: shards out for it (fsdp: row-parallel weights sharded on dim 1); 1 for every other role
    generation_tensor_parallel_size: int = 1
    #: mixture-of-experts actors (``actor.router_replay.mode``, verl's names): ``disabled`` routes with the training
    #: router, ``R3`` replays the experts the rollout recorded (the batch's ``routed_experts`` column); engines
    #: without MoE support refuse R3
    router_replay: Literal["disabled", "R3"] = "disabled"
    #: coefficients of the router's load-balancing loss and z-loss added to an MoE actor's loss (Megatron's
    #: moe_aux_loss_coeff / moe_z_loss_coeff); 0: off
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    #: the user's engine-specific options (``<role>.extra``), passed through untouched; the core writes no key here
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("micro_batch_size", self.micro_batch_size)
        if self.router_replay not in ("disabled", "R3"):
            raise ConfigError(f"router_replay must be 'disabled' or 'R3' (verl's names; R2 is not built), got "
                              f"{self.router_replay!r}")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            _positive(key, getattr(self, key), allow_zero=True)
        if self.max_tokens_per_micro_batch is not None:
            _positive("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    seed: int | None = None

    def __post_init__(self) -> None:
        _positive("n", self.n)
        _positive("max_new_tokens", self.max_new_tokens)
        _positive("temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        _positive("top_k", self.top_k, allow_zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutEngineConfig:
    """What a rollout engine factory needs; ``extra`` holds engine-specific keyword arguments."""

    model: ModelSpec
    tensor_parallel_size: int = 1
    max_prompt_length: int = 64
    max_new_tokens: int = 16
    pad_token_id: int = 0
    eos_token_id: int = 2
    seed: int = 0
    #: at ``tensor_parallel_size > 1`` inside the hybrid engine: every generation tensor group as global ranks in
    #: tensor-rank order (all ranks create all groups, in this order); None: the engine forms its own
    #: (:class:`GeneratesTensorParallel` engines read it)
    tensor_groups: tuple[tuple[int, ...], ...] | None = None
    #: the user's engine-specific options (``rollout.extra``), passed through untouched; the core writes no key here
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshInfo:
    """Where a worker sits for the ``mesh`` transfer protocol; ``generation`` is its place in the generation mesh
    (protocol ``generation_mesh``): ``dp_rank`` its generation replica (micro-DP group member), ``is_collect`` its
    tensor rank 0. None: every rank is its own generation replica (tg = 1)."""

    dp_rank: int
    dp_size: int
    is_collect: bool
    generation: MeshInfo | None = None


#: ``loss_fn(outputs, micro_batch) -> (loss, metrics)``; ``outputs`` holds ``log_probs``/``entropy`` or ``values``
LossFn = Callable[[Mapping[str, "torch.Tensor"], "Batch"], "tuple[torch.Tensor, dict[str, float]]"]


@runtime_checkable
class TrainingEngine(Protocol):
    """A model being trained (or only scored) by one SPMD rank. Stability: public."""

    role: str

    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch: ...

    def compute_values(self, batch: Batch) -> Batch: ...

    def compute_scores(self, batch: Batch) -> Batch: ...

    def train_step(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int | None = None) -> dict[str, float]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf(self, path: str) -> None: ...

    def mesh_info(self) -> MeshInfo: ...

    def generation_weights(self, *, target: str = "hf") -> Iterable[tuple[str, torch.Tensor]]:
        """Full generation weights (tg = 1) named as the target expects, produced from this rank's shards."""
        ...

    def state_version(self) -> int: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine on one rank. Stability: public."""

    capabilities: frozenset[str]

    @property
    def weights_version(self) -> int: ...

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenCompletion:
    """What one prefix was continued with: the sampled ids (ending with the stop token when ``finish_reason`` is
    ``"stop"``) and each one's log-prob under the policy (as ``rollout_log_probs``)."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]


@runtime_checkable
class TokenContinuationEngine(Protocol):
    """A rollout engine with capability ``continue_from_tokens``. Stability: public (experimental)."""

    capabilities: frozenset[str]

    @property
    def weights_version(self) -> int: ...

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = ()) -> list[TokenCompletion]:
        """Continue every prefix once (``sampling.n`` is ignored): at most ``sampling.max_new_tokens`` ids each,
        stopping after EOS or any of ``stop_token_ids`` (kept as the last id)."""
        ...


@runtime_checkable
class KVCacheReuseEngine(TokenContinuationEngine, Protocol):
    """A rollout engine with capabilities ``continue_from_tokens`` and ``kv_cache_reuse``. Stability: public
    (experimental)."""

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = (),
                             cache_keys: Sequence[Hashable] | None = None) -> list[TokenCompletion]:
        """As :meth:`TokenContinuationEngine.generate_from_tokens`; with ``cache_keys`` (one per prefix) each row's
        keys/values are kept under its key and reused by a later call whose prefix extends them."""
        ...

    def release_cache(self, keys: Iterable[Hashable] | None = None) -> None:
        """Free the entries of ``keys`` (all when None)."""
        ...


# --- optional capabilities -------------------------------------------------------------------------------------


@runtime_checkable
class HandoverReport(Protocol):
    """What a training engine measured in its last handover (:class:`ReportsHandover`); the ledger row's handover
    bytes and lower bound per rank read these. ``path == "reshard"`` means the reshard planner's plan ran, so
    ``lower_bound_bytes`` (what this rank had to receive at least) and ``bytes_sent`` are set."""

    @property
    def path(self) -> str: ...

    @property
    def bytes_received(self) -> int: ...

    @property
    def bytes_sent(self) -> int | None: ...

    @property
    def lower_bound_bytes(self) -> int | None: ...

    @property
    def aliased_bytes(self) -> int: ...


@runtime_checkable
class ReshardsGenerationWeights(Protocol):
    """Training capability: the 3D-HybridEngine's training side at any generation tensor-parallel size tg.

    ``parallel_layout()`` describes the training mesh (the generation layout is drawn inside it);
    ``generation_weights(target=..., tensor_parallel_size=tg)`` yields this rank's generation shards of that
    layout (tg = 1: full weights), named as ``target`` expects. Without it, the actor generates at tg = 1 only.
    """

    def parallel_layout(self) -> ParallelLayout: ...

    def generation_weights(self, *, target: str = "hf", tensor_parallel_size: int = 1,
                           park: bool = False) -> Iterable[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class ParksTrainingWeights(Protocol):
    """Training capability: ``generation_weights(..., park=True)`` releases the training shards' storage once the
    generation shards hold the same bytes, and ``end_generation()`` (called after every generate, even a failed
    one) gives it back. With a :class:`BindsGenerationWeights` rollout engine, one copy of the weights is resident
    while generating."""

    def generation_weights(self, *, target: str = "hf", tensor_parallel_size: int = 1,
                           park: bool = False) -> Iterable[tuple[str, torch.Tensor]]: ...

    def end_generation(self) -> None: ...


@runtime_checkable
class ReportsHandover(Protocol):
    """Training capability: ``last_handover_stats`` is the :class:`HandoverReport` of the last consumed
    ``generation_weights`` (None before the first)."""

    @property
    def last_handover_stats(self) -> HandoverReport | None: ...


@runtime_checkable
class HoldsWeights(Protocol):
    """Training or rollout capability: ``weight_tensors()`` lists the tensors holding this rank's weights, so the
    worker can count the distinct bytes resident (the ledger row's ``weight_bytes`` per phase, ``training`` and
    ``generation``, one number per rank; shared storages count once)."""

    def weight_tensors(self) -> list[torch.Tensor]: ...


@runtime_checkable
class BindsGenerationWeights(Protocol):
    """Rollout capability: ``update_weights(named, version=..., bind=True)`` makes the given tensors the engine's
    weights (no copy): the handover's shards are then the only copy the rollout engine holds. Every weight the
    engine uses is sent (a tied ``lm_head.weight`` is not: tie it to ``embed_tokens``), in the generation dtype
    (``RolloutEngineConfig.model.dtype``). The bound tensors are valid until the worker's generate call returns:
    the training engine takes their storage back afterwards (``end_generation``), so the engine must not read them
    after ``sleep()`` or once that call has returned; the next generate call always brings a new handover."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                       bind: bool = False) -> None: ...


@runtime_checkable
class GeneratesTensorParallel(Protocol):
    """Rollout capability: generation at ``tensor_parallel_size > 1`` on the caller's own ranks (the hybrid engine's
    layout), in the groups of ``RolloutEngineConfig.tensor_groups``; ``tensor_rank`` is this rank's place in its
    group (None before the engine has joined one). The default process group is initialised by the training engine
    of the same worker before the rollout engine is built; the engine creates every group of ``tensor_groups``
    itself (``dist.new_group``, all ranks, list order). Every rank of a group receives the same prompts and the same
    ``SamplingParams.seed`` and must sample the same tokens. ``update_weights`` then receives this rank's
    tensor-parallel shards under the full parameter names, split as
    :func:`hybridflow.resharding.builders.classify_llama_param` says: ``o_proj``/``down_proj`` weights on dim 1
    (row), ``q/k/v_proj``, ``gate/up_proj`` (weights and biases) on dim 0 (column), ``embed_tokens`` and
    ``lm_head`` on dim 0 (vocabulary), norms and row-parallel biases whole; equal contiguous chunks in tensor-rank
    order."""

    @property
    def tensor_rank(self) -> int | None: ...


@runtime_checkable
class ReportsParameterShapes(Protocol):
    """Rollout capability: ``parameter_shapes()`` gives the parameters as this rank holds them (at tg > 1 its
    partition), for checking what generation keeps resident."""

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]: ...


@runtime_checkable
class ReplaysRouting(Protocol):
    """Training capability, mixture-of-experts actors: under ``TrainingEngineConfig.router_replay = "R3"`` every
    forward (log-probs and update) routes each token to the experts of the batch's ``routed_experts`` column
    ([B, T, MoE layers, top-k] over the ``input_ids`` positions, -1 where not recorded: those keep the router's
    choice); the router losses of ``router_aux_loss_coef`` / ``router_z_loss_coef`` join the actor loss; a train
    step reports ``actor/router_flip_ratio`` (recorded response tokens routed differently from the rollout in any
    MoE layer) and per-layer expert load. ``moe_layers``: the model's MoE layers (0: dense)."""

    @property
    def moe_layers(self) -> int: ...


@runtime_checkable
class RecordsRouting(Protocol):
    """Rollout capability: for a mixture-of-experts model, ``generate`` adds the ``routed_experts`` column
    ([B, T, MoE layers, top-k] int16 over the output's ``input_ids`` positions: the experts each prompt token and
    each fed-back response token was routed to, -1 at padding and the last sampled token). ``moe_layers``: the
    model's MoE layers (0: dense, no column)."""

    @property
    def moe_layers(self) -> int: ...


#: the training capabilities, by the name a config error uses
TRAINING_CAPABILITIES: dict[str, type] = {
    "reshards_generation_weights": ReshardsGenerationWeights, "parks_training_weights": ParksTrainingWeights,
    "reports_handover": ReportsHandover, "holds_weights": HoldsWeights, "replays_routing": ReplaysRouting,
    "hands_over_adapters": HandsOverAdapters}
#: the rollout capabilities, by the name a config error uses
ROLLOUT_CAPABILITY_PROTOCOLS: dict[str, type] = {
    "binds_generation_weights": BindsGenerationWeights, "generates_tensor_parallel": GeneratesTensorParallel,
    "reports_parameter_shapes": ReportsParameterShapes, "holds_weights": HoldsWeights,
    "records_routing": RecordsRouting, "loads_adapters": LoadsAdapters}


#: the optional keys of :class:`TrainingEngineConfig` an engine implements only when its info record lists them in
#: ``features`` (feature → what turns it on); a role whose config turns one on is refused at config time, before any
#: worker starts, when its engine did not declare it
TRAINING_FEATURES: dict[str, str] = {
    "lora": "lora (LoRA adapters on the actor)",
    "bf16": "mixed_precision=bf16 (bf16 compute on fp32 master weights)",
    "gradient_checkpointing": "gradient_checkpointing=true (activations recomputed in backward)",
    "token_budget_micro_batches": "max_tokens_per_micro_batch (micro-batches cut by tokens)",
    "tensor_parallel": "parallel.tensor_parallel_size > 1",
    "pipeline_parallel": "parallel.pipeline_parallel_size > 1",
}


def training_features_used(config: TrainingEngineConfig) -> list[str]:
    """The :data:`TRAINING_FEATURES` a role's engine config turns on (``mixed_precision`` as resolved: ``auto``
    gives bf16 only on an engine that declares ``auto_mixed_precision``)."""
    used = {"lora": config.lora is not None, "bf16": config.mixed_precision == "bf16",
            "gradient_checkpointing": config.gradient_checkpointing,
            "token_budget_micro_batches": config.max_tokens_per_micro_batch is not None,
            "tensor_parallel": config.parallel.tensor_parallel_size > 1,
            "pipeline_parallel": config.parallel.pipeline_parallel_size > 1}
    return [name for name, on in used.items() if on]


def check_training_features(role: str, engine: str, config: TrainingEngineConfig) -> None:
    """Raise a :class:`~hybridflow.errors.ConfigError` naming the first feature ``role``'s config turns on that its
    training engine ``engine`` did not declare, and the registered engines that do."""
    from hybridflow import registries

    declared = training_engine_info(engine).features
    for feature in training_features_used(config):
        if feature in declared:
            continue
        others = sorted(name for name in registries.training_engines.names()
                        if feature in training_engine_info(name).features)
        raise ConfigError(f'{role}.{TRAINING_FEATURES[feature]} needs a training engine with feature "{feature}"; '
                          f'training engine "{engine}" declares {sorted(declared) or "none"}. Fix: remove the key, '
                          f"or use {role}.engine= one of {others or 'no registered engine'}")


def _check_names(names: frozenset[str], known: Mapping[str, Any], what: str, kind: str = "capabilities") -> None:
    unknown = sorted(names - set(known))
    if unknown:
        raise ConfigError(f"{what} declares unknown {kind} {unknown}; known: {sorted(known)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingEngineInfo:
    """What a training engine declares at registration (stability: public). An engine registered without one
    declares nothing optional."""

    capabilities: frozenset[str] = frozenset()
    #: the optional config keys it implements (names of :data:`TRAINING_FEATURES`); a role that turns on one it does
    #: not list is refused at config time (:func:`check_training_features`)
    features: frozenset[str] = frozenset()
    #: ``mixed_precision: auto`` may pick bf16 for this engine (fp32 master weights, bf16 compute; the fsdp engine's
    #: measured switch point, hybridflow.precision); engines without it resolve ``auto`` to ``none``
    auto_mixed_precision: bool = False
    #: the worker process may host the roles of a later run in this driver once this engine's role is closed. It
    #: promises that the engine leaves no process-wide state the next engine would see after its role is dropped
    #: and the host has destroyed torch.distributed's process groups and restored the environment, ``sys.path``,
    #: torch's global flags and its default RNG seed: no module-level registry it fills, no thread or server left
    #: running, no global parallel state such as Megatron's ``parallel_state`` (an engine with something to stop
    #: implements ``close()``, which its role calls first). Off unless declared: such an engine's runs start fresh
    #: worker processes (hybridflow.controller.park keeps the others' for the next run)
    reusable_process: bool = False

    def __post_init__(self) -> None:
        _check_names(self.capabilities, TRAINING_CAPABILITIES, "TrainingEngineInfo")
        _check_names(self.features, TRAINING_FEATURES, "TrainingEngineInfo", "features")
        if self.auto_mixed_precision and "bf16" not in self.features:
            raise ConfigError("TrainingEngineInfo declares auto_mixed_precision (auto may pick bf16) without the "
                              'feature "bf16". Fix: add "bf16" to features')


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutEngineInfo:
    """What a rollout engine declares at registration (stability: public).

    ``capabilities``: names of :data:`ROLLOUT_CAPABILITY_PROTOCOLS` it implements. ``weights_target``: how the
    weights it loads are named (``"hf"``: transformers' names; the training side's ``generation_weights(target=)``).
    ``vocab_multiple``: at tensor-parallel generation the vocabulary must be a multiple of this (vLLM pads to 64
    before splitting). ``tensor_parallel_world``: ``"any"`` when its tensor groups may be any of the layout's
    (strided) groups; ``"whole"`` when a group must be the whole actor world (an engine whose launcher groups
    consecutive ranks).
    """

    capabilities: frozenset[str] = frozenset()
    weights_target: str = "hf"
    vocab_multiple: int = 1
    tensor_parallel_world: Literal["any", "whole"] = "any"
    #: as :attr:`TrainingEngineInfo.reusable_process`
    reusable_process: bool = False

    def __post_init__(self) -> None:
        _check_names(self.capabilities, ROLLOUT_CAPABILITY_PROTOCOLS, "RolloutEngineInfo")
        _positive("vocab_multiple", self.vocab_multiple)


def training_engine_info(name: str) -> TrainingEngineInfo:
    """The info record the training engine ``name`` was registered with (an empty one when none)."""
    from hybridflow import registries

    info = registries.training_engines.entry(name).info
    return info if isinstance(info, TrainingEngineInfo) else TrainingEngineInfo()


def rollout_engine_info(name: str) -> RolloutEngineInfo:
    """The info record the rollout engine ``name`` was registered with (an empty one when none)."""
    from hybridflow import registries

    info = registries.rollout_engines.entry(name).info
    return info if isinstance(info, RolloutEngineInfo) else RolloutEngineInfo()


def require_capability(kind: Literal["training", "rollout"], engine: str, capability: str, *, needed_for: str,
                       fix: str) -> None:
    """Raise a :class:`~hybridflow.errors.ConfigError` unless engine ``engine`` declared ``capability``."""
    info: TrainingEngineInfo | RolloutEngineInfo = (
        training_engine_info(engine) if kind == "training" else rollout_engine_info(engine))
    if capability not in info.capabilities:
        declared = sorted(info.capabilities) or "none"
        raise ConfigError(f'{needed_for} needs a {kind} engine with capability "{capability}"; {kind} engine '
                          f'"{engine}" declares {declared}. Fix: {fix}')


def _missing_members(engine: object, protocol: type) -> list[str]:
    """What ``engine`` lacks of ``protocol``: members it does not have, and keyword parameters of the protocol's
    methods its own methods do not accept (``update_weights`` without ``bind``)."""
    import inspect

    missing = []
    for member, declared in sorted(vars(protocol).items()):
        if member.startswith("_"):
            continue
        if not hasattr(engine, member):
            missing.append(member)
            continue
        if not inspect.isfunction(declared):
            continue
        try:
            accepted = inspect.signature(getattr(engine, member)).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            continue
        missing += [f"{member}({name}=...)" for name, parameter in inspect.signature(declared).parameters.items()
                    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in accepted]
    return missing


def verify_declared_capabilities(engine: object, info: TrainingEngineInfo | RolloutEngineInfo, name: str) -> None:
    """Refuse an engine that lacks a member of a capability it declared (a plugin bug: never retried). Checked once,
    when the engine is built: the declaration is what the core then relies on."""
    known = TRAINING_CAPABILITIES if isinstance(info, TrainingEngineInfo) else ROLLOUT_CAPABILITY_PROTOCOLS
    missing = {capability: _missing_members(engine, known[capability]) for capability in sorted(info.capabilities)}
    missing = {capability: members for capability, members in missing.items() if members}
    if missing:
        raise EngineContractError(
            f'engine "{name}" ({type(engine).__module__}.{type(engine).__qualname__}) declares capabilities it does '
            "not implement: " + "; ".join(f"{c} lacks {', '.join(m)}" for c, m in missing.items())
            + ". Fix the plugin: implement them or drop them from its info record (docs/guide/plugin-authoring.md)")


class TrainingEngineFactory(Protocol):
    def __call__(self, *, role: str, config: TrainingEngineConfig, device: str) -> TrainingEngine: ...


class RolloutEngineFactory(Protocol):
    def __call__(self, *, config: RolloutEngineConfig, device: str) -> RolloutEngine: ...


def local_mini_batch_rows(rows: int, mini_batch_size: int | None, data_parallel_size: int) -> int:
    """Rows of one mini-batch on this rank: ``mini_batch_size`` counts rows over all data-parallel ranks (None: the
    whole local batch is one mini-batch). Shared by training engines so they agree on the unit."""
    if mini_batch_size is None:
        return rows
    if mini_batch_size < data_parallel_size or mini_batch_size % data_parallel_size:
        raise ConfigError(
            f"mini_batch_size counts rows over all {data_parallel_size} data-parallel ranks and must be a positive "
            f"multiple of it; got {mini_batch_size}"
        )
    local = mini_batch_size // data_parallel_size
    if rows % local:
        raise ConfigError(
            f"this rank holds {rows} rows, not a multiple of its share of the mini-batch ({local} = "
            f"{mini_batch_size} / {data_parallel_size} ranks); make the batch a multiple of mini_batch_size"
        )
    return local
