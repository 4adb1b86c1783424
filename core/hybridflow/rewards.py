"""Rule-based reward functions: the built-in ones, lookup by name, ``module:function`` or ``file.py:function``, checks.

Two calling conventions are accepted, told apart by the function's signature:

- batched (ours): ``f(*, responses, ground_truths, data_sources, extra) -> list[float]``, one float per response;
- per-sample (verl's ``custom_reward_function``): ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None) -> float | dict``; a dict carries the reward under ``score`` and its other numeric keys are
  logged as ``reward/extra/<key>`` means.

Model-based rewards run in a reward-model worker (:mod:`hybridflow.workers`), not here. Resolving ``module:function``
or ``file.py:function`` imports and runs user code: only use trusted files.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow import registries
from hybridflow.errors import ConfigError, RewardError
from hybridflow.hookspecs import hookimpl
from hybridflow.tasks.arithmetic import arithmetic_exact_reward, arithmetic_reward
from hybridflow.tasks.tool_calc import tool_calc_reward

__all__ = ["RewardFunction", "RuleRewards", "resolve_reward_function", "compute_rule_rewards", "score_responses",
           "is_per_sample", "resolve_function_path", "response_length_cost", "RewardPool", "RewardEndpoint",
           "build_reward_function"]

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
        _check_signature(function, key=key, spec=spec)
        return function  # type: ignore[no-any-return]
    from hybridflow.plugins import get_plugin_manager

    get_plugin_manager()  # the core's own rewards are registered with the manager (no entry points loaded)
    try:
        registered: RewardFunction = registries.rewards.get(spec)
        return registered
    except KeyError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


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
    if isinstance(function, (RewardPool, RewardEndpoint)):
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


# --- a pool of worker processes -------------------------------------------------------------------------------
_WORKER_FUNCTIONS: dict[str, RewardFunction] = {}


def _worker_function(spec: str, key: str) -> RewardFunction:
    if spec not in _WORKER_FUNCTIONS:
        _WORKER_FUNCTIONS[spec] = resolve_reward_function(spec, key=key)
    return _WORKER_FUNCTIONS[spec]


def _worker_ready(spec: str, key: str) -> int:
    _worker_function(spec, key)
    import os

    return os.getpid()


def _worker_call(spec: str, key: str, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """In a worker: ``(True, result)``, or ``(False, "Type: message")`` (an exception may not pickle)."""
    try:
        return True, _worker_function(spec, key)(**kwargs)
    except Exception as exc:  # noqa: BLE001 - sent back as text, re-raised in the driver as a RewardError
        return False, f"{type(exc).__name__}: {exc}"


class RewardPool:
    """``reward.function`` run in ``num_workers`` spawned processes (``reward.num_workers`` > 0).

    The function is given by its spec string and resolved again in each worker, so it must be importable there
    (a registered name, ``package.module:function`` or ``path/to/file.py:function``). A per-sample function is called
    once per response, spread over the workers; a batched one on ``num_workers`` contiguous chunks. Results come back
    in row order, identical to the in-driver path. A call running past ``timeout_s`` raises :class:`RewardError` and
    the pool's processes are killed (the next call starts a fresh pool).
    """

    def __init__(self, spec: str, *, num_workers: int, timeout_s: float, key: str = "reward.function") -> None:
        if num_workers <= 0:
            raise ConfigError(f"{key.rpartition('.')[0]}.num_workers: a reward pool needs >= 1 worker, got "
                              f"{num_workers}; use 0 to score in the driver without a pool")
        if timeout_s <= 0:
            raise ConfigError(f"{key.rpartition('.')[0]}.timeout_s must be > 0, got {timeout_s}")
        self.spec = spec
        self.key = key
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.per_sample = is_per_sample(resolve_reward_function(spec, key=key))  # checked in the driver first
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"RewardPool({self.spec!r}, num_workers={self.num_workers}, timeout_s={self.timeout_s})"

    def start(self) -> None:
        """Spawn the workers and resolve the function in each (a ConfigError when it is not importable there)."""
        if self._executor is not None:
            return
        import multiprocessing

        self._executor = concurrent.futures.ProcessPoolExecutor(self.num_workers,
                                                                mp_context=multiprocessing.get_context("spawn"))
        futures = [self._executor.submit(_worker_ready, self.spec, self.key) for _ in range(self.num_workers)]
        try:
            for future in futures:
                future.result(timeout=max(self.timeout_s, 120.0))
        except Exception as exc:
            self.close()
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{exc} (in a reward worker process: the function must be importable there)") \
                    from exc
            raise RewardError(f"{self.key} {self.spec}: starting {self.num_workers} reward worker processes failed: "
                              f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Kill the worker processes (a hung call included) and forget the pool."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list(getattr(executor, "_processes", {}).values())
        for process in processes:
            if process.is_alive():
                process.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(timeout=5)

    def __call__(self, *, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                 extra: Sequence[Mapping[str, Any] | None] | None = None) -> list[float]:
        """As a batched reward function: the scores of :func:`score_responses` through the pool."""
        return compute_rule_rewards(self, responses=responses, ground_truths=ground_truths, data_sources=data_sources,
                                    extra=extra)

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
              extra: list[dict[str, Any] | None] | None, name: str) -> tuple[list[Any], dict[str, float]]:
        """The scores (and per-sample dict metrics) of all rows, in row order."""
        if self.per_sample:
            calls = [(index, index + 1, {"data_source": data_sources[index], "solution_str": response,
                                         "ground_truth": ground_truths[index],
                                         "extra_info": extra[index] if extra else None})
                     for index, response in enumerate(responses)]
        else:
            size = max(1, -(-len(responses) // self.num_workers))
            calls = [(start, min(start + size, len(responses)), {
                "responses": list(responses[start:start + size]),
                "ground_truths": list(ground_truths[start:start + size]),
                "data_sources": list(data_sources[start:start + size]),
                "extra": extra[start:start + size] if extra is not None else None})
                for start in range(0, len(responses), size)]
        results = self._run(calls, name)
        if not self.per_sample:
            joined: list[Any] = []
            for (start, stop, _), part in zip(calls, results):
                try:
                    part = list(part)
                except TypeError as exc:
                    raise RewardError(f"{name} function {self.spec} must return one number per response; got "
                                      f"{type(part).__name__}") from exc
                if len(part) != stop - start:
                    raise RewardError(f"{name} function {self.spec} returned {len(part)} scores for rows "
                                      f"{start}..{stop - 1} ({stop - start} responses); expected one per response")
                joined.extend(part)
            return joined, {}
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        scores = [_one_score(result, index, self.spec, name, sums, counts) for index, result in enumerate(results)]
        return scores, {f"{name}/extra/{key}": sums[key] / counts[key] for key in sorted(sums)}

    def _run(self, calls: list[tuple[int, int, dict[str, Any]]], name: str) -> list[Any]:
        """Each call on a worker, at most ``num_workers`` in flight, so each one's clock starts when it runs."""
        self.start()
        assert self._executor is not None
        results: list[Any] = [None] * len(calls)
        running: dict[concurrent.futures.Future[tuple[bool, Any]], tuple[int, float]] = {}
        pending = iter(range(len(calls)))
        try:
            while True:
                while len(running) < self.num_workers:
                    position = next(pending, None)
                    if position is None:
                        break
                    future = self._executor.submit(_worker_call, self.spec, self.key, calls[position][2])
                    running[future] = (position, time.monotonic())
                if not running:
                    return results
                first_deadline = min(started for _, started in running.values()) + self.timeout_s
                done, _ = concurrent.futures.wait(running, timeout=max(0.0, first_deadline - time.monotonic()),
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for future in sorted(done, key=lambda item: running[item][0]):  # the first rows' error first
                    position, _ = running.pop(future)
                    start, stop, _ = calls[position]
                    rows = f"row {start}" if stop - start == 1 else f"rows {start}..{stop - 1}"
                    try:
                        ok, value = future.result()
                    except Exception as exc:  # the worker process died
                        raise RewardError(f"{name} function {self.spec}: its worker process failed on {rows}: "
                                          f"{type(exc).__name__}: {exc}") from exc
                    if not ok:
                        raise RewardError(f"{name} function {self.spec} raised {value} on {rows}")
                    results[position] = value
                now = time.monotonic()
                for position, started in running.values():
                    if now - started >= self.timeout_s:
                        start, stop, _ = calls[position]
                        rows = f"sample {start}" if stop - start == 1 else f"samples {start}..{stop - 1}"
                        raise RewardError(
                            f"{name} function {self.spec} timed out on {rows}: no result after {self.timeout_s:g} s "
                            f"({self.key.rpartition('.')[0]}.timeout_s); the reward worker processes were stopped. "
                            "Fix: make the function faster or raise the timeout")
        except BaseException:
            self.close()
            raise


class RewardEndpoint:
    """``reward.endpoint``: the rule reward computed by an HTTP service, one POST per batch (stdlib ``urllib``).

    Request JSON: ``{"data_sources", "responses", "ground_truths", "extra_infos"}`` (lists, one entry per response).
    Response JSON: ``{"scores": [...]}``, one number per response, plus optional lists of numbers of the same length,
    whose means are logged as ``<name>/extra/<key>``.
    """

    def __init__(self, url: str, *, timeout_s: float, key: str = "reward.endpoint") -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f'{key}: expected an http(s) URL such as "http://host:port/score", got {url!r}')
        self.url = url
        self.key = key
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"RewardEndpoint({self.url!r}, timeout_s={self.timeout_s})"

    def __call__(self, *, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                 extra: Sequence[Mapping[str, Any] | None] | None = None) -> list[float]:
        """As a batched reward function: the scores of :func:`score_responses` from the endpoint."""
        return compute_rule_rewards(self, responses=responses, ground_truths=ground_truths, data_sources=data_sources,
                                    extra=extra)

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
              extra: list[dict[str, Any] | None] | None, name: str) -> tuple[list[Any], dict[str, float]]:
        import json
        import urllib.error
        import urllib.request

        count = len(responses)
        body = json.dumps({"data_sources": list(data_sources), "responses": list(responses),
                           "ground_truths": list(ground_truths),
                           "extra_infos": list(extra) if extra is not None else [None] * count}, default=str).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        where = f"{name} endpoint {self.url} ({self.key})"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = json.loads(response.read().decode())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise RewardError(f"{where} answered HTTP {exc.code} {exc.reason}: {detail}") from exc
        except TimeoutError as exc:
            raise RewardError(f"{where} gave no answer within {self.timeout_s:g} s "
                              f"({self.key.rpartition('.')[0]}.timeout_s) for {count} responses") from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise RewardError(f"{where} gave no answer within {self.timeout_s:g} s "
                                  f"({self.key.rpartition('.')[0]}.timeout_s) for {count} responses") from exc
            raise RewardError(f"{where} could not be reached: {exc.reason}") from exc
        except ValueError as exc:
            raise RewardError(f"{where} answered with invalid JSON: {exc}; expected {{\"scores\": [...]}}") from exc
        if not isinstance(payload, dict) or not isinstance(payload.get("scores"), list):
            got = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
            raise RewardError(f'{where} answered {got}; expected a JSON object {{"scores": [one number per response]}}')
        if len(payload["scores"]) != count:
            raise RewardError(f"{where} returned {len(payload['scores'])} scores for {count} responses; expected "
                              "exactly one per response")
        metrics: dict[str, float] = {}
        for extra_key, values in payload.items():
            if extra_key == "scores":
                continue
            if not isinstance(values, list) or len(values) != count or not all(
                    isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
                raise RewardError(f"{where}: extra key {extra_key!r} must be a list of {count} numbers (one per "
                                  f"response), got {str(values)[:100]}")
            metrics[f"{name}/extra/{extra_key}"] = sum(float(v) for v in values) / max(count, 1)
        return list(payload["scores"]), metrics


def build_reward_function(spec: str | None, *, num_workers: int = 0, timeout_s: float = 300.0,
                          endpoint: str | None = None, key: str = "reward.function") -> RewardFunction:
    """What the trainer scores with: a :class:`RewardEndpoint` (``endpoint`` set), the resolved function
    (``num_workers`` 0) or a :class:`RewardPool`."""
    if endpoint is not None:
        return RewardEndpoint(endpoint, timeout_s=timeout_s, key=f"{key.rpartition('.')[0]}.endpoint")
    if spec is None:
        raise ConfigError(f"{key}: expected a reward function spec or {key.rpartition('.')[0]}.endpoint, got neither")
    if num_workers == 0:
        return resolve_reward_function(spec, key=key)
    return RewardPool(spec, num_workers=num_workers, timeout_s=timeout_s, key=key)


def _describe(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


@hookimpl
def hybridflow_register_rewards(registry: Any) -> None:
    registry.register("arithmetic", arithmetic_reward)
    registry.register("arithmetic_exact", arithmetic_exact_reward)
    registry.register("tool_calc", tool_calc_reward)
    registry.register("response_length_cost", response_length_cost)
