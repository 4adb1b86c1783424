"""Reward scoring away from the driver's thread: :class:`RewardPool` (``reward.num_workers`` spawned processes,
``reward.timeout_s`` per call) and :class:`RewardEndpoint` (``reward.endpoint``: batched JSON over HTTP), and
:func:`build_reward_function`, which picks what the trainer scores with. Stability: experimental.
"""

from __future__ import annotations

import concurrent.futures
import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.errors import ConfigError, RewardError
from hybridflow.rewards import (
    RewardFunction,
    _one_score,
    compute_rule_rewards,
    is_per_sample,
    resolve_reward_function,
)

__all__ = ["RewardPool", "RewardEndpoint", "build_reward_function"]


# --- what both scorers share ------------------------------------------------------------------------------------
class _CallableScorer:
    """The ``__call__`` of a :class:`~hybridflow.rewards.BatchScorer` (a subclass defines ``score``)."""

    def __call__(self, *, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                 extra: Sequence[Mapping[str, Any] | None] | None = None) -> list[float]:
        """As a batched reward function: the scores of :func:`score_responses`, which calls ``score``."""
        return compute_rule_rewards(self, responses=responses, ground_truths=ground_truths, data_sources=data_sources,
                                    extra=extra)


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


class RewardPool(_CallableScorer):
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


class RewardEndpoint(_CallableScorer):
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
        except (TimeoutError, urllib.error.URLError) as exc:
            if isinstance(exc, TimeoutError) or isinstance(exc.reason, TimeoutError):
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
