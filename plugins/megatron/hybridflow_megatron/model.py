"""Build one rank's megatron-core GPTModel stage from an HF Llama/Qwen2/Qwen3 spec, with the HF weights loaded into it.

It owns megatron's process-global parallel state for this process and the HF → TransformerConfig mapping; training,
micro-batching and optimizers belong to :mod:`hybridflow_megatron.engine`. Import it only inside a factory.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.engines import ModelSpec, ParallelConfig
from hybridflow.errors import ConfigError, EngineError
from hybridflow_megatron import cpu_shim
from hybridflow_megatron.convert import (
    ArchInfo,
    ShardPosition,
    megatron_shard_from_hf,
    read_arch_info,
    tensor_parallel_dim,
)
from hybridflow_megatron.spec_names import build_layer_spec, named_local_parameters

__all__ = ["StagePlacement", "ValueHead", "VALUE_HEAD_ROLES", "ensure_parallel_state", "destroy_parallel_state",
           "track_engine", "close_engine", "release_megatron_state", "build_hf_model", "build_transformer_config",
           "build_stage", "rope_parameters"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_parallel_sizes: tuple[int, int] | None = None
#: the megatron engines of this process not closed yet (weakly: one dropped without ``close()`` stops counting)
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlacement:
    """Where this rank sits in megatron's (tensor, pipeline, data) mesh."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def ensure_parallel_state(parallel: ParallelConfig, *, device: str, timeout_s: float = 120.0,
                          seed: int = 0) -> StagePlacement:
    """Start torch.distributed (from RANK/WORLD_SIZE/MASTER_* env) and megatron's parallel groups once per process."""
    global _parallel_sizes
    import os

    if not dist.is_initialized():
        backend = "gloo" if device == "cpu" else "nccl"
        if device != "cpu":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            timeout=timedelta(seconds=timeout_s),
        )
    cpu_shim.activate_cpu_shim(device)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    resolved = parallel.resolve(dist.get_world_size())
    sizes = (resolved.tensor_parallel_size, resolved.pipeline_parallel_size)
    if _parallel_sizes is None:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=sizes[0],
            pipeline_model_parallel_size=sizes[1],
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
            create_gloo_process_groups=device != "cpu",
            order="tp-cp-ep-pp-dp",  # rank = (dp · p + pp) · t + tp, the order of hybridflow's ParallelLayout
        )
        model_parallel_cuda_manual_seed(seed)
        _parallel_sizes = sizes
    elif _parallel_sizes != sizes:
        raise ConfigError(
            f"megatron's parallel state is one per process: this process already runs tp={_parallel_sizes[0]}, "
            f"pp={_parallel_sizes[1]}; got tp={sizes[0]}, pp={sizes[1]}. Colocated megatron engines must share "
            "their tensor and pipeline sizes."
        )
    return StagePlacement(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


def destroy_parallel_state() -> None:
    """Forget megatron's parallel groups of this process (torch.distributed stays up), so that a later engine may
    use another (t, p). Release every engine built on the old groups first; every rank must call it."""
    global _parallel_sizes
    if _parallel_sizes is None:
        return
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    _parallel_sizes = None


#: ``parallel_state`` globals that ``destroy_model_parallel`` leaves set (megatron-core 0.16): the next
#: ``initialize_model_parallel`` overwrites them, but until then they name ranks and a group of the old world
_KEPT_BY_DESTROY = ("_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "_EMBEDDING_GLOBAL_RANKS",
                    "_EXPERT_MODEL_PARALLEL_RANKS", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                    "_MODEL_PARALLEL_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS")


def track_engine(engine: Any) -> None:
    """Count ``engine`` among this process's live megatron engines (:func:`close_engine` releases the state they
    share once the last one closes)."""
    _LIVE.add(engine)


def close_engine(engine: Any) -> bool:
    """``engine`` is closed: release megatron's process-wide state when no other live engine of this process uses
    it (:func:`release_megatron_state`); returns whether it was released."""
    _LIVE.discard(engine)
    if len(_LIVE):
        gc.collect()  # an engine dropped without close() may wait in a reference cycle (its handover holds it)
    if len(_LIVE):
        return False
    release_megatron_state()
    return True


def release_megatron_state() -> None:
    """Put megatron-core's process-wide state back as a fresh import has it, so that the next engine in this process
    (after the worker host destroyed torch.distributed's world: hybridflow.controller.process_state) starts as in a
    fresh process, with any (t, p). Call it on every rank while torch.distributed is still up, with no megatron
    engine left in use (:func:`close_engine` does).

    What the engines leave behind, and what is put back here: ``parallel_state``'s groups, ranks and global memory
    buffers (``destroy_model_parallel``, and the rank lists and group it leaves set: :data:`_KEPT_BY_DESTROY`; the
    groups are torch's, destroyed with the world by whoever owns it, but ``parallel_state`` would hand the next
    engine those of a destroyed world), this module's record of the (t, p) they were built for, the model-parallel
    RNG tracker (``tensor_parallel.random``: its forked states; the next engine's ``model_parallel_cuda_manual_seed``
    installs and seeds a new one) and, on CPU, the shim's rebinding of ``torch`` inside megatron's modules
    (:func:`hybridflow_megatron.cpu_shim.deactivate_cpu_shim`). Megatron's microbatch calculator and rerun state
    machine are never set up by the engine (it passes the number of micro-batches to the schedule itself). Checked
    by the process reuse contract (tests/plugins/megatron/test_megatron_reuse.py)."""
    import sys

    destroy_parallel_state()
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    for name in _KEPT_BY_DESTROY:  # None on import; rank lists and a group of the old world otherwise
        if parallel_state is not None and hasattr(parallel_state, name):
            setattr(parallel_state, name, None)
    random: Any = sys.modules.get("megatron.core.tensor_parallel.random")  # untyped: its module names are Any here
    if random is not None:
        random._CUDA_RNG_STATE_TRACKER = None
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    cpu_shim.deactivate_cpu_shim()


#: roles whose model ends in a [hidden → 1] value head instead of the LM head (the critic's values, a reward model's
#: scores); their HF form is a 1-label token classifier
VALUE_HEAD_ROLES = ("critic", "reward_model")


def build_hf_model(spec: ModelSpec, *, role: str) -> torch.nn.Module:
    """The HF model whose weights seed the megatron model: a causal LM, or a 1-label token classifier for a critic.

    With ``spec.config`` the weights are a random init under ``spec.seed`` (identical on every rank); a critic
    loaded from a causal-LM directory gets a fresh value head from the same seed.
    """
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    # as the fsdp engine: no bar, whose tqdm monitor thread would outlive the engine (and keep the worker process
    # from being parked: hybridflow.controller.process_state)
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    if spec.path is not None:
        config = AutoConfig.from_pretrained(spec.path)
    else:
        assert spec.config is not None
        values = dict(spec.config)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(spec.seed)
    if role in VALUE_HEAD_ROLES:
        config.num_labels = 1
    factory = AutoModelForTokenClassification if role in VALUE_HEAD_ROLES else AutoModelForCausalLM
    if spec.path is not None:
        model: torch.nn.Module = factory.from_pretrained(spec.path, config=config, dtype=torch.float32)
    else:
        model = factory.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]  # untyped in HF
    return model


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters (``rope_theta``, ``rope_type``, scaling): transformers 5 keeps them in
    ``rope_parameters`` (a Qwen3 config has no ``rope_theta`` attribute), transformers 4 in ``rope_theta`` and
    ``rope_scaling``."""
    values = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if "rope_theta" not in values and getattr(hf_config, "rope_theta", None) is not None:
        values["rope_theta"] = hf_config.rope_theta
    return values


def build_transformer_config(hf_config: Any, *, arch: ArchInfo, placement: StagePlacement, dtype: str,
                             device: str, overrides: dict[str, Any] | None = None) -> Any:
    """megatron ``TransformerConfig`` equal in maths to the HF Llama/Qwen2/Qwen3 config; fusions off on the CPU."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    rope = rope_parameters(hf_config)
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"RoPE parameters {rope} are not mapped to megatron yet (rope_type "
                          f"{rope.get('rope_type')!r}); use a model with the default RoPE")
    if arch.num_layers % placement.pp_size:
        raise ConfigError(
            f"pipeline_parallel_size={placement.pp_size} must divide num_hidden_layers={arch.num_layers}"
        )
    on_cpu = device == "cpu"
    params_dtype = _DTYPES[dtype]
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=placement.tp_size,
        pipeline_model_parallel_size=placement.pp_size,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the HF model
        bias_activation_fusion=not on_cpu,
        bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=not on_cpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=not on_cpu,
        sequence_parallel=False,
    )
    kwargs.update(overrides or {})
    return TransformerConfig(**kwargs)


class ValueHead(torch.nn.Module):
    """A critic's [hidden → 1] head, replicated on every tensor rank; called like megatron's output layer."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def build_stage(spec: ModelSpec, *, role: str, placement: StagePlacement, device: str,
                overrides: dict[str, Any] | None = None, vocab_multiple: int = 8,
                transformer_engine: bool = False) -> tuple[Any, ArchInfo, Any]:
    """(GPTModel for this rank's stage with HF weights loaded, ArchInfo, HF config); the TransformerEngine layer
    spec when ``transformer_engine`` (see :mod:`hybridflow_megatron.spec_names`), else megatron's local spec."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    hf_model = build_hf_model(spec, role=role)
    hf_config = hf_model.config
    arch = read_arch_info(hf_config, tp_size=placement.tp_size, vocab_multiple=vocab_multiple,
                          value_head=role in VALUE_HEAD_ROLES)
    config = build_transformer_config(hf_config, arch=arch, placement=placement, dtype=spec.dtype, device=device,
                                      overrides=overrides)
    with cpu_shim.cpu_tensor_methods():
        model = GPTModel(
            config=config,
            transformer_layer_spec=build_layer_spec(transformer_engine=transformer_engine, qk_layernorm=arch.qk_norm),
            vocab_size=arch.padded_vocab_size,
            max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
            pre_process=placement.is_first_stage,
            post_process=placement.is_last_stage,
            parallel_output=False,
            share_embeddings_and_output_weights=arch.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=int(rope_parameters(hf_config).get("rope_theta", 10000)),
        )
    if arch.value_head and placement.is_last_stage:
        model.output_layer = ValueHead(arch.hidden_size)
    position = ShardPosition(
        tp_rank=placement.tp_rank,
        tp_size=placement.tp_size,
        layer_offset=get_transformer_layer_offset(config, pp_rank=placement.pp_rank),
        num_local_layers=len(model.decoder.layers),
        pre_process=placement.is_first_stage,
        post_process=placement.is_last_stage,
    )
    hf_state = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    shard = megatron_shard_from_hf(hf_state, arch=arch, position=position)
    load_shard(model, shard)
    mark_tensor_parallel_params(model, value_head=arch.value_head)
    if device != "cpu":
        model.cuda(torch.cuda.current_device())
    return model, arch, hf_config


def mark_tensor_parallel_params(model: torch.nn.Module, *, value_head: bool) -> None:
    """Set megatron's ``tensor_model_parallel``/``partition_dim`` attributes, which megatron-core 0.16 only sets
    when it initialises weights itself (``perform_initialization``); grad norms and checkpoints read them."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in named_local_parameters(model):
        dim = tensor_parallel_dim(name, value_head=value_head)
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, dim, 1)


def load_shard(model: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy ``shard`` into ``model``'s parameters; every parameter must be covered and every tensor used."""
    params = dict(named_local_parameters(model))
    missing = sorted(set(params) - set(shard))
    unexpected = sorted(set(shard) - set(params))
    if missing or unexpected:
        raise EngineError(
            f"megatron shard does not match the model: missing {missing[:6]}, unexpected {unexpected[:6]}. "
            "This is a conversion bug for this architecture; report it with the HF config."
        )
    with torch.no_grad():
        for name, param in params.items():
            if tuple(shard[name].shape) != tuple(param.shape):
                raise EngineError(f"{name}: converted shape {tuple(shard[name].shape)} != model {tuple(param.shape)}")
            param.copy_(shard[name].to(param.dtype))
