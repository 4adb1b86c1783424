"""LoRA for the fsdp engine's HF models: wrap the targeted ``nn.Linear`` layers so that only low-rank factors train,
and merge them (``W + B·A·alpha/rank``) for the rollout handover, the HF export and the offline export.

Base weights keep their HF names (``…q_proj.weight``) and are frozen; the factors are ``…q_proj.lora_A`` [rank, in]
and ``…q_proj.lora_B`` [out, rank] on the same module, so FSDP2 shards them with their layer and every HF-named
consumer (layouts, reshard plans, exporters) sees the base names. Sharding, the optimizer and the checkpoint layout
are the engine's business. Implemented natively rather than with peft: peft renames every wrapped weight
(``base_layer``) and wraps the model, which the HF-named handover and exporters would have to undo.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engines import LORA_ALL_LINEAR, LoraConfig
from hybridflow.errors import ConfigError

__all__ = ["LoRALinear", "apply_lora", "lora_modules", "is_adapter_name", "merge_weight", "merge_state_dict",
           "merged_parameters", "adapter_parameters", "base_fingerprint", "describe_adapters", "check_same_base",
           "unload_merged", "ADAPTER_NAMES", "lora_scales", "full_adapters"]

#: the adapter parameters' own names on a wrapped module
ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update: ``x W^T + b + dropout(x) A^T B^T · scale`` (stability: developer).

    It takes over the base layer's ``weight`` and ``bias`` parameters (same objects, same names). ``B`` starts at
    zero, so a freshly wrapped model computes exactly what the base model computes.
    """

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float,
                 generator: torch.Generator) -> None:
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.scale = alpha / rank
        weight = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device))
        with torch.no_grad():  # nn.Linear's own init (peft's default for A); drawn from the generator given
            bound = 1.0 / math.sqrt(base.in_features)
            self.lora_A.copy_(torch.rand(self.lora_A.shape, generator=generator, dtype=torch.float32) * 2 * bound
                              - bound)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(input), self.lora_A), self.lora_B)
        return F.linear(input, self.weight, self.bias) + update * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale}"


def _names_of(linear_names: Iterable[str]) -> list[str]:
    """The distinct last components of module names (what a user writes in target_modules)."""
    return sorted({name.rsplit(".", 1)[-1] for name in linear_names})


def _resolve_targets(model: nn.Module, config: LoraConfig, key: str) -> list[str]:
    """Qualified names of the linear layers ``config.target_modules`` selects, in module order."""
    modules = dict(model.named_modules())
    linears = [name for name, module in modules.items() if isinstance(module, nn.Linear) and name]
    get_head = getattr(model, "get_output_embeddings", None)  # an HF model's output head (None: no such method)
    head = get_head() if callable(get_head) else None
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    heads = {name for name in linears if modules[name] is head or name.rsplit(".", 1)[-1] == "score"}
    if config.target_modules == LORA_ALL_LINEAR:
        return [name for name in linears if name not in heads]
    chosen: list[str] = []
    for target in config.target_modules:
        matches = [name for name in modules if name and (name == target or name.endswith(f".{target}"))]
        if not matches:
            close = difflib.get_close_matches(target, _names_of(linears), n=1)
            raise ConfigError(
                f"{key}.target_modules: {target!r} names no module of {type(model).__name__}; its linear layers are "
                f"{_names_of(linears)}{f'. Did you mean {close[0]!r}?' if close else ''} (or use \"all-linear\")")
        others = [name for name in matches if not isinstance(modules[name], nn.Linear)]
        if others:
            raise ConfigError(
                f"{key}.target_modules: {target!r} names {type(modules[others[0]]).__name__} module {others[0]!r}; "
                f"LoRA wraps nn.Linear layers only: {_names_of(linears)}")
        if tied and any(modules[name] is head for name in matches):
            raise ConfigError(
                f"{key}.target_modules: {target!r} is the output head, whose weight is tied to the input embeddings "
                f"(tie_word_embeddings); an adapter on it would change both. Fix: remove {target!r}")
        chosen += [name for name in matches if name not in chosen]
    return [name for name in linears if name in chosen]


def apply_lora(model: nn.Module, config: LoraConfig, *, seed: int, key: str = "actor.lora") -> list[str]:
    """Freeze ``model`` and wrap the layers ``config`` targets in :class:`LoRALinear` (in place); returns their names.

    ``A`` is drawn from a generator seeded with ``seed``, so every rank builds the same adapters.

    Raises:
        ConfigError: a target names no module, or a module LoRA cannot wrap (``key`` names the config section).
    """
    targets = _resolve_targets(model, config, key)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        setattr(parent, child, LoRALinear(base, rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                                          generator=generator))
    return targets


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Qualified name → wrapped layer, in module order (empty for a model without adapters)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name is an adapter factor (``….lora_A`` / ``….lora_B``)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter factors, in parameter order (what the optimizer steps)."""
    return [p for name, p in model.named_parameters() if is_adapter_name(name)]


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + (B @ A) · scale``, computed in float32 and returned in ``weight``'s dtype (plain tensors)."""
    delta = (lora_b.float() @ lora_a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


def merge_state_dict(state: Mapping[str, torch.Tensor], scales: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict with adapters → the base model's HF state dict with the adapters merged.

    ``scales``: wrapped module name → ``alpha / rank`` (from :func:`lora_modules`).
    """
    merged = {name: tensor for name, tensor in state.items() if not is_adapter_name(name)}
    for module, scale in scales.items():
        merged[f"{module}.weight"] = merge_weight(state[f"{module}.weight"], state[f"{module}.lora_A"],
                                                  state[f"{module}.lora_B"], scale)
    return merged


def _local_merged(module: LoRALinear) -> torch.Tensor:
    """The merged weight laid out as ``module.weight`` is: a DTensor with its placement (this rank's shard computed
    from the all-gathered factors, which are small) or a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    weight = module.weight
    if not isinstance(weight, DTensor):
        return merge_weight(weight.detach(), module.lora_A.detach(), module.lora_B.detach(), module.scale)
    lora_a, lora_b = (p.full_tensor() if isinstance(p, DTensor) else p.detach()
                      for p in (module.lora_A, module.lora_B))
    mesh, placements = weight.device_mesh, weight.placements
    for placement in placements:  # take this rank's rows (Shard(0)) or columns (Shard(1)) of the product
        if isinstance(placement, Shard) and placement.dim == 0:
            lora_b = distribute_tensor(lora_b, mesh, [placement], src_data_rank=None).to_local()
        elif isinstance(placement, Shard) and placement.dim == 1:
            lora_a = distribute_tensor(lora_a, mesh, [placement], src_data_rank=None).to_local()
    local = merge_weight(weight.to_local(), lora_a, lora_b, module.scale)
    return DTensor.from_local(local, mesh, placements, shape=weight.shape, stride=weight.stride())


@torch.no_grad()
def merged_parameters(model: nn.Module) -> dict[str, Any]:
    """The base model's parameters by HF name, each wrapped layer's weight merged with its adapters (same placement
    as the weight: a DTensor shard under FSDP); unwrapped parameters are the model's own (not copies).

    A collective under FSDP (every rank gathers the factors): call it on every rank.
    """
    wrapped = {f"{name}.weight": module for name, module in lora_modules(model).items()}
    parameters: dict[str, Any] = {}
    for name, parameter in model.named_parameters():
        if is_adapter_name(name):
            continue
        parameters[name] = _local_merged(wrapped[name]) if name in wrapped else parameter
    return parameters


def lora_scales(model: nn.Module) -> dict[str, float]:
    """Wrapped module name → its ``alpha / rank`` (what a consumer of the bare factors needs to merge them)."""
    return {name: module.scale for name, module in lora_modules(model).items()}


@torch.no_grad()
def full_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter factor by name (``….lora_A`` / ``….lora_B``), whole: all-gathered from its FSDP shards (a
    collective: call it on every rank) or the parameter itself, detached.

    Factors sharded ``Shard(0)`` over one 1-D mesh (FSDP2's layout) travel in *one* all-gather: each rank's shards,
    padded to ``ceil(rows / world)`` rows as FSDP pads them, flattened into one buffer (a factor is small and there
    are two per wrapped layer, so one collective instead of one per factor); any other placement uses
    ``full_tensor()``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    factors = {name: p for name, p in model.named_parameters() if is_adapter_name(name)}
    flat = [name for name, p in factors.items() if isinstance(p, DTensor) and p.device_mesh.ndim == 1
            and tuple(p.placements) == (Shard(0),)]
    meshes = {id(cast(Any, factors[name]).device_mesh) for name in flat}
    dtypes = {factors[name].dtype for name in flat}
    if len(meshes) != 1 or len(dtypes) != 1:
        flat = []
    out = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
           for name, p in factors.items() if name not in flat}
    if not flat:
        return out
    mesh = cast(Any, factors[flat[0]]).device_mesh
    world = mesh.size()
    rows = {name: -(-factors[name].shape[0] // world) for name in flat}  # rows per rank, padded
    widths = {name: rows[name] * math.prod(factors[name].shape[1:]) for name in flat}
    buffer = torch.zeros(sum(widths.values()), dtype=factors[flat[0]].dtype, device=factors[flat[0]].device)
    offset = 0
    for name in flat:
        local = cast(Any, factors[name]).to_local().detach().reshape(-1)
        buffer[offset:offset + local.numel()] = local
        offset += widths[name]
    gathered = torch.empty(world * buffer.numel(), dtype=buffer.dtype, device=buffer.device)
    dist.all_gather_single(gathered, buffer, group=mesh.get_group())
    per_rank = gathered.view(world, -1)
    offset = 0
    for name in flat:
        shape = factors[name].shape
        pieces = per_rank[:, offset:offset + widths[name]].reshape(world * rows[name], *shape[1:])
        out[name] = pieces[:shape[0]].clone()
        offset += widths[name]
    return {name: out[name] for name in factors}


@torch.no_grad()
def base_fingerprint(model: nn.Module) -> list[float]:
    """``[sum, sum of squares]`` of every base (non-adapter) parameter in float64: identifies the frozen base the
    adapters were trained on. A collective under FSDP (shards summed over ranks); compare with a relative tolerance
    (the summation order follows the sharding)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    device = next(iter(model.parameters())).device  # (on the parameters' device: nccl reduces CUDA tensors only)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for name, parameter in model.named_parameters():
        if is_adapter_name(name):
            continue
        if isinstance(parameter, DTensor):
            values = parameter.to_local().detach().double()
        elif distributed and dist.get_rank() != 0:
            continue  # a replicated (unsharded) parameter: counted once, on rank 0
        else:
            values = parameter.detach().double()
        totals += torch.stack([values.sum(), values.square().sum()]).to(device)
    if distributed:
        dist.all_reduce(totals)
    return [float(value) for value in totals.cpu()]


def describe_adapters(model: nn.Module, config: LoraConfig, *, base: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint records next to the adapters: the LoRA config, the wrapped modules, and the base they
    apply to (``base``: the model spec's path, seed and dtype; plus :func:`base_fingerprint`)."""
    targets = config.target_modules
    return {"rank": config.rank, "alpha": config.alpha, "dropout": config.dropout,
            "target_modules": targets if isinstance(targets, str) else list(targets),
            "modules": list(lora_modules(model)), "base": dict(base), "base_fingerprint": base_fingerprint(model)}


def check_same_base(saved: Mapping[str, Any], current: Mapping[str, Any], *, where: str) -> str | None:
    """Why adapters described by ``saved`` (:func:`describe_adapters`) cannot load onto ``current`` (None: they
    can)."""
    for key in ("rank", "modules"):
        if saved[key] != current[key]:
            return (f"{where} holds LoRA adapters with {key} {saved[key]!r}; this engine's are {current[key]!r}. "
                    "Resume with the run's actor.lora settings")
    old, new = saved["base_fingerprint"], current["base_fingerprint"]
    if any(not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(old, new, strict=True)):
        return (f"{where} holds LoRA adapters trained on another base model (saved base {saved['base']}, weight "
                f"fingerprint {old}; this engine's base {current['base']}, fingerprint {new}). The adapters only "
                "mean something on the base they were trained on: point model.path at that base")
    return None


@torch.no_grad()
def unload_merged(model: nn.Module) -> None:
    """Replace every :class:`LoRALinear` of an unsharded model by a plain ``nn.Linear`` holding the merged weight (in
    place): the model is then the base architecture, its state dict HF-named (for writing an HF directory)."""
    for name, module in lora_modules(model).items():
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        linear.weight = nn.Parameter(merge_weight(module.weight, module.lora_A, module.lora_B, module.scale),
                                     requires_grad=False)
        linear.bias = module.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear)
