"""Rule-based reward functions: the built-in ones, lookup by name, ``module:function`` or ``file.py:function``, checks.

Two calling conventions are accepted, told apart by the function's signature:

- batched (ours): ``f(*, responses, ground_truths, data_sources, extra) -> list[float]``, one float per response;
- per-sample (verl's ``custom_reward_function``): ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None) -> float | dict``; a dict carries the reward under ``score`` and its other numeric keys are
  logged as ``reward/extra/<key>`` means.

Scoring in a pool of worker processes or by an HTTP endpoint, and what the trainer scores with
(:func:`~hybridflow.rewards_remote.build_reward_function`), live in :mod:`hybridflow.rewards_remote`. Model-based
rewards run in a reward-model worker (:mod:`hybridflow.workers`), not here. Resolving ``module:function``
or ``file.py:function`` imports and runs user code: only use trusted files.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hybridflow import registries
from hybridflow.errors import ConfigError, RewardError
from hybridflow.hookspecs import hookimpl
from hybridflow.tasks.arithmetic import arithmetic_exact_reward, arithmetic_reward

__all__ = ["RewardFunction", "RuleRewards", "BatchScorer", "resolve_reward_function", "compute_rule_rewards",
           "score_responses", "is_per_sample", "resolve_function_path", "response_length_cost"]

RewardFunction = Callable[..., Any]

_BATCHED = "f(*, responses, ground_truths, data_sources, extra) -> list[float]"
_PER_SAMPLE = "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"


def response_length_cost(*, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                         extra: Sequence[dict[str, Any]] | None = None) -> list[float]:
    """A cost for Safe-RLHF demos: the response length in characters divided by 10."""
    return [len(text) / 10.0 for text in responses]


# --- lookup ---------------------------------------------------------------------------------------------------
def resolve_reward_function(spec: str, *, key: str = "reward.function",
                            base_dir: str | Path | None = None) -> RewardFunction:
    """A registered name (``"arithmetic"``), an importable ``"package.module:function"``, or a file
    ``"path/to/file.py:function"`` (relative to ``base_dir``, default the working directory).

    The function's signature must fit one of the two conventions of this module.

    Raises:
        ConfigError: naming ``key``, what was expected and what was found.
    """
    if ":" in spec:
        function = load_function(spec, key=key, base_dir=base_dir)
        _check_signature(function, key=key, spec=spec)
        return function
    from hybridflow.plugins import get_plugin_manager

    get_plugin_manager()  # the core's own rewards are registered with the manager (no entry points loaded)
    try:
        registered: RewardFunction = registries.rewards.get(spec)
        return registered
    except KeyError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def load_function(spec: str, *, key: str, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The callable ``"package.module:function"`` or ``"path/to/file.py:function"`` (a relative path against
    ``base_dir``, default the working directory) names; what the reward function, GenRM verdict parser and other
    ``:function`` config values load.

    Raises:
        ConfigError: naming ``key``: a malformed spec, a module or file that does not import, no such callable.
    """
    location, _, attribute = spec.rpartition(":")
    if not attribute or not location:
        raise ConfigError(f'{key}: "{spec}" must be "package.module:function" or "path/to/file.py:function" '
                          "with both parts non-empty")
    if _looks_like_path(location):
        module = _import_file(location, spec=spec, key=key, base_dir=base_dir)
    else:
        module = _import_module(location, spec=spec, key=key, base_dir=base_dir)
    function = getattr(module, attribute, None)
    if not callable(function):
        found = sorted(name for name, value in vars(module).items()
                       if callable(value) and not name.startswith("_") and
                       getattr(value, "__module__", None) == module.__name__)
        raise ConfigError(f'{key}: "{location}" has no callable "{attribute}" (functions it defines: '
                          f'{", ".join(found) or "none"}); check the name after ":".')
    return function  # type: ignore[no-any-return]


def resolve_function_path(spec: str, base_dir: str | Path) -> str:
    """``spec`` as the config file at ``base_dir`` means it: a relative ``file.py`` part made absolute against
    ``base_dir``, and a ``module:function`` whose module is not importable but sits next to the config file turned
    into that file's path. Registered names and importable modules stay as they are."""
    location, sep, attribute = spec.rpartition(":")
    if not sep or not location:
        return spec
    base = Path(base_dir)
    if _looks_like_path(location):
        path = Path(location).expanduser()
        return spec if path.is_absolute() else f"{(base / path).resolve()}:{attribute}"
    top = location.split(".")[0]
    try:
        importable = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        importable = False
    if importable:
        return spec
    relative = Path(*location.split("."))
    for candidate in (base / relative.with_suffix(".py"), base / relative / "__init__.py"):
        if candidate.is_file():
            return f"{candidate.resolve()}:{attribute}"
    return spec


def _looks_like_path(location: str) -> bool:
    return location.endswith(".py") or "/" in location or "\\" in location


def _import_module(name: str, *, spec: str, key: str, base_dir: str | Path | None) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.split(".")[0]
        local = Path(base_dir) if base_dir is not None else None
        if exc.name != top or local is None or not ((local / f"{top}.py").exists() or (local / top).is_dir()):
            raise ConfigError(
                f'{key}: could not import module "{name}" of "{spec}" ({exc}). Expected "package.module:function" '
                f"importable from the driver (on PYTHONPATH{f' or next to the config file in {local}' if local else ''}"
                f'), "path/to/file.py:function", or a registered name: {", ".join(registries.rewards.names())}.'
            ) from exc
    except Exception as exc:
        raise ConfigError(f'{key}: importing "{name}" of "{spec}" failed: {type(exc).__name__}: {exc}') from exc
    # a module next to the config file, as verl's custom_reward_function.path lets one keep it there
    sys.path.insert(0, str(local.resolve()))
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise ConfigError(f'{key}: importing "{name}" from {local} failed: {type(exc).__name__}: {exc}') from exc


def _import_file(location: str, *, spec: str, key: str, base_dir: str | Path | None) -> Any:
    path = Path(location).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or ".") / path
    path = path.resolve()
    if not path.is_file() or path.suffix != ".py":
        problem = "is not a .py file" if path.is_file() else "does not exist"
        raise ConfigError(f'{key}: "{spec}" names the file {path}, which {problem}'
                          "; expected path/to/file.py:function (a relative path is read from the config file's "
                          "folder)")
    # a file inside a package is imported by its dotted name (relative imports work); a lone file under a unique
    # name. Either way its root folder goes on sys.path so that it can import its neighbours.
    root, parts = path.parent, [] if path.stem == "__init__" else [path.stem]
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if len(parts) > 1 or path.stem == "__init__":
        try:
            return importlib.import_module(".".join(parts))
        except Exception as exc:
            raise ConfigError(f"{key}: importing {'.'.join(parts)} from {root} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    module_name = f"hybridflow_user_reward_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{key}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(f"{key}: running {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def is_per_sample(function: RewardFunction) -> bool:
    """Whether ``function`` has verl's per-sample signature (a ``solution_str`` parameter)."""
    try:
        return "solution_str" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _check_signature(function: RewardFunction, *, key: str, spec: str) -> None:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable: its call will tell
    names = set(parameters)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "solution_str" in names:
        missing = {"data_source", "ground_truth"} - names
        if missing and not takes_any:
            raise ConfigError(f"{key}: {spec} looks like verl's per-sample reward (it takes solution_str) but lacks "
                              f"{sorted(missing)}; expected {_PER_SAMPLE}")
        return
    if not takes_any and not {"responses", "ground_truths", "data_sources"} <= names:
        raise ConfigError(f"{key}: {spec} has the signature {function.__name__}{inspect.signature(function)}; "
                          f"expected a batched reward {_BATCHED} or verl's per-sample {_PER_SAMPLE}")


# --- scoring --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RuleRewards:
    """One finite score per response, plus the means of a per-sample function's extra dict keys."""

    scores: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class BatchScorer(Protocol):
    """A reward that scores a whole batch itself (a process pool, an HTTP endpoint:
    :mod:`hybridflow.rewards_remote`): scores in row order plus ``<name>/extra/<key>`` metrics."""

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
              extra: list[dict[str, Any] | None] | None, name: str) -> tuple[list[Any], dict[str, float]]: ...


def score_responses(function: RewardFunction, *, responses: Sequence[str], ground_truths: Sequence[Any],
                    data_sources: Sequence[str], extra: Sequence[Mapping[str, Any] | None] | None = None,
                    name: str = "reward") -> RuleRewards:
    """Call ``function`` (batched, or per-sample verl style once per response) and check its results.

    ``extra`` is each row's ``extra_info`` from the dataset. Metrics are ``<name>/extra/<key>`` means.

    Raises:
        RewardError: the function raised, or returned the wrong count, non-numbers or non-finite values.
    """
    if extra is not None and len(extra) != len(responses):
        raise RewardError(f"{name}: {len(extra)} extra_info rows for {len(responses)} responses")
    rows = [dict(e) if e is not None else None for e in extra] if extra is not None else None
    metrics: dict[str, float] = {}
    if isinstance(function, BatchScorer):
        scores, metrics = function.score(responses, ground_truths, data_sources, rows, name)
    elif is_per_sample(function):
        scores, metrics = _call_per_sample(function, responses, ground_truths, data_sources, rows, name)
    else:
        try:
            scores = function(responses=list(responses), ground_truths=list(ground_truths),
                              data_sources=list(data_sources), extra=rows)
        except Exception as exc:
            raise RewardError(f"{name} function {_describe(function)} raised {type(exc).__name__}: {exc}") from exc
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise RewardError(
            f"{name} function {_describe(function)} must return one number per response; got {type(scores).__name__}"
        ) from exc
    if len(values) != len(responses):
        raise RewardError(
            f"{name} function {_describe(function)} returned {len(values)} scores for {len(responses)} responses; "
            "expected exactly one float per response"
        )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(
            f"{name} function {_describe(function)} returned non-finite scores (NaN/inf) at rows {bad[:5]}; "
            "return finite floats (e.g. 0.0 for an unparsable response)"
        )
    return RuleRewards(values, metrics)


def compute_rule_rewards(function: RewardFunction, *, responses: Sequence[str], ground_truths: Sequence[Any],
                         data_sources: Sequence[str], extra: Sequence[Mapping[str, Any] | None] | None = None,
                         name: str = "reward") -> list[float]:
    """The scores of :func:`score_responses` (one finite float per response)."""
    return score_responses(function, responses=responses, ground_truths=ground_truths, data_sources=data_sources,
                           extra=extra, name=name).scores


def _call_per_sample(function: RewardFunction, responses: Sequence[str], ground_truths: Sequence[Any],
                     data_sources: Sequence[str], extra: list[dict[str, Any] | None] | None,
                     name: str) -> tuple[list[float], dict[str, float]]:
    scores: list[float] = []
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for index, response in enumerate(responses):
        try:
            result = function(data_source=data_sources[index], solution_str=response,
                              ground_truth=ground_truths[index], extra_info=extra[index] if extra else None)
        except Exception as exc:
            raise RewardError(f"{name} function {_describe(function)} raised {type(exc).__name__} on row {index}: "
                              f"{exc}") from exc
        scores.append(_one_score(result, index, _describe(function), name, sums, counts))
    return scores, {f"{name}/extra/{key}": sums[key] / counts[key] for key in sorted(sums)}


def _one_score(result: Any, index: int, described: str, name: str, sums: dict[str, float],
               counts: dict[str, int]) -> float:
    """A per-sample result as a float; a dict's other numeric keys are added to ``sums`` / ``counts``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError(f"{name} function {described} returned a dict without \"score\" on row "
                              f"{index} (keys: {sorted(result)}); expected a number, or a dict with the reward "
                              "under \"score\" and other numbers to log")
        for extra_key, value in result.items():
            if extra_key == "score" or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            sums[extra_key] = sums.get(extra_key, 0.0) + float(value)
            counts[extra_key] = counts.get(extra_key, 0) + 1
        result = result["score"]
    try:
        return float(result)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"{name} function {described} returned {type(result).__name__} on row "
                          f"{index}; expected a number or a dict with \"score\"") from exc


def _describe(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


@hookimpl
def hybridflow_register_rewards(registry: Any) -> None:
    # imported here: tool_calc pulls in torch (through the agent's batches), which a reward pool's worker process,
    # spawned again after each timeout, should not pay for unless its function needs it
    from hybridflow.tasks.tool_calc import tool_calc_reward

    registry.register("arithmetic", arithmetic_reward)
    registry.register("arithmetic_exact", arithmetic_exact_reward)
    registry.register("tool_calc", tool_calc_reward)
    registry.register("response_length_cost", response_length_cost)
