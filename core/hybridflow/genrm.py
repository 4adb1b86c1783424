"""A generative reward model's text side: the judge prompt :data:`template fields <TEMPLATE_FIELDS>` and their check,
rendering one judge prompt per response, and the verdict parsers (built-in ones, lookup by registered name or
``module:function`` / ``file.py:function``) that turn a judge's generated text into a score. Stability: experimental.

Generating the verdicts (the judge's model, rollout engine, batching and timeout) is
:mod:`hybridflow.workers.judge`'s business; adding the scores to the reward is the driver's
(:meth:`hybridflow.algorithms.runtime.Runtime.score`). See docs/guide/configuration.md, "Generative reward model".
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from hybridflow import registries
from hybridflow.errors import ConfigError
from hybridflow.hookspecs import hookimpl

__all__ = ["TEMPLATE_FIELDS", "DEFAULT_TEMPLATE", "VerdictParser", "check_template", "render_judge_prompt",
           "parse_verdict", "parse_yes_no", "parse_number", "resolve_verdict_parser"]

#: the fields a judge template may name: the row's prompt text, the decoded response (surrounding whitespace
#: stripped), the row's ground truth and data source as text, and its ``extra_info`` dict
#: (``{extra_info[question]}``)
TEMPLATE_FIELDS: tuple[str, ...] = ("prompt", "response", "ground_truth", "data_source", "extra_info")

#: ``reward.genrm.template`` by default: a reference-guided yes/no question, answered by :func:`parse_verdict`
DEFAULT_TEMPLATE = ("Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
                    "Is the response correct? Answer yes or no.\n")

#: ``parser(text) -> score``, or None when the text holds no verdict (the sample is then a failed one)
VerdictParser = Callable[[str], "float | None"]

_YES = frozenset({"yes", "y", "true", "correct", "right", "pass"})
_NO = frozenset({"no", "n", "false", "incorrect", "wrong", "fail"})
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_PUNCTUATION = string.punctuation + "“”‘’"


def check_template(template: str, *, key: str = "reward.genrm.template") -> str:
    """``template`` when it is a ``str.format`` string naming only :data:`TEMPLATE_FIELDS`, ``{response}``
    among them.

    Raises:
        ConfigError: naming the bad field or the syntax error, the known fields and the fix.
    """
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc} in {template!r}; write literal braces as {{{{ and }}}}") from None
    for name in fields:
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if base not in TEMPLATE_FIELDS:
            shown = f"{{{name}}}" if name else "{} (a positional field)"
            raise ConfigError(f"{key}: unknown field {shown} in {template!r}; expected named fields among "
                              f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (literal braces as {{{{ }}}})")
    if "response" not in fields:
        raise ConfigError(f"{key}: {template!r} never shows the judge the response; add {{response}} to it")
    return template


def render_judge_prompt(template: str, *, prompt: str, response: str, ground_truth: Any, data_source: str,
                        extra_info: Mapping[str, Any] | None) -> str:
    """One judge prompt: ``template`` with the row's fields filled in (the response stripped of surrounding
    whitespace; a missing ground truth as the empty string).

    Raises:
        KeyError: ``{extra_info[key]}`` names a key this row's extra_info lacks (the caller fails that sample).
    """
    return template.format(prompt=prompt, response=response.strip(),
                           ground_truth="" if ground_truth is None else str(ground_truth),
                           data_source=data_source, extra_info=dict(extra_info or {}))


def _last_word(text: str) -> str:
    words = text.strip().split()
    return words[-1].strip(_PUNCTUATION).lower() if words else ""


def parse_yes_no(text: str) -> float | None:
    """1.0 when the text's last word is yes (y, true, correct, right, pass), 0.0 when it is no (n, false,
    incorrect, wrong, fail), case and punctuation aside; else None."""
    word = _last_word(text)
    return 1.0 if word in _YES else 0.0 if word in _NO else None


def parse_number(text: str) -> float | None:
    """The number the text ends with, trailing punctuation aside (``"Score: 7."`` → 7.0; a fraction such as
    ``8/10`` reads as 10.0: register a parser of your own for it); None when it ends with no finite number."""
    stripped = text.strip().rstrip(_PUNCTUATION + " ")
    matches = list(_NUMBER.finditer(stripped))
    if not matches or matches[-1].end() != len(stripped):
        return None
    value = float(matches[-1].group(0))
    return value if math.isfinite(value) else None


def parse_verdict(text: str) -> float | None:
    """The default parser (``verdict``): the number the text ends with, else its last word as yes (1.0) / no
    (0.0); None when it ends with neither."""
    number = parse_number(text)
    return number if number is not None else parse_yes_no(text)


def resolve_verdict_parser(spec: str, *, key: str = "reward.genrm.parser") -> VerdictParser:
    """A registered parser name (``verdict``, ``yes_no``, ``number``, or a plugin's), or
    ``package.module:function`` / ``path/to/file.py:function`` (absolute, or as the config file anchored it), a
    callable ``parser(text: str) -> float | None``.

    Raises:
        ConfigError: naming ``key``, what was expected and what was found.
    """
    if ":" not in spec:
        from hybridflow.plugins import get_plugin_manager

        get_plugin_manager()  # the core's own parsers are registered with the manager (no entry points loaded)
        try:
            registered: VerdictParser = registries.verdict_parsers.get(spec)
        except KeyError as exc:
            raise ConfigError(f"{key}: {exc} Or give package.module:function / path/to/file.py:function") from exc
        return registered
    from hybridflow.rewards import load_function

    function: VerdictParser = load_function(spec, key=key)  # a parser(text: str) -> float | None
    return function


@hookimpl
def hybridflow_register_verdict_parsers(registry: Any) -> None:
    registry.register("verdict", parse_verdict)
    registry.register("yes_no", parse_yes_no)
    registry.register("number", parse_number)
