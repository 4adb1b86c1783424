"""``rollout.multi_turn.enable`` needs a chat tokenizer: a clear error before any worker starts.

The trainer running the actor's generation through the agent loop is guarded by test_tool_calc_learning.py (the
shipped tool job: the tool-call rate rises on the hf engine; the vllm engine runs its conversations), which made the
2-step multi-turn run that used to be here a weaker copy of the same path."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.errors import ConfigError
from hybridflow.trainer import Trainer


def test_multi_turn_needs_a_chat_tokenizer(tmp_path: Path, tiny_config) -> None:  # type: ignore[no-untyped-def]
    config = tiny_config(tmp_path / "run", "rollout.multi_turn.enable=true", 'rollout.multi_turn.tools=["python"]')
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        Trainer(config, progress=False)
