"""Partial rollout (``rollout.partial_rollout``, docs/guide/async.md): a rollout generated in segments of at most
``rollout.partial_rollout_tokens`` new tokens, each continuing every unfinished row from its prompt and the tokens
so far, so that weights synced while the generation is in flight are loaded between two segments and the rest of
the response is sampled under them (AReaL / PipelineRL style). Every token keeps the version of the weights that
produced it (:data:`TOKEN_VERSIONS`) and its log-prob under them (``rollout_log_probs``).

:class:`SegmentedRollout` is the bookkeeping of one generation call (which rows go on, with what prefix, for how
many tokens; the rollout columns at the end); :class:`WeightMailbox` is where the driver posts each weight export
as it dispatches it, so a rollout worker busy generating can find it. Running the segments and loading the weights
is :class:`~hybridflow.workers.rollout.RolloutWorker`'s business; bounding the staleness of what is trained on is
:mod:`hybridflow.trainer.async_loop`'s. Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.columns import compute_position_ids
from hybridflow.engines import TokenCompletion
from hybridflow.errors import EngineError

__all__ = ["TOKEN_VERSIONS", "SEGMENT_SEED_STRIDE", "SegmentedRollout", "WeightMailbox", "start_weight_mailbox",
           "unpadded_prompts"]

#: per-token column of a partial rollout: the policy version of the weights that sampled each response token (-1 on
#: padding), [rows, max_new_tokens] like ``responses``
TOKEN_VERSIONS = "token_versions"
#: segment s of a seeded generation samples with the call's seed + s × this (segment 0 keeps the call's seed)
SEGMENT_SEED_STRIDE = 1_000_003


class SegmentedRollout:
    """The rows of one generation call done segment by segment: each row's prompt ids, the ids sampled so far with
    their log-probs and versions, and whether it is finished (a stop token, or ``max_new_tokens`` ids)."""

    def __init__(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, segment_tokens: int) -> None:
        if max_new_tokens < 1 or segment_tokens < 1:
            raise ValueError(f"max_new_tokens and segment_tokens must be >= 1; got {max_new_tokens}, {segment_tokens}")
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("a row of the rollout has an empty prompt; every row needs at least one prompt id")
        self.prompts = [list(prompt) for prompt in prompts]
        self.max_new_tokens = max_new_tokens
        self.segment_tokens = segment_tokens
        self.responses: list[list[int]] = [[] for _ in self.prompts]
        self.log_probs: list[list[float]] = [[] for _ in self.prompts]
        self.versions: list[list[int]] = [[] for _ in self.prompts]
        self.finished = [False] * len(self.prompts)
        self.segments = 0

    def unfinished(self) -> list[int]:
        """The rows still to continue, in order."""
        return [row for row, done in enumerate(self.finished) if not done]

    def budget(self, rows: Sequence[int]) -> int:
        """New tokens of the next segment for ``rows``: the segment size, or less where every row is that close to
        ``max_new_tokens`` (rows that go on have all sampled whole segments, so they are equally long)."""
        left = max(self.max_new_tokens - len(self.responses[row]) for row in rows)
        return min(self.segment_tokens, left)

    def prefixes(self, rows: Sequence[int]) -> list[list[int]]:
        """Each row's prompt ids followed by the ids sampled so far: what the next segment continues."""
        return [self.prompts[row] + self.responses[row] for row in rows]

    def extend(self, rows: Sequence[int], completions: Sequence[TokenCompletion], *, version: int,
               budget: int) -> None:
        """Append one segment: ``completions[i]`` continues ``rows[i]``, sampled by weights of ``version`` with at
        most ``budget`` ids. A row ends at a stop (``finish_reason == "stop"``) or at ``max_new_tokens`` ids."""
        if len(completions) != len(rows):
            raise EngineError(f"the rollout engine returned {len(completions)} completions for {len(rows)} prefixes "
                              "(generate_from_tokens must continue every prefix once)")
        for row, completion in zip(rows, completions):
            ids, log_probs = list(completion.token_ids), list(completion.log_probs)
            if len(ids) > budget or len(log_probs) != len(ids):
                raise EngineError(f"generate_from_tokens continued a prefix with {len(ids)} ids and {len(log_probs)} "
                                  f"log-probs; expected one log-prob per id and at most {budget} ids")
            if completion.finish_reason == "length" and len(ids) < budget:
                raise EngineError(f"generate_from_tokens stopped a prefix for length after {len(ids)} of {budget} "
                                  "ids; a continuation shorter than max_new_tokens must end with a stop token")
            self.responses[row].extend(ids)
            self.log_probs[row].extend(log_probs)
            self.versions[row].extend([int(version)] * len(ids))
            self.finished[row] = completion.finish_reason == "stop" or len(self.responses[row]) >= self.max_new_tokens
        self.segments += 1

    def to_batch(self, prompts: Batch, *, pad_token_id: int, policy_version: int) -> Batch:
        """The rollout columns of :mod:`hybridflow.engines` for ``prompts`` (one row per row here, left-padded
        prompt ids), responses ``max_new_tokens`` wide, plus :data:`TOKEN_VERSIONS`. ``meta.policy_version`` is
        ``policy_version``, the version the generation was dispatched at (no token is older; the rows of several
        rollout workers agree on it, their tokens' versions need not)."""
        oldest = min((min(row) for row in self.versions if row), default=policy_version)
        if oldest < policy_version:
            raise EngineError(f"a token of the rollout was sampled by weights of version {oldest}, older than the "
                              f"version {policy_version} the generation was dispatched at")
        if len(prompts) != len(self.prompts):
            raise ValueError(f"{len(prompts)} prompt rows for {len(self.prompts)} rows of the rollout")
        rows, width = len(self.prompts), self.max_new_tokens
        responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((rows, width), dtype=torch.long)
        log_probs = torch.zeros((rows, width), dtype=torch.float32)
        versions = torch.full((rows, width), -1, dtype=torch.long)
        for row in range(rows):
            length = len(self.responses[row])
            responses[row, :length] = torch.tensor(self.responses[row], dtype=torch.long)
            response_mask[row, :length] = 1
            log_probs[row, :length] = torch.tensor(self.log_probs[row], dtype=torch.float32)
            versions[row, :length] = torch.tensor(self.versions[row], dtype=torch.long)
        prompt_ids = prompts["input_ids"].long()
        prompt_mask = prompts["attention_mask"]
        prompt_positions = compute_position_ids(prompt_mask)
        response_positions = prompt_positions[:, -1:] + torch.arange(1, width + 1).unsqueeze(0)
        output = Batch(prompts.tensors.clone(recurse=False), dict(prompts.non_tensors),
                       {**prompts.meta, "policy_version": int(policy_version)})
        columns = {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1),
            "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
            "response_mask": response_mask.to(prompt_mask.dtype),
            "rollout_log_probs": log_probs,
            TOKEN_VERSIONS: versions,
        }
        for name, tensor in columns.items():
            output[name] = tensor
        return output


def unpadded_prompts(prompts: Batch) -> list[list[int]]:
    """Each row's prompt ids without its padding (``attention_mask`` 1)."""
    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    return [[int(t) for t in ids[row][mask[row]].tolist()] for row in range(len(prompts))]


class WeightMailbox:
    """The newest weight export the driver has dispatched to the rollout pool: ``(version, [its object ref])``
    (the ref in a list, so Ray passes it unresolved). Run as a Ray actor by the driver
    (:class:`~hybridflow.trainer.async_loop.AsyncRollout`); a rollout worker asks it between two segments of a
    partial rollout for an export newer than its weights, and loads it if the export is done. Older exports are
    forgotten as newer ones arrive (only the newest weights are ever worth loading)."""

    def __init__(self) -> None:
        self._posted: tuple[int, list[Any]] | None = None

    def post(self, version: int, ref: list[Any]) -> None:
        if self._posted is None or version >= self._posted[0]:
            self._posted = (int(version), ref)

    def newer_than(self, version: int) -> tuple[int, list[Any]] | None:
        """The newest export if its version is above ``version``, else None."""
        if self._posted is None or self._posted[0] <= version:
            return None
        return self._posted

    def clear(self) -> None:
        """Forget what was posted (a failed step: its syncs are dispatched again)."""
        self._posted = None


def start_weight_mailbox() -> Any:
    """A :class:`WeightMailbox` as a Ray actor of no CPU (the driver's; its handle goes to every rollout worker)."""
    import ray

    return ray.remote(num_cpus=0)(WeightMailbox).remote()
