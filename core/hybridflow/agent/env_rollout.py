"""The actor worker's environment path (``rollout.env``): ``ActorRolloutWorker.generate`` runs each prompt's
``rollout.n`` episodes against an environment server (:mod:`hybridflow.agent.env_loop`) and returns their rows.

``rollout.env.url`` names a server already running (OpenEnv's shape); ``rollout.env.entry`` names an environment
class each worker serves itself on loopback (:class:`~hybridflow.agent.env_server.EnvServer`, a per-run token in the
URL). Each episode's ``reset`` gets its row: ``seed``, ``episode_id``, ``prompt`` (the chat messages),
``ground_truth``, ``data_source``, ``extra_info`` and the keys of ``extra_info.env_kwargs`` (the server passes only
those its ``reset`` names). The environment's reward replaces ``reward.function``'s score (the ``agent_rewards``
column); a failed episode trains on nothing and scores 0 (``env/*`` metrics). Stability: experimental.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from hybridflow.agent.batch import ENV_STATUSES, build_rollout_batch
from hybridflow.agent.env_loop import EnvEpisode, EnvLoop
from hybridflow.agent.env_server import EnvServer
from hybridflow.agent.environment import load_environment_class
from hybridflow.agent.format import ChatFormat
from hybridflow.agent.loop import Conversation, MultiTurnConfig
from hybridflow.batch import Batch
from hybridflow.engines import RolloutEngine, RolloutEngineConfig, SamplingParams, TokenContinuationEngine
from hybridflow.errors import ConfigError, EngineError

__all__ = ["EnvRollout", "env_reset_kwargs", "build_env_batch", "ENV_COLUMNS"]

#: per-row columns the rollout adds (``agent_rewards`` replaces the reward function's score)
ENV_COLUMNS = ("env_status", "env_failed", "env_truncated", "env_steps", "agent_rewards")
_LOG = logging.getLogger(__name__)


def env_reset_kwargs(rows: Batch, *, seed: int | None) -> list[dict[str, Any]]:
    """What each row's ``reset`` gets (the server filters them to the names its ``reset`` takes)."""
    columns = {name: list(values) for name, values in rows.non_tensors.items()}
    kwargs_list = []
    for row in range(len(rows)):
        extra = columns.get("extra_info", [None] * len(rows))[row]
        extra = dict(extra) if isinstance(extra, Mapping) else {}
        kwargs: dict[str, Any] = {"episode_id": f"{columns.get('uid', [row] * len(rows))[row]}-{row}"}
        if seed is not None:
            kwargs["seed"] = abs(int(seed)) + row
        for name, key in (("prompt", "raw_prompt"), ("ground_truth", "ground_truth"),
                          ("data_source", "data_source")):
            if key in columns:
                kwargs[name] = columns[key][row]
        kwargs["extra_info"] = extra
        env_kwargs = extra.get("env_kwargs")
        if isinstance(env_kwargs, Mapping):
            kwargs.update(env_kwargs)
        kwargs_list.append(kwargs)
    return kwargs_list


def build_env_batch(rows: Batch, episodes: Sequence[EnvEpisode], *, width: int, pad_token_id: int,
                    policy_version: int) -> Batch:
    """One row per episode (responses ``width`` wide); a failed episode's row has no response and reward 0."""
    conversations = [episode.conversation if episode.status == "ok" else
                     Conversation(prompt_ids=episode.conversation.prompt_ids) for episode in episodes]
    batch = build_rollout_batch(rows, conversations, width=width, pad_token_id=pad_token_id,
                                policy_version=policy_version)
    failed = [float(episode.status != "ok") for episode in episodes]
    columns = {"env_status": [float(ENV_STATUSES.index(episode.status)) for episode in episodes],
               "env_failed": failed, "env_truncated": [float(episode.truncated) for episode in episodes],
               "env_steps": [float(episode.steps) for episode in episodes],
               "agent_rewards": [0.0 if bad else episode.reward for bad, episode in zip(failed, episodes)]}
    for name, values in columns.items():
        batch[name] = torch.tensor(values, dtype=torch.float32)
    return batch


class EnvRollout:
    """One worker's environment rollout: its local server (``entry``) or the remote ``url``, and the loop."""

    def __init__(self, engine: RolloutEngine, rollout_config: RolloutEngineConfig, options: Mapping[str, Any]
                 ) -> None:
        if not isinstance(engine, TokenContinuationEngine) or "continue_from_tokens" not in engine.capabilities:
            raise EngineError(f"rollout.env appends the environment's turns as tokens, which needs a rollout engine "
                              f"with capability continue_from_tokens; {type(engine).__name__} has "
                              f"{sorted(engine.capabilities)}. Use rollout.engine: hf or vllm")
        if rollout_config.model.path is None:
            raise ConfigError("rollout.env needs the model's tokenizer and chat template: set actor.model.path to an "
                              "HF model directory saved with a chat tokenizer")
        from hybridflow.model_dir import load_tokenizer

        self.options = dict(options)
        self.server: EnvServer | None = None
        if options.get("entry"):
            self.server = EnvServer(load_environment_class(str(options["entry"])), options.get("options") or {},
                                    host=str(options.get("host", "127.0.0.1")), port=int(options.get("port", 0)))
        self.chat_format = ChatFormat(load_tokenizer(rollout_config.model.path))
        self.config = MultiTurnConfig(max_turns=int(options["max_turns"]), max_tokens=int(options["max_tokens"]),
                                      max_batch_rows=int(options.get("max_batch_rows", 0)))
        self.pad_token_id = rollout_config.pad_token_id
        self.engine = engine
        self.loop: EnvLoop | None = None

    def base_url(self) -> str:
        if self.server is not None:
            return self.server.start()
        return str(self.options["url"])

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """``sampling.n`` episodes per prompt; rows as ``RolloutEngine.generate`` returns them plus ENV_COLUMNS."""
        if self.loop is None:
            assert isinstance(self.engine, TokenContinuationEngine)
            self.loop = EnvLoop(self.engine, self.chat_format, self.config, base_url=self.base_url(),
                                timeout_s=float(self.options["timeout_s"]))
        rows = prompts.repeat_interleave(sampling.n) if sampling.n > 1 else prompts
        ids, mask = rows["input_ids"], rows["attention_mask"]
        prefixes = [ids[row][mask[row].bool()].tolist() for row in range(len(rows))]
        episodes = self.loop.run_episodes(prefixes, replace(sampling, n=1), env_reset_kwargs(rows, seed=sampling.seed))
        for episode in episodes:
            if episode.status != "ok":
                _LOG.warning("rollout.env: episode %s failed (%s, scored 0): %s",
                             episode.reset_kwargs.get("episode_id"), episode.status, episode.error)
        return build_env_batch(rows, episodes, width=self.config.max_tokens, pad_token_id=self.pad_token_id,
                               policy_version=self.engine.weights_version)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
