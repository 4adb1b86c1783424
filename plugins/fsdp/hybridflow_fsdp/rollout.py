"""The ``hf`` rollout engine: batched KV-cache generation with an HF causal LM in this process (or tensor-parallel over
a torch.distributed group), weights updated in place from any ``(name, tensor)`` stream (the colocated FSDP actor's,
typically) or bound zero-copy to tensors the caller owns.

Weights only come back through :meth:`HFRolloutEngine.update_weights` after :meth:`~HFRolloutEngine.sleep` /
:meth:`~HFRolloutEngine.wake`; producing them (and resharding) is the training engine's business. Stability: public.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import replace

import torch

from hybridflow.batch import Batch
from hybridflow.engines import RolloutEngineConfig, SamplingParams, TokenCompletion
from hybridflow.errors import ConfigError, EngineError
from hybridflow_fsdp.fast_decode import LeanDecoder, build_lean_decoder, lean_decoder_unsupported_reason
from hybridflow_fsdp.forward import require_columns
from hybridflow_fsdp.kv_reuse import ConversationKVCache
from hybridflow_fsdp.models import build_hf_config, build_model, compute_position_ids
from hybridflow_fsdp.moe import ROUTED_EXPERTS, RouterTap, assemble_routed_experts, find_moe_blocks
from hybridflow_fsdp.sampling import sample_tokens
from hybridflow_fsdp.tensor_parallel import (
    TensorGroup,
    TensorParallelDecoder,
    check_tensor_parallel_model,
    resolve_tensor_group,
    tensor_parallel_shard,
)

__all__ = ["HFRolloutEngine", "build_hf_rollout_engine", "CAPABILITIES"]

CAPABILITIES = frozenset({"sleep", "update_weights_in_memory", "log_probs", "seed", "continue_from_tokens"})
#: ``….lora_A`` / ``….lora_B``: the factor names :meth:`HFRolloutEngine.update_adapters` takes
_FACTORS = ("lora_A", "lora_B")


class HFRolloutEngine:
    """Generation with the model's own forward and a KV cache (stability: public).

    ``sleep()`` drops every parameter's storage (nothing of the weights stays resident between phases); ``wake()``
    allocates nothing: the next ``update_weights`` must cover every parameter before ``generate`` (which raises
    otherwise), each either copied into storage the engine allocates then or, with ``bind=True``, bound zero-copy.

    With ``tensor_parallel_size = tg > 1`` the engine holds this rank's Megatron-style shards (see
    :mod:`hybridflow_fsdp.tensor_parallel`; :meth:`weight_shapes` lists them) in the group of
    ``RolloutEngineConfig.tensor_groups`` (global ranks; every rank builds the engine, as ``new_group`` is collective)
    and every rank of a group, given the same prompts and sampling, returns the same output. ``generate`` is then a
    collective of the group: all its ranks call it together (``extra["lean_decoder"]`` is ignored; the
    tensor-parallel decoder is the only forward).
    """

    capabilities: frozenset[str] = CAPABILITIES

    def __init__(self, *, config: RolloutEngineConfig, device: str = "cpu") -> None:
        tg = int(config.tensor_parallel_size)
        if tg < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1; got {tg}")
        self.config = config
        self.device = torch.device(device)
        attn_implementation = str(config.extra.get("attn_implementation", "sdpa"))
        self.tensor_group: TensorGroup | None = None
        if tg > 1:  # every check before the collective new_group calls, so all ranks fail alike
            check_tensor_parallel_model(build_hf_config(config.model, role="rollout"), tg)
            self.tensor_group = resolve_tensor_group(tg, config.tensor_groups,
                                                     comm=str(config.extra.get("comm", "auto")))
        model = build_model(config.model, role="rollout", attn_implementation=attn_implementation)
        model.requires_grad_(False)
        if self.tensor_group is not None:  # cut on the host, so only this rank's shards reach the device
            reason = lean_decoder_unsupported_reason(model)
            if reason is not None:
                raise ConfigError(f"tensor-parallel generation supports Llama/Qwen2-shaped models only; got {reason}")
            for name, parameter in model.named_parameters():  # a tied embedding/lm_head is one parameter
                parameter.data = tensor_parallel_shard(name, parameter.data, tg, self.tensor_group.rank).clone()
        self.model = model.to(self.device).eval()
        self.decoder: LeanDecoder | None
        if self.tensor_group is not None:
            self.decoder = TensorParallelDecoder(self.model, self.tensor_group)
        else:
            # the lean forward (same logits, a fraction of the per-token overhead) unless disabled or unsupported;
            # an MoE model keeps HF's modules, whose routers the tap records (moe.py)
            moe = bool(find_moe_blocks(self.model))
            self.decoder = (build_lean_decoder(self.model) if config.extra.get("lean_decoder", True) and not moe
                            else None)
        #: MoE models: each generated token's experts per layer, returned as the routed_experts column
        self.router_tap = RouterTap(self.model) if find_moe_blocks(self.model) else None
        self._parameters = dict(self.model.named_parameters())
        self._names = {id(parameter): name for name, parameter in self._parameters.items()}
        self._bound: set[str] = set()  # parameters whose storage is a caller's tensor (update_weights(bind=True))
        self._bind_default = bool(config.extra.get("bind_weights", False))
        self._aliases = {name: tensor for name, tensor in self.model.state_dict(keep_vars=True).items()
                         if isinstance(tensor, torch.nn.Parameter)}
        self._specs = {name: (tuple(p.shape), p.dtype) for name, p in self._parameters.items()}
        self._version = int(config.extra.get("initial_version", 0))
        self._asleep = False
        self._weights_loaded = True
        #: adapter sync: wrapped weight name → its base (a copy of what update_weights loaded), taken at the first
        #: update_adapters after it; emptied by update_weights and sleep
        self._adapter_base: dict[str, torch.Tensor] = {}
        self._calls = 0
        self.last_update_stats: dict[str, float] = {}
        # keys/values kept across generate_from_tokens calls (multi-turn): the lean decoder continues from them
        # (not yet at tg > 1, untested there)
        reuse = (bool(config.extra.get("kv_cache_reuse", True)) and self.decoder is not None
                 and self.tensor_group is None)
        self._kv_reuse = reuse
        self._kv_cache = ConversationKVCache(max_bytes=int(config.extra.get("kv_cache_max_bytes", 2 << 30)))
        self.capabilities = CAPABILITIES | ({"kv_cache_reuse"} if reuse else set())

    @property
    def weights_version(self) -> int:
        return self._version

    def resolved_options(self) -> dict[str, object]:
        """What this engine chose where its config said ``auto`` (the run manifest's ``engine_options``)."""
        tg = 1 if self.tensor_group is None else self.tensor_group.size
        decoder = ("none" if self.decoder is None else
                   "tensor_parallel" if self.tensor_group is not None else "lean")
        comm = None if self.tensor_group is None else ("shm" if self.tensor_group.channel is not None else "gloo")
        return {"dtype": str(next(iter(self._parameters.values())).dtype).removeprefix("torch."),
                "tensor_parallel_size": tg, "decoder": decoder, "comm": comm, "kv_cache_reuse": self._kv_reuse}

    @property
    def moe_layers(self) -> int:
        """The model's MoE layers whose routing ``generate`` records (capability ``records_routing``; 0: dense)."""
        return 0 if self.router_tap is None else self.router_tap.num_layers

    @property
    def tensor_rank(self) -> int:
        """This rank's index in its tensor group (0 at tg = 1)."""
        return 0 if self.tensor_group is None else self.tensor_group.rank

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every name ``update_weights`` accepts (tied aliases included) with the shape it expects on this rank:
        this rank's tensor-parallel shard at tg > 1 (:func:`~hybridflow_fsdp.tensor_parallel.tensor_parallel_shard`
        cuts it from the full tensor)."""
        return {name: self._specs[self._names[id(parameter)]][0] for name, parameter in self._aliases.items()}

    def _held_bytes(self, *, owned_only: bool) -> int:
        seen: set[tuple[int, int]] = set()
        for name, parameter in self._parameters.items():
            if parameter.numel() and not (owned_only and name in self._bound):
                seen.add((parameter.data_ptr(), parameter.numel() * parameter.element_size()))
        return sum(size for _, size in seen)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors holding the generation weights now, bound or owned (capability ``holds_weights``), and the
        base copies adapter sync keeps (:meth:`update_adapters`)."""
        return [*self.model.parameters(), *self._adapter_base.values()]

    def resident_weight_bytes(self) -> int:
        """Bytes of the parameters held now, bound or owned, each distinct tensor once (0 while asleep)."""
        return self._held_bytes(owned_only=False)

    def owned_weight_bytes(self) -> int:
        """Bytes of parameter storage the engine allocated itself (0 when every parameter is bound)."""
        return self._held_bytes(owned_only=True)

    # --- generation -----------------------------------------------------------------------------------------
    def _require_weights(self, method: str) -> None:
        if self._asleep or not self._weights_loaded:
            raise EngineError(
                f"{method}() needs weights: the engine is "
                + ("asleep; call wake() then update_weights(...)" if self._asleep else
                   "awake but its weights were freed by sleep(); call update_weights(...) with the full weights")
            )

    def _generator(self, sampling: SamplingParams) -> torch.Generator:
        seed = sampling.seed if sampling.seed is not None else self.config.seed + self._calls
        self._calls += 1
        return torch.Generator().manual_seed(int(seed))

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = (),
                             cache_keys: Sequence[Hashable] | None = None) -> list[TokenCompletion]:
        """Continue each id list (capability ``continue_from_tokens``): the prefixes are left-padded into one batch,
        prefilled and sampled together; each row's ids are returned up to and including its stop token.

        ``cache_keys`` (capability ``kv_cache_reuse``, one key per row, e.g. a conversation id): the keys/values of
        each row are kept under its key after the call, and a later call with that key whose prefix extends the
        kept ids prefills only the ids after them (the same logits as a full prefill; ``kv_cache_stats`` counts
        prefilled and reused ids). :meth:`release_cache` frees entries; new weights and ``sleep`` drop them all."""
        self._require_weights("generate_from_tokens")
        if not prompts:
            return []
        if any(len(prompt) == 0 for prompt in prompts):
            raise ConfigError("generate_from_tokens got an empty prefix; every conversation starts with its prompt")
        if cache_keys is not None and len(cache_keys) != len(prompts):
            raise ConfigError(f"generate_from_tokens got {len(cache_keys)} cache_keys for {len(prompts)} prefixes; "
                              "give one key per prefix (or none)")
        keep = self._kv_reuse and cache_keys is not None
        past, reused = None, [0] * len(prompts)
        if keep:
            assert cache_keys is not None
            with torch.inference_mode():
                past, reused = self._kv_cache.take(cache_keys, prompts, device=self.device,
                                                   dtype=next(iter(self._parameters.values())).dtype)
        else:
            self._kv_cache.stats["prefill_tokens"] += sum(len(prompt) for prompt in prompts)
        suffixes = [prompt[n:] for prompt, n in zip(prompts, reused)]
        width = max(len(suffix) for suffix in suffixes)
        input_ids = torch.full((len(prompts), width), self.config.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, suffix in enumerate(suffixes):
            input_ids[row, width - len(suffix):] = torch.as_tensor(list(suffix), dtype=torch.long)
            attention_mask[row, width - len(suffix):] = 1
        try:
            sampled = sample_tokens(self.model, input_ids.to(self.device), attention_mask.to(self.device),
                                    sampling=replace(sampling, n=1), eos_token_id=self.config.eos_token_id,
                                    pad_token_id=self.config.pad_token_id, generator=self._generator(sampling),
                                    decoder=self.decoder, stop_token_ids=tuple(int(t) for t in stop_token_ids),
                                    past=past, keep_cache=keep)
            stops = {self.config.eos_token_id, *(int(t) for t in stop_token_ids)}
            completions = []
            for row in range(len(prompts)):
                length = int(sampled.response_mask[row].sum())
                ids = tuple(int(t) for t in sampled.responses[row, :length].tolist())
                completions.append(TokenCompletion(
                    token_ids=ids, log_probs=tuple(float(x) for x in sampled.log_probs[row, :length].tolist()),
                    finish_reason="stop" if ids and ids[-1] in stops else "length"))
            if keep:
                assert cache_keys is not None and self.decoder is not None
                with torch.inference_mode():
                    self._kv_cache.store(cache_keys, prompts, [c.token_ids for c in completions], self.decoder)
        finally:
            if keep and self.decoder is not None:
                self.decoder.release()
        return completions

    @property
    def kv_cache_stats(self) -> dict[str, int]:
        """Counters of ``generate_from_tokens`` (see :class:`~hybridflow_fsdp.kv_reuse.ConversationKVCache`:
        ``prefill_tokens`` counts with reuse off too), plus the entries and bytes held now."""
        return {**self._kv_cache.stats, "entries": len(self._kv_cache), "held_bytes": self._kv_cache.held_bytes}

    def release_cache(self, keys: Iterable[Hashable] | None = None) -> None:
        """Free the kept keys/values of ``keys`` (every entry when None): a conversation that ended."""
        self._kv_cache.release(keys)

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt (rows repeated interleaved); columns as in hybridflow.engines."""
        self._require_weights("generate")
        require_columns(batch, "input_ids", "attention_mask", method="generate")
        if batch["input_ids"].shape[1] > self.config.max_prompt_length:
            raise ConfigError(
                f"prompts are {batch['input_ids'].shape[1]} tokens wide; this engine was built for max_prompt_length="
                f"{self.config.max_prompt_length}. Truncate the prompts or raise rollout max_prompt_length."
            )
        prompts = batch.repeat_interleave(sampling.n) if sampling.n > 1 else batch
        generator = self._generator(sampling)
        if self.router_tap is not None:
            self.router_tap.start_recording()
        # each distinct prompt is prefilled once and shared by its n samples
        try:
            sampled = sample_tokens(self.model, batch["input_ids"].to(self.device),
                                    batch["attention_mask"].to(self.device), sampling=sampling,
                                    eos_token_id=self.config.eos_token_id, pad_token_id=self.config.pad_token_id,
                                    generator=generator, decoder=self.decoder, repeats=sampling.n)
        except BaseException:
            if self.router_tap is not None:  # a failed call leaves nothing recorded for the next one
                self.router_tap.stop_recording()
            raise
        prompt_ids = prompts["input_ids"].to(self.device)
        prompt_mask = prompts["attention_mask"].to(self.device)
        prompt_positions = compute_position_ids(prompt_mask)
        steps = torch.arange(1, sampled.responses.shape[1] + 1, device=self.device)
        response_positions = prompt_positions[:, -1:] + steps.unsqueeze(0)
        columns = {
            "prompts": prompt_ids,
            "responses": sampled.responses,
            "input_ids": torch.cat([prompt_ids, sampled.responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, sampled.response_mask.to(prompt_mask.dtype)], dim=1),
            "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
            "response_mask": sampled.response_mask,
            "rollout_log_probs": sampled.log_probs,
        }
        if self.router_tap is not None:  # the experts of every prompt and fed-back response token, per MoE layer
            columns[ROUTED_EXPERTS] = assemble_routed_experts(
                self.router_tap.stop_recording(), rows=len(prompts), prompt_width=prompt_ids.shape[1],
                response_width=sampled.responses.shape[1], attention_mask=columns["attention_mask"])
        # a new column container: the caller's batch is never modified
        output = Batch(prompts.tensors.clone(recurse=False), dict(prompts.non_tensors),
                       {**prompts.meta, "policy_version": self._version})
        for name, tensor in columns.items():
            output[name] = tensor.cpu()
        return output

    # --- weights --------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                       bind: bool | None = None) -> None:
        """Load each ``(HF name, tensor)`` as it arrives (streams welcome): at tg > 1 the tensor is this rank's shard.

        A tensor is copied into storage the engine owns (allocated now if the parameter has none, e.g. after
        ``wake()``, or is bound), or with ``bind`` (default ``extra["bind_weights"]``, False) becomes the parameter's
        storage without a copy when its dtype and device match: the caller then owns that memory, and changing the
        tensor changes the engine's weight until ``sleep()`` or the next update drops the reference. A bound tensor
        must stay valid (not be reused for another parameter) until then. After ``wake()`` every parameter must be
        in the stream. Records ``version`` as ``weights_version``.
        """
        if self._asleep:
            raise EngineError("update_weights() on a sleeping engine: call wake() first, then update_weights(...)")
        bind = self._bind_default if bind is None else bind
        started = time.perf_counter()
        seen: set[int] = set()
        copied = bound = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._aliases.get(name)
                if target is None:
                    known = ", ".join(list(self._parameters)[:6])
                    raise EngineError(
                        f"update_weights got unknown parameter {name!r}; expected Hugging Face names of "
                        f"{type(self.model).__name__} such as {known}, ... (use target='hf' on the training side)"
                    )
                canonical = self._names[id(target)]
                shape, dtype = self._specs[canonical]
                if tuple(tensor.shape) != shape:
                    where = "" if self.tensor_group is None else (
                        f" (this rank's tensor-parallel shard, tg={self.tensor_group.size}, tensor rank "
                        f"{self.tensor_group.rank}: cut it with hybridflow_fsdp.tensor_parallel.tensor_parallel_shard)")
                    raise EngineError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine expects "
                        f"{shape}{where}; the training and rollout models differ (check both model configs)"
                    )
                nbytes = tensor.numel() * tensor.element_size()
                if bind and tensor.dtype == dtype and _same_device(tensor.device, self.device):
                    target.data = tensor.detach()
                    self._bound.add(canonical)
                    bound += nbytes
                else:
                    if canonical in self._bound or tuple(target.shape) != shape:  # never write into a caller's tensor
                        target.data = torch.empty(shape, dtype=dtype, device=self.device)
                        self._bound.discard(canonical)
                    target.copy_(tensor)
                    copied += nbytes
                seen.add(id(target))
        missing = [name for name, p in self._parameters.items() if id(p) not in seen]
        if not self._weights_loaded and missing:
            raise EngineError(
                f"after wake() update_weights must cover every parameter; missing {missing[:6]}"
                f"{' ...' if len(missing) > 6 else ''} ({len(missing)} of {len(self._parameters)})"
            )
        self._weights_loaded = True
        self._adapter_base.clear()  # the weights just loaded are the base the next adapters apply to
        self._version = int(version)
        self.release_cache()  # kept keys/values were computed with the old weights
        self.last_update_stats = {"bytes_copied": float(copied), "bytes_bound": float(bound),
                                  "seconds": time.perf_counter() - started, "parameters": float(len(seen))}

    def update_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, scales: Mapping[str, float],
                        version: int) -> None:
        """Adapter-only weight sync (:mod:`hybridflow.adapter_sync`): set each wrapped module's weight to
        ``base + B·A·scale`` (fp32 math, the training side's :func:`~hybridflow_fsdp.lora.merge_weight`) from the
        factors ``{module}.lora_A`` [rank, in] / ``{module}.lora_B`` [out, rank] of every module in ``scales``.

        The base is what the last :meth:`update_weights` loaded: the first call after it keeps a copy of each wrapped
        weight (the targeted weights' bytes, once), later calls merge into the weights from that copy, so nothing
        drifts however many syncs run. Merging rather than adding ``x·Aᵀ·Bᵀ`` in the forward keeps the lean decoder's
        packed matmuls (it reads the modules' weights) and costs nothing per token; per sync it costs one
        ``out×rank×in`` product per module. Records ``version`` as ``weights_version``.
        """
        from hybridflow_fsdp.lora import merge_weight

        if self._asleep or not self._weights_loaded:
            raise EngineError("update_adapters() needs the base weights loaded: after wake() call "
                              "update_weights(base weights) first, then update_adapters(...)")
        started = time.perf_counter()
        factors = dict(named_tensors)
        received = sum(t.numel() * t.element_size() for t in factors.values())
        expected = {f"{module}.{factor}" for module in scales for factor in _FACTORS}
        if set(factors) != expected:
            missing, unknown = sorted(expected - set(factors)), sorted(set(factors) - expected)
            raise EngineError(f"update_adapters: expected lora_A and lora_B of each of the {len(scales)} modules in "
                              f"scales; missing {missing[:4]}, unexpected {unknown[:4]} (send every factor of "
                              "generation_adapters() with its engine's adapter_scales())")
        with torch.no_grad():
            for module, scale in scales.items():
                name = f"{module}.weight"
                target = self._aliases.get(name)
                if target is None:
                    raise EngineError(f"update_adapters: scales name module {module!r}, but {name!r} is not a "
                                      f"parameter of {type(self.model).__name__}; expected the HF names of the "
                                      "training model's wrapped linear layers")
                if self._names[id(target)] in self._bound:
                    raise EngineError(f"update_adapters: {name!r} is bound to a caller's tensor; adapters merge into "
                                      "weights this engine owns: load the base with update_weights(..., bind=False)")
                lora_a, lora_b = factors[f"{module}.lora_A"], factors[f"{module}.lora_B"]
                if lora_a.shape[1] != target.shape[1] or lora_b.shape[0] != target.shape[0] or \
                        lora_a.shape[0] != lora_b.shape[1]:
                    raise EngineError(f"update_adapters: {module} has lora_A {tuple(lora_a.shape)} and lora_B "
                                      f"{tuple(lora_b.shape)}; its weight is {tuple(target.shape)}, so expected "
                                      f"[rank, {target.shape[1]}] and [{target.shape[0]}, rank]")
                base = self._adapter_base.setdefault(name, target.detach().clone())
                target.copy_(merge_weight(base, lora_a.to(self.device), lora_b.to(self.device), float(scale)))
        self._version = int(version)
        self.release_cache()
        self.last_update_stats = {"bytes_copied": float(received), "bytes_bound": 0.0,
                                  "seconds": time.perf_counter() - started, "parameters": float(len(scales))}

    def sleep(self) -> None:
        """Drop every parameter's storage, bound tensors' references included, and the keys/values kept for
        conversations (the generation KV cache lives only inside a call)."""
        if self.decoder is not None:
            self.decoder.release()
        self.release_cache()
        for parameter in self._parameters.values():
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=self.device)
        self._bound.clear()
        self._adapter_base.clear()
        self._asleep = True
        self._weights_loaded = False

    def wake(self) -> None:
        """Leave sleep without allocating: the next ``update_weights`` provides every parameter (copied into storage
        allocated then, or bound) before ``generate``."""
        self._asleep = False


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device, an index-less ``cuda`` meaning the current one."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index or a.index is None or b.index is None


def build_hf_rollout_engine(*, config: RolloutEngineConfig, device: str = "cpu") -> HFRolloutEngine:
    """Factory registered as rollout engine ``"hf"``."""
    return HFRolloutEngine(config=config, device=device)
