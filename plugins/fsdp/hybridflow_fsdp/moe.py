"""Mixture-of-experts routers of HF models: find them, record each token's top-k experts, replay given ones (rollout
routing replay, R3), and the router's losses (Switch load balancing, ST-MoE z-loss) and load metrics.

It works on the routers of transformers' MoE blocks (a ``gate`` returning ``(logits, scores, indices)`` with
``top_k``/``num_experts``, and ``experts`` called with those indices: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) through
forward hooks, so the HF modules run unchanged. Which rows a forward computes and how the recorded indices reach it
(the ``routed_experts`` column, in the rollout's ``input_ids`` layout) are the engines' business. Stability: developer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from hybridflow.errors import EngineError

__all__ = ["ROUTED_EXPERTS", "NOT_RECORDED", "ROUTER_REPLAY_MODES", "MoEBlock", "RouterTap", "RoutingPass",
           "find_moe_blocks", "assemble_routed_experts", "compute_load_balancing_loss", "compute_z_loss",
           "compute_routing_metrics", "replay_scores"]

#: the batch column of recorded routing: [B, T, L, K] expert ids (int16) over the ``input_ids`` positions, per MoE
#: layer L and top-k slot K (verl's and NeMo-RL's name for it)
ROUTED_EXPERTS = "routed_experts"
#: an id meaning "not recorded" (padding, and the last response token, which generation never feeds back)
NOT_RECORDED = -1
#: ``actor.router_replay.mode`` (verl's names): ``disabled`` routes with the training router and only measures the
#: flips; ``R3`` replays the rollout's recorded experts (verl's R2, replaying the old-log-prob pass, is not built)
ROUTER_REPLAY_MODES = ("disabled", "R3")


@dataclass(frozen=True, slots=True)
class MoEBlock:
    """One sparse MoE layer: its router (``gate``) and its experts module, and its index among the MoE layers."""

    layer: int
    router: nn.Module
    experts: nn.Module

    @property
    def top_k(self) -> int:
        return int(cast(Any, self.router).top_k)

    @property
    def num_experts(self) -> int:
        return int(cast(Any, self.router).num_experts)


def _is_router(module: Any) -> bool:
    return isinstance(module, nn.Module) and all(hasattr(module, name) for name in ("top_k", "num_experts", "weight"))


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's sparse MoE blocks in layer order (empty for a dense model)."""
    blocks: list[MoEBlock] = []
    for module in model.modules():
        router, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if _is_router(router) and isinstance(experts, nn.Module):
            assert router is not None
            blocks.append(MoEBlock(layer=len(blocks), router=router, experts=experts))
    return blocks


def replay_scores(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The routing weights of experts ``indices`` [N, K] from the router's ``logits`` [N, E], as the router computes
    them for its own choice: softmax over all experts, the chosen ones' probabilities (renormalised unless the
    router's ``norm_topk_prob`` is false). Gradients flow into the router through the logits."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(1, indices.long())
    if bool(getattr(router, "norm_topk_prob", True)):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


@dataclass(slots=True)
class RoutingPass:
    """What one forward's routers did: per MoE layer the router logits and its own top-k (for the losses), and the
    counts of compared tokens whose experts differ from the recorded ones."""

    logits: list[torch.Tensor] = field(default_factory=list)
    own: list[torch.Tensor] = field(default_factory=list)
    #: tokens compared with a recording (response tokens the rollout recorded)
    compared: int = 0
    #: of those, tokens whose experts, in any MoE layer, differ from the recording: the experts the forward used
    flipped: int = 0
    #: ... and the experts the training router chose itself (equal to ``flipped`` without replay)
    flipped_own: int = 0


class RouterTap:
    """Forward hooks on every MoE block of a model: record the experts each token is routed to, replay given ones,
    keep the router logits of a training forward, and compare with a recording (stability: developer).

    Outside :meth:`begin` / :meth:`end` the hooks do nothing but record when ``recording`` is on.
    """

    def __init__(self, model: nn.Module) -> None:
        self.blocks = find_moe_blocks(model)
        self.recording = False
        #: per MoE layer, the top-k indices of each router call while recording, in call order
        self.records: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        self._active: RoutingPass | None = None
        self._targets: torch.Tensor | None = None  # [N, L, K] in the router's token order
        self._compare: torch.Tensor | None = None  # [N] bool: tokens counted in the flip metric
        self._replay = False
        self._keep_logits = False
        self._valid: torch.Tensor | None = None
        self._differs_used: torch.Tensor | None = None
        self._differs_own: torch.Tensor | None = None
        self._handles: list[Any] = []
        for block in self.blocks:
            self._handles.append(block.router.register_forward_hook(self._router_hook(block)))
            self._handles.append(block.experts.register_forward_pre_hook(self._experts_hook(block)))

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def top_k(self) -> int:
        return self.blocks[0].top_k if self.blocks else 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- recording (generation) ---------------------------------------------------------------------------------
    def start_recording(self) -> None:
        self.records = [[] for _ in self.blocks]
        self.recording = True

    def stop_recording(self) -> list[list[torch.Tensor]]:
        self.recording = False
        records, self.records = self.records, [[] for _ in self.blocks]
        return records

    # --- one forward (training engine) --------------------------------------------------------------------------
    def begin(self, targets: torch.Tensor | None, compare: torch.Tensor | None, *, replay: bool,
              keep_logits: bool, valid: torch.Tensor | None = None) -> None:
        """Arm the hooks for one forward over N router tokens: ``targets`` [N, L, K] recorded experts
        (:data:`NOT_RECORDED` where none), replayed when ``replay`` (unrecorded tokens keep the router's choice);
        ``compare`` [N] the tokens counted in the flip metric; ``keep_logits`` keeps the router logits (with
        gradients) and own top-k of the ``valid`` [N] tokens (all when None) for the losses and load metrics."""
        if targets is not None and (targets.dim() != 3 or targets.shape[1] != self.num_layers
                                    or targets.shape[2] != self.top_k):
            raise EngineError(f"recorded routing has shape {tuple(targets.shape)}; this model routes "
                              f"[tokens, {self.num_layers} MoE layers, top-{self.top_k}]: the rollout and training "
                              "models differ (check both model configs)")
        self._active = RoutingPass()
        self._targets, self._compare = targets, compare
        self._replay = replay and targets is not None
        self._keep_logits = keep_logits
        self._valid = valid
        self._differs_used = self._differs_own = None

    def end(self) -> RoutingPass:
        """Disarm the hooks; the pass's logits, own choices and flip counts."""
        routing = self._active if self._active is not None else RoutingPass()
        if self._compare is not None and self._differs_used is not None and self._differs_own is not None:
            routing.compared = int(self._compare.sum())
            routing.flipped = int((self._differs_used & self._compare).sum())
            routing.flipped_own = int((self._differs_own & self._compare).sum())
        self._active = None
        self._targets = self._compare = self._valid = None
        self._differs_used = self._differs_own = None
        return routing

    def _target(self, block: MoEBlock, tokens: int) -> torch.Tensor | None:
        if self._targets is None:
            return None
        if self._targets.shape[0] != tokens:
            raise EngineError(f"recorded routing covers {self._targets.shape[0]} tokens but MoE layer {block.layer}'s "
                              f"router got {tokens}: the routed_experts column does not line up with input_ids")
        return self._targets[:, block.layer]

    def _router_hook(self, block: MoEBlock) -> Callable[..., Any]:
        def hook(router: nn.Module, inputs: Any, output: Any) -> Any:
            if self._active is None:
                if self.recording:
                    self.records[block.layer].append(output[2].detach().to(torch.int16))
                return None
            logits, scores, own = output
            target = self._target(block, own.shape[0])
            if self._keep_logits:
                valid = self._valid
                self._active.logits.append(logits if valid is None else logits[valid.to(logits.device)])
                self._active.own.append(own.detach() if valid is None else own.detach()[valid.to(own.device)])
            if target is None:
                return None
            recorded = target[:, 0] >= 0
            target = target.to(own.device)
            differs = (torch.sort(own, dim=-1).values != torch.sort(target.to(own.dtype), dim=-1).values).any(-1)
            differs &= recorded.to(own.device)
            self._differs_own = differs if self._differs_own is None else self._differs_own | differs
            if not self._replay:
                return None
            chosen = torch.where(recorded.to(own.device)[:, None], target.to(own.dtype), own)
            return logits, replay_scores(router, logits, chosen, scores.dtype), chosen
        return hook

    def _experts_hook(self, block: MoEBlock) -> Callable[..., Any]:
        def hook(experts: nn.Module, args: Any) -> None:
            if self._active is None or self._targets is None or len(args) < 2:
                return
            used = args[1]
            target = self._targets[:, block.layer].to(used.device)
            if target.shape[0] != used.shape[0]:
                return  # the router hook raised already for a mismatch; nothing to compare here
            differs = (torch.sort(used, dim=-1).values != torch.sort(target.to(used.dtype), dim=-1).values).any(-1)
            differs &= target[:, 0] >= 0
            self._differs_used = differs if self._differs_used is None else self._differs_used | differs
        return hook


def assemble_routed_experts(records: Sequence[Sequence[torch.Tensor]], *, rows: int, prompt_width: int,
                            response_width: int, attention_mask: torch.Tensor) -> torch.Tensor:
    """The ``routed_experts`` column [rows, P + R, L, K] from a sampling loop's router calls: per MoE layer, the
    prefill's [rows·P, K] then one [rows, K] per decode step (the response token fed at that step: response token j
    sits at position P + j). Positions with ``attention_mask`` [rows, P + R] 0 and the last sampled token (never fed
    back) hold :data:`NOT_RECORDED`."""
    layers = len(records)
    if layers == 0:
        raise ValueError("assemble_routed_experts needs at least one MoE layer's records")
    top_k = int(records[0][0].shape[-1])
    column = torch.full((rows, prompt_width + response_width, layers, top_k), NOT_RECORDED, dtype=torch.int16)
    steps = len(records[0])
    for layer, calls in enumerate(records):
        if len(calls) != steps or steps > response_width:
            raise EngineError(f"MoE layer {layer} routed {len(calls)} forwards, layer 0 {steps}, in a generation of "
                              f"{response_width} tokens: expected one prefill and a step per token fed back")
        column[:, :prompt_width, layer] = calls[0].reshape(rows, prompt_width, top_k).cpu()
        for step, call in enumerate(calls[1:]):
            column[:, prompt_width + step, layer] = call.reshape(rows, top_k).cpu()
    column[~attention_mask.bool().cpu()] = NOT_RECORDED
    return column


def compute_load_balancing_loss(logits: torch.Tensor, own: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Megatron's Switch load-balancing loss of one MoE layer (``switch_load_balancing_loss_func``, coefficient 1):
    E / (k·T²) · Σ_e (Σ_t p_te)·c_e over T tokens, with p the router's softmax and c_e the tokens whose top-k (the
    router's own, ``own`` [T, k]) holds expert e. 1.0 when the load and the probabilities are uniform."""
    tokens, top_k = own.shape
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, own.reshape(-1).long(), torch.ones(tokens * top_k, device=logits.device))
    return (probs.sum(0) * counts).sum() * (num_experts / (top_k * tokens * tokens))


def compute_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Megatron's router z-loss of one MoE layer (ST-MoE; ``z_loss_func``, coefficient 1): the mean over tokens of
    logsumexp(logits)²."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def compute_routing_metrics(routing: Sequence[RoutingPass], blocks: Sequence[MoEBlock],
                            prefix: str) -> dict[str, float]:
    """Per MoE layer l, over the passes' tokens: ``{prefix}/moe/expert_load_max/layer_{l}`` and ``..._min`` (share
    of the layer's top-k assignments its busiest / idlest expert took; 1/E when balanced) and
    ``{prefix}/moe/load_imbalance/layer_{l}`` (max over mean assignments per expert: 1.0 when balanced, E/k when
    every token takes the same k experts), their means over layers, and ``{prefix}/router_flip_ratio`` (share of
    compared tokens whose experts in the forward differ from the rollout's in any MoE layer) with
    ``{prefix}/router_flip_ratio_own`` (the training router's own choice against the rollout's, replayed or not)."""
    metrics: dict[str, float] = {}
    if not blocks:
        return metrics
    imbalance = []
    for block in blocks:
        counts = torch.zeros(block.num_experts)
        for routing_pass in routing:
            if block.layer < len(routing_pass.own):
                own = routing_pass.own[block.layer].reshape(-1).long().cpu()
                counts += torch.bincount(own, minlength=block.num_experts).float()
        total = float(counts.sum())
        if total == 0:
            continue
        share = counts / total
        metrics[f"{prefix}/moe/expert_load_max/layer_{block.layer}"] = float(share.max())
        metrics[f"{prefix}/moe/expert_load_min/layer_{block.layer}"] = float(share.min())
        imbalance.append(float(counts.max() / counts.mean()))
        metrics[f"{prefix}/moe/load_imbalance/layer_{block.layer}"] = imbalance[-1]
    if imbalance:
        metrics[f"{prefix}/moe/load_imbalance"] = sum(imbalance) / len(imbalance)
    compared = sum(routing_pass.compared for routing_pass in routing)
    if compared:
        metrics[f"{prefix}/router_flip_ratio"] = sum(p.flipped for p in routing) / compared
        metrics[f"{prefix}/router_flip_ratio_own"] = sum(p.flipped_own for p in routing) / compared
    return metrics
