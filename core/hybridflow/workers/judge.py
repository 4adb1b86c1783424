"""The judge role of a generative reward model (``reward.genrm``): a frozen causal LM on its own pool or colocated
with other roles, which reads each response through the judge template and generates a verdict with a registered
rollout engine; the verdict parser turns it into the response's score.

One call judges its shard of a batch in micro-batches of ``micro_batch_size`` prompts and never raises for a
sample: a verdict that does not parse, a judge prompt longer than ``prompt_length`` and the rows left when
``timeout_s`` ran out are failed samples, scored ``failed_score`` and reported per row in ``genrm_status``
(:data:`STATUS_CODES`). Templates and parsers are :mod:`hybridflow.genrm`'s; the driver adds the scores to the
reward (:meth:`hybridflow.algorithms.runtime.Runtime.score`). Stability: experimental.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Worker, register
from hybridflow.engines import RolloutEngine, RolloutEngineConfig, SamplingParams, rollout_engine_info
from hybridflow.workers.base import _iteration, close_engine

__all__ = ["JudgeSpec", "JudgeWorker", "STATUS_CODES", "STATUS_COLUMN", "JUDGED", "PARSE_FAILURE", "TIMED_OUT",
           "PROMPT_TOO_LONG", "TEMPLATE_FAILURE"]

#: ``genrm_status`` values: the verdict parsed, or why the sample failed (each failure kind's metric name,
#: ``reward/genrm_<name>``)
JUDGED, PARSE_FAILURE, TIMED_OUT, PROMPT_TOO_LONG, TEMPLATE_FAILURE = 0, 1, 2, 3, 4
STATUS_CODES: dict[int, str] = {JUDGED: "judged", PARSE_FAILURE: "parse_failures", TIMED_OUT: "timeouts",
                                PROMPT_TOO_LONG: "prompts_too_long", TEMPLATE_FAILURE: "template_failures"}
#: the per-row column of a judging call's output holding its :data:`STATUS_CODES` value
STATUS_COLUMN = "genrm_status"


@dataclass(frozen=True, kw_only=True, slots=True)
class JudgeSpec:
    """How to build the judge inside a worker process (``reward.genrm`` as the trainer planned it).

    ``policy_model_path`` / ``judge_model_path``: the HF directories the two tokenizers load from (None: the
    presets' character tokenizer). ``output_key`` is the score column the judge returns.
    """

    name: str = "genrm"
    engine: str
    rollout_config: RolloutEngineConfig
    sampling: SamplingParams
    template: str
    parser: str
    policy_model_path: str | None = None
    judge_model_path: str | None = None
    apply_chat_template: bool = False
    micro_batch_size: int = 64
    timeout_s: float = 300.0
    failed_score: float = 0.0
    device: str = "cpu"
    threads: int = 1
    output_key: str = "genrm_scores"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def role(self) -> str:
        """The role kind (what the run manifest's mapping lists as its ``model``)."""
        return "judge"


def _load_tokenizer(path: str | None) -> Any:
    if path is None:
        from hybridflow.char_tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    from hybridflow.model_dir import load_tokenizer

    return load_tokenizer(path)


class JudgeWorker(Worker):
    """Generates verdicts with a frozen judge model; ``judge(batch)`` returns ``output_key`` and ``genrm_status``."""

    def __init__(self, spec: JudgeSpec) -> None:
        super().__init__()
        from hybridflow import registries
        from hybridflow.genrm import resolve_verdict_parser
        from hybridflow.plugins import load_plugins

        torch.set_num_threads(spec.threads)
        load_plugins()
        self.spec = spec
        self.rollout_info = rollout_engine_info(spec.engine)
        factory = registries.rollout_engines.get(spec.engine)
        self.engine: RolloutEngine = factory(config=spec.rollout_config, device=spec.device)
        self.policy_tokenizer = _load_tokenizer(spec.policy_model_path)
        self.judge_tokenizer = _load_tokenizer(spec.judge_model_path)
        self.parser = resolve_verdict_parser(spec.parser)
        self._seeded = spec.sampling.seed is not None and "seed" in self.engine.capabilities
        self._calls = 0

    def reusable_process(self) -> bool:
        """The rollout engine declared ``reusable_process`` (its info record)."""
        return self.rollout_info.reusable_process

    def close(self) -> None:
        close_engine(self.engine)

    @register(protocol="mesh", blocking=False, idempotent=True)
    def judge(self, batch: Batch) -> Batch:
        """Score this rank's rows: ``output_key`` [B] float32 and ``genrm_status`` [B] int64 (0: judged)."""
        started = time.monotonic()
        rows = len(batch)
        scores = torch.full((rows,), float(self.spec.failed_score), dtype=torch.float32)
        status = torch.full((rows,), TIMED_OUT, dtype=torch.int64)
        prompts: dict[int, list[int]] = {}
        for row, text in enumerate(self._judge_prompts(batch)):
            ids = None if text is None else self._tokenize(text)
            if ids is None:
                status[row] = TEMPLATE_FAILURE
            elif not ids or len(ids) > self.spec.rollout_config.max_prompt_length:
                status[row] = PROMPT_TOO_LONG
            else:
                prompts[row] = ids
        pending = sorted(prompts)
        size = self.spec.micro_batch_size
        for start in range(0, len(pending), size):
            if time.monotonic() - started > self.spec.timeout_s:
                break  # the rows left keep TIMED_OUT
            chunk = pending[start:start + size]
            verdicts = self._generate([prompts[row] for row in chunk], _iteration(batch))
            for row, text in zip(chunk, verdicts):
                value = self._parse(text)
                if value is None:
                    status[row] = PARSE_FAILURE
                else:
                    scores[row], status[row] = value, JUDGED
        return Batch({self.spec.output_key: scores, STATUS_COLUMN: status}, meta=dict(batch.meta))

    def _judge_prompts(self, batch: Batch) -> list[str | None]:
        """Each row's judge prompt (None where the template names an ``extra_info`` key the row lacks)."""
        from hybridflow.detokenize import decode_batch
        from hybridflow.genrm import render_judge_prompt

        tokenizer = self.policy_tokenizer
        responses, masks = batch["responses"].tolist(), batch["response_mask"].bool().tolist()
        response_texts = decode_batch(tokenizer, [[t for t, keep in zip(r, m) if keep]
                                                  for r, m in zip(responses, masks)])
        if "prompt_text" in batch:
            prompt_texts = [str(text) for text in batch["prompt_text"]]
        else:  # left-padded prompt ids: the input ids before the response
            width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
            ids = batch["input_ids"][:, :width].tolist()
            kept = batch["attention_mask"][:, :width].bool().tolist()
            prompt_texts = decode_batch(tokenizer, [[t for t, keep in zip(r, m) if keep] for r, m in zip(ids, kept)])
        rows = len(batch)
        truths = list(batch["ground_truth"]) if "ground_truth" in batch else [None] * rows
        sources = [str(s) for s in batch["data_source"]] if "data_source" in batch else [""] * rows
        extras = list(batch["extra_info"]) if "extra_info" in batch else [None] * rows
        rendered: list[str | None] = []
        for row in range(rows):
            try:
                rendered.append(render_judge_prompt(self.spec.template, prompt=prompt_texts[row],
                                                    response=response_texts[row], ground_truth=truths[row],
                                                    data_source=sources[row], extra_info=extras[row]))
            except (KeyError, IndexError, AttributeError, TypeError):  # a field this row's extra_info lacks
                rendered.append(None)
        return rendered

    def _tokenize(self, text: str) -> list[int]:
        tokenizer = self.judge_tokenizer
        if self.spec.apply_chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generate(self, prompts: list[list[int]], iteration: int | None) -> list[str]:
        """The verdict texts of left-padded ``prompts`` (judge tokenizer's special tokens skipped)."""
        from hybridflow.detokenize import decode_batch

        width = max(len(ids) for ids in prompts)
        pad = self.spec.rollout_config.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts], dtype=torch.long)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts],
                                      dtype=torch.long)
        sampling = self.spec.sampling
        if self._seeded:  # reproducible, and different per call and rank
            self._calls += 1
            seed = int(sampling.seed or 0) + 1000 * int(iteration or 0) + 100 * self.rank + self._calls
            sampling = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens, seed=seed)
        else:
            sampling = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens, seed=None)
        out = self.engine.generate(Batch({"input_ids": input_ids, "attention_mask": attention_mask},
                                         meta={"policy_version": 0}), sampling)
        responses, masks = out["responses"].tolist(), out["response_mask"].bool().tolist()
        return decode_batch(self.judge_tokenizer, [[t for t, keep in zip(r, m) if keep]
                                                   for r, m in zip(responses, masks)])

    def _parse(self, text: str) -> float | None:
        """The parser's score, None when it found no verdict, raised or returned no finite number."""
        try:
            value = self.parser(text)
            number = None if value is None else float(value)
        except Exception:  # noqa: BLE001 - a parser that raises fails that sample, never the step
            return None
        return number if number is not None and math.isfinite(number) else None

    # --- what every role serves -------------------------------------------------------------------------------
    @register(protocol="one_to_all", idempotent=True)
    def save_checkpoint(self, path: str) -> None:
        """Nothing to save: the judge is frozen (its model directory is the config's)."""

    @register(protocol="one_to_all", idempotent=True)
    def load_checkpoint(self, path: str) -> None:
        """Nothing to restore: the judge is frozen."""

    @register(protocol="one_to_all", idempotent=True)
    def process_stats(self) -> dict[str, int]:
        """Resident bytes of this worker process."""
        import psutil

        return {"rss_bytes": int(psutil.Process().memory_info().rss)}
