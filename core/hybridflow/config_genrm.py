"""The ``reward.genrm`` section of the run configuration: a generative reward model (LLM-as-judge), its rollout keys
(verl's ``reward_model.rollout`` names where they apply), template and parser, checked at load time.

What the judge does with them is :mod:`hybridflow.workers.judge`'s; :mod:`hybridflow.config` re-exports both
sections under ``RewardConfig.genrm``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from hybridflow.config_sections import ModelConfig, _Section
from hybridflow.errors import ConfigError
from hybridflow.genrm import DEFAULT_TEMPLATE, check_template

__all__ = ["GenRMRolloutSection", "GenRMSection"]


class GenRMRolloutSection(_Section):
    """How the judge generates its verdicts: verl's ``reward_model.rollout`` keys that apply here."""

    name: str = "hf"  # a registered rollout engine (`hybridflow plugins`), as verl's reward_model.rollout.name
    temperature: float = Field(default=0.0, ge=0)  # 0: greedy (verl's judge default)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    prompt_length: int = Field(default=512, gt=0)  # judge prompt tokens at most; a longer one fails its sample
    response_length: int = Field(default=16, gt=0)  # verdict tokens generated at most
    extra: dict[str, Any] = Field(default_factory=dict)  # the engine's own options, as rollout.extra


class GenRMSection(_Section):
    """A generative reward model (LLM-as-judge, docs/guide/configuration.md): a causal LM on ``pool`` reads each
    response through ``template`` and generates a verdict that ``parser`` turns into its score."""

    model: ModelConfig  # the judge: an HF causal LM directory (path), or a preset / config for tests
    pool: str = "main"  # a pool of its own, or another role's (colocated in the same processes)
    rollout: GenRMRolloutSection = GenRMRolloutSection()
    # a str.format template over {prompt}, {response}, {ground_truth}, {data_source}, {extra_info[key]}
    template: str = DEFAULT_TEMPLATE
    # render the template as the user turn of the judge tokenizer's chat template (a chat judge); false: as is
    apply_chat_template: bool = False
    # a registered verdict parser (verdict, yes_no, number, a plugin's) or package.module:function /
    # path/to/file.py:function, parser(text) -> float | None (None: no verdict, the sample fails)
    parser: str = "verdict"
    micro_batch_size: int = Field(default=64, gt=0)  # judge prompts per generate call on each rank
    timeout_s: float = Field(default=300.0, gt=0)  # per judging call; rows not judged by then fail
    failed_score: float = 0.0  # the score of a sample whose verdict failed (no parse, timeout, prompt too long)

    @model_validator(mode="after")
    def _template_and_parser(self) -> GenRMSection:
        try:
            check_template(self.template)
        except ConfigError as exc:
            raise PydanticCustomError("rejected_key", "{reason}", {"key": "template", "reason": str(
                exc).removeprefix("reward.genrm.template: ")}) from None
        return self
