"""Reward scoring away from the driver's thread: :class:`RewardPool` (``reward.num_workers`` spawned processes,
``reward.timeout_s`` per call) and :class:`RewardEndpoint` (``reward.endpoint``: batched JSON over HTTP), and
:func:`build_reward_function`, which picks what the trainer scores with. Stability: experimental.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process
import logging
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

__all__ = ["FAILED_SCORE", "RewardPool", "RewardEndpoint", "build_reward_function"]

_LOGGER = logging.getLogger(__name__)

#: the score of a sample whose call in a :class:`RewardPool` raised, timed out or lost its worker process (verl's
#: process-pool reward manager scores such a sample 0 too); counted in ``reward/num_failed``
FAILED_SCORE = 0.0


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


def _rows(start: int, stop: int) -> str:
    return f"sample {start}" if stop - start == 1 else f"samples {start}..{stop - 1}"


def _worker_call(spec: str, key: str, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """In a worker: ``(True, result)``, or ``(False, "Type: message")`` (an exception may not pickle)."""
    try:
        return True, _worker_function(spec, key)(**kwargs)
    except Exception as exc:  # noqa: BLE001 - sent back as text: the driver scores the sample as failed
        return False, f"{type(exc).__name__}: {exc}"


class RewardPool(_CallableScorer):
    """``reward.function`` run in ``num_workers`` spawned processes (``reward.num_workers`` > 0).

    The function is given by its spec string and resolved again in each worker, so it must be importable there
    (a registered name, ``package.module:function`` or ``path/to/file.py:function``). A per-sample function is called
    once per response, spread over the workers; a batched one on ``num_workers`` contiguous chunks. Results come back
    in row order, identical to the in-driver path.

    A call that raises, runs past ``timeout_s`` or loses its worker process is a failed sample (a failed chunk of a
    batched function: each of its rows), never a failed or hung step: it is scored :data:`FAILED_SCORE`, counted in
    ``<name>/num_failed`` and ``<name>/failed_ratio`` and logged as a warning naming the sample and the error. A call
    past ``timeout_s`` is stopped by killing the pool's processes; the calls still running start again on a fresh
    pool. Only when every call of a step fails does the step raise :class:`RewardError` (the function is broken).
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
        """The scores (and per-sample dict metrics) of all rows, in row order; the rows of a failed call scored
        :data:`FAILED_SCORE` and counted in ``<name>/num_failed`` and ``<name>/failed_ratio``.

        Raises:
            RewardError: every call failed (nothing of the step was scored), or a result has the wrong shape.
        """
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
        results, failures = self._run(calls, name)
        described = [f"{_rows(*calls[position][:2])} {why}" for position, why in sorted(failures.items())]
        if calls and len(failures) == len(calls):
            raise RewardError(
                f"{name} function {self.spec} failed on all {len(responses)} samples of the step, first on "
                f"{described[0]}; a failed sample is scored {FAILED_SCORE:g} only while others of its step are "
                "scored. Fix the function (run it on a few responses in the driver with "
                f"{self.key.rpartition('.')[0]}.num_workers=0 to see its traceback)")
        failed_rows = sum(calls[position][1] - calls[position][0] for position in failures)
        failure_metrics = {f"{name}/num_failed": float(failed_rows),
                           f"{name}/failed_ratio": failed_rows / len(responses) if responses else 0.0}
        if failures:
            more = f" (and {len(described) - 3} more)" if len(described) > 3 else ""
            _LOGGER.warning("%s function %s: %d of %d samples failed and were scored %g (%s/num_failed): %s%s",
                            name, self.spec, failed_rows, len(responses), FAILED_SCORE, name,
                            "; ".join(described[:3]), more)
        if not self.per_sample:
            joined: list[Any] = []
            for position, (start, stop, _) in enumerate(calls):
                if position in failures:
                    joined.extend([FAILED_SCORE] * (stop - start))
                    continue
                try:
                    part = list(results[position])
                except TypeError as exc:
                    raise RewardError(f"{name} function {self.spec} must return one number per response; got "
                                      f"{type(results[position]).__name__}") from exc
                if len(part) != stop - start:
                    raise RewardError(f"{name} function {self.spec} returned {len(part)} scores for rows "
                                      f"{start}..{stop - 1} ({stop - start} responses); expected one per response")
                joined.extend(part)
            return joined, failure_metrics
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        scores = [FAILED_SCORE if index in failures else _one_score(result, index, self.spec, name, sums, counts)
                  for index, result in enumerate(results)]
        return scores, {**{f"{name}/extra/{key}": sums[key] / counts[key] for key in sorted(sums)},
                        **failure_metrics}

    def _run(self, calls: list[tuple[int, int, dict[str, Any]]], name: str) -> tuple[list[Any], dict[int, str]]:
        """Each call on a worker, at most ``num_workers`` in flight, so each one's clock starts when it runs.

        Returns the results in call order (None for a failed call) and, by call position, why each failed call
        failed: it raised, it ran past ``timeout_s`` (the pool is then killed, as a hung process can only be stopped
        that way, and the calls still running start again on a fresh pool), or its worker process died (every call
        then in flight fails with it: which one killed the process cannot be told)."""
        results: list[Any] = [None] * len(calls)
        failures: dict[int, str] = {}
        queue = collections.deque(range(len(calls)))
        running: dict[concurrent.futures.Future[tuple[bool, Any]], tuple[int, float]] = {}
        try:
            while True:
                self.start()
                assert self._executor is not None
                while len(running) < self.num_workers and queue:
                    position = queue.popleft()
                    future = self._executor.submit(_worker_call, self.spec, self.key, calls[position][2])
                    running[future] = (position, time.monotonic())
                if not running:
                    return results, failures
                first_deadline = min(started for _, started in running.values()) + self.timeout_s
                done, _ = concurrent.futures.wait(running, timeout=max(0.0, first_deadline - time.monotonic()),
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                broken = False
                for future in done:
                    position, _ = running.pop(future)
                    broken |= not self._collect(future, position, results, failures)
                if broken:  # the pool is gone: each call it still held ends with it (the executor fails them all)
                    concurrent.futures.wait(running, timeout=10)
                    for future, (position, _) in running.items():
                        if future.done():
                            self._collect(future, position, results, failures)
                        else:
                            failures[position] = "failed: a reward worker process died while it was in flight"
                    running.clear()
                now = time.monotonic()
                expired = [future for future, (_, started) in running.items() if now - started >= self.timeout_s]
                for future in expired:
                    position, _ = running.pop(future)
                    failures[position] = (f"timed out: no result after {self.timeout_s:g} s "
                                          f"({self.key.rpartition('.')[0]}.timeout_s)")
                    _LOGGER.warning("%s function %s %s on %s; restarting the reward worker processes", name,
                                    self.spec, failures[position], _rows(*calls[position][:2]))
                if expired or broken:
                    # a hung worker is stopped only by killing the pool: the calls it still ran go again, first
                    for position, _ in sorted(running.values(), reverse=True):
                        queue.appendleft(position)
                    running.clear()
                    self.close()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _collect(future: concurrent.futures.Future[tuple[bool, Any]], position: int, results: list[Any],
                 failures: dict[int, str]) -> bool:
        """A finished call's result or failure into ``results`` / ``failures``; False when its worker died."""
        try:
            ok, value = future.result()
        except concurrent.futures.process.BrokenProcessPool as exc:
            failures[position] = f"failed: a reward worker process died while it ran ({type(exc).__name__}: {exc})"
            return False
        if ok:
            results[position] = value
        else:
            failures[position] = f"raised {value}"
        return True


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
