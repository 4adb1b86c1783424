"""The ``hf`` rollout engine: batched KV-cache generation with an HF causal LM in this process, weights updated in
place from any ``(name, tensor)`` stream (the colocated FSDP actor's, typically).

Weights only come back through :meth:`HFRolloutEngine.update_weights` after :meth:`~HFRolloutEngine.sleep` /
:meth:`~HFRolloutEngine.wake`; producing them (and resharding) is the training engine's business. Stability: public.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from hybridflow.batch import Batch
from hybridflow.engines import RolloutEngineConfig, SamplingParams, TokenCompletion
from hybridflow.errors import ConfigError, EngineError
from hybridflow_fsdp.fast_decode import build_lean_decoder
from hybridflow_fsdp.forward import require_columns
from hybridflow_fsdp.models import build_model, compute_position_ids
from hybridflow_fsdp.sampling import sample_tokens

__all__ = ["HFRolloutEngine", "build_hf_rollout_engine", "CAPABILITIES"]

CAPABILITIES = frozenset({"sleep", "update_weights_in_memory", "log_probs", "seed", "continue_from_tokens"})


class HFRolloutEngine:
    """Generation with the model's own forward and a KV cache (stability: public).

    ``sleep()`` frees the storage of every parameter (nothing of the weights stays resident between phases);
    ``wake()`` allocates it again *uninitialised*: call ``update_weights`` with the full weights before the next
    ``generate`` (which raises otherwise).
    """

    capabilities: frozenset[str] = CAPABILITIES

    def __init__(self, *, config: RolloutEngineConfig, device: str = "cpu") -> None:
        if config.tensor_parallel_size != 1:
            raise ConfigError(
                f"the hf rollout engine holds the whole model on one rank (tg=1); got tensor_parallel_size="
                f"{config.tensor_parallel_size}. Use the vllm or sglang engine for tensor-parallel generation."
            )
        self.config = config
        self.device = torch.device(device)
        model = build_model(config.model, role="rollout",
                            attn_implementation=str(config.extra.get("attn_implementation", "sdpa")))
        model.requires_grad_(False)
        self.model = model.to(self.device).eval()
        # the lean forward (same logits, a fraction of the per-token overhead) unless disabled or unsupported
        self.decoder = build_lean_decoder(self.model) if config.extra.get("lean_decoder", True) else None
        self._parameters = dict(self.model.named_parameters())
        self._aliases = {name: tensor for name, tensor in self.model.state_dict(keep_vars=True).items()
                         if isinstance(tensor, torch.nn.Parameter)}
        self._specs = {name: (tuple(p.shape), p.dtype) for name, p in self._parameters.items()}
        self._version = int(config.extra.get("initial_version", 0))
        self._asleep = False
        self._weights_loaded = True
        self._calls = 0
        self.last_update_stats: dict[str, float] = {}

    @property
    def weights_version(self) -> int:
        return self._version

    def _resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._parameters.values())

    def resident_weight_bytes(self) -> int:
        """Bytes of parameter storage held now (0 while asleep)."""
        return self._resident_bytes()

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
                             stop_token_ids: Sequence[int] = ()) -> list[TokenCompletion]:
        """Continue each id list (capability ``continue_from_tokens``): the prefixes are left-padded into one batch,
        prefilled and sampled together; each row's ids are returned up to and including its stop token.

        The KV cache is rebuilt from the whole prefix on every call (no cross-turn cache reuse yet)."""
        self._require_weights("generate_from_tokens")
        if not prompts:
            return []
        if any(len(prompt) == 0 for prompt in prompts):
            raise ConfigError("generate_from_tokens got an empty prefix; every conversation starts with its prompt")
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.config.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        sampled = sample_tokens(self.model, input_ids.to(self.device), attention_mask.to(self.device),
                                sampling=replace(sampling, n=1), eos_token_id=self.config.eos_token_id,
                                pad_token_id=self.config.pad_token_id, generator=self._generator(sampling),
                                decoder=self.decoder, stop_token_ids=tuple(int(t) for t in stop_token_ids))
        stops = {self.config.eos_token_id, *(int(t) for t in stop_token_ids)}
        completions = []
        for row in range(len(prompts)):
            length = int(sampled.response_mask[row].sum())
            ids = tuple(int(t) for t in sampled.responses[row, :length].tolist())
            completions.append(TokenCompletion(
                token_ids=ids, log_probs=tuple(float(x) for x in sampled.log_probs[row, :length].tolist()),
                finish_reason="stop" if ids and ids[-1] in stops else "length"))
        return completions

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
        # each distinct prompt is prefilled once and shared by its n samples
        sampled = sample_tokens(self.model, batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device),
                                sampling=sampling, eos_token_id=self.config.eos_token_id,
                                pad_token_id=self.config.pad_token_id, generator=generator, decoder=self.decoder,
                                repeats=sampling.n)
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
        # a new column container: the caller's batch is never modified
        output = Batch(prompts.tensors.clone(recurse=False), dict(prompts.non_tensors),
                       {**prompts.meta, "policy_version": self._version})
        for name, tensor in columns.items():
            output[name] = tensor.cpu()
        return output

    # --- weights --------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy each ``(HF name, full tensor)`` into the resident parameter as it arrives (streams welcome).

        After ``wake()`` every parameter must be in the stream. Records ``version`` as ``weights_version``.
        """
        if self._asleep:
            raise EngineError("update_weights() on a sleeping engine: call wake() first, then update_weights(...)")
        started = time.perf_counter()
        seen: set[int] = set()
        copied = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._aliases.get(name)
                if target is None:
                    known = ", ".join(list(self._parameters)[:6])
                    raise EngineError(
                        f"update_weights got unknown parameter {name!r}; expected Hugging Face names of "
                        f"{type(self.model).__name__} such as {known}, ... (use target='hf' on the training side)"
                    )
                if tuple(tensor.shape) != tuple(target.shape):
                    raise EngineError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine expects "
                        f"{tuple(target.shape)}; the training and rollout models differ (check both model configs)"
                    )
                target.copy_(tensor)
                seen.add(id(target))
                copied += tensor.numel() * tensor.element_size()
        missing = [name for name, p in self._parameters.items() if id(p) not in seen]
        if not self._weights_loaded and missing:
            raise EngineError(
                f"after wake() update_weights must cover every parameter; missing {missing[:6]}"
                f"{' ...' if len(missing) > 6 else ''} ({len(missing)} of {len(self._parameters)})"
            )
        self._weights_loaded = True
        self._version = int(version)
        self.last_update_stats = {"bytes_copied": float(copied), "seconds": time.perf_counter() - started,
                                  "parameters": float(len(seen))}

    def sleep(self) -> None:
        """Free every parameter's storage (the KV cache lives only inside ``generate``)."""
        for parameter in self._parameters.values():
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=self.device)
        self._asleep = True
        self._weights_loaded = False

    def wake(self) -> None:
        """Allocate parameter storage again, uninitialised; ``update_weights`` must follow before ``generate``."""
        if not self._asleep:
            return
        for name, parameter in self._parameters.items():
            shape, dtype = self._specs[name]
            parameter.data = torch.empty(shape, dtype=dtype, device=self.device)
        self._asleep = False


def build_hf_rollout_engine(*, config: RolloutEngineConfig, device: str = "cpu") -> HFRolloutEngine:
    """Factory registered as rollout engine ``"hf"``."""
    return HFRolloutEngine(config=config, device=device)
