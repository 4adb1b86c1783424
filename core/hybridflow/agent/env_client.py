"""A rollout's connection to one environment session over OpenEnv's WebSocket protocol (``<base_url>/ws``; the
messages ``openenv-core``'s ``EnvClient`` sends), with a deadline on every call.

Every failure is one of three typed errors the rollout turns into a failed sample: :class:`EnvCallError` (cannot
connect, the server reports an error, the connection drops), :class:`EnvTimeoutError` (no answer within
``timeout_s``) and :class:`~hybridflow.agent.environment.EnvResponseError` (an answer that is not a step result).
Serving is :mod:`hybridflow.agent.env_server`'s. Stability: experimental.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from hybridflow.agent.environment import EnvResponseError, EnvStep, parse_step

__all__ = ["EnvSession", "EnvCallError", "EnvTimeoutError", "EnvResponseError", "websocket_url"]


class EnvCallError(RuntimeError):
    """The environment server could not be reached, reported an error, or dropped the session."""


class EnvTimeoutError(TimeoutError):
    """The environment did not answer within the rollout's ``timeout_s``."""


def websocket_url(base_url: str) -> str:
    """``<base_url>/ws`` with http(s) turned into ws(s), as OpenEnv's client does."""
    url = base_url.rstrip("/")
    for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(plain):
            url = secure + url[len(plain):]
    return url if url.endswith("/ws") else f"{url}/ws"


class EnvSession:
    """One episode's session: ``open()``, ``reset(**kwargs)``, ``step(action)``, ``state()``, ``close()``."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, *, timeout_s: float) -> None:
        self.http = http
        self.url = websocket_url(base_url)
        self.timeout_s = timeout_s
        self._socket: aiohttp.ClientWebSocketResponse | None = None

    async def open(self) -> None:
        try:
            self._socket = await asyncio.wait_for(self.http.ws_connect(self.url, max_msg_size=16 * 1024 * 1024),
                                                  timeout=self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise EnvTimeoutError(f"connecting to {self._shown_url} took more than {self.timeout_s} s") from exc
        except aiohttp.ClientError as exc:
            raise EnvCallError(f"cannot open a session at {self._shown_url}: {type(exc).__name__}: {exc}") from exc

    @property
    def _shown_url(self) -> str:
        """The URL without its token (the path's first segment) for messages and logs."""
        scheme, _, rest = self.url.partition("://")
        host, _, path = rest.partition("/")
        return f"{scheme}://{host}/…/ws" if path.count("/") >= 1 else self.url

    async def reset(self, **kwargs: Any) -> EnvStep:
        return parse_step(await self._ask({"type": "reset", "data": kwargs}, expect="observation"))

    async def step(self, action: Mapping[str, Any]) -> EnvStep:
        return parse_step(await self._ask({"type": "step", "data": dict(action)}, expect="observation"))

    async def state(self) -> dict[str, Any]:
        data = await self._ask({"type": "state"}, expect="state")
        if not isinstance(data, dict):
            raise EnvResponseError(f"a state reply's data must be an object, got {type(data).__name__}")
        return data

    async def close(self) -> None:
        if self._socket is None:
            return
        socket, self._socket = self._socket, None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(socket.send_str(json.dumps({"type": "close"})), timeout=1.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(socket.close(), timeout=1.0)

    async def _ask(self, message: Mapping[str, Any], *, expect: str) -> Any:
        if self._socket is None:
            await self.open()
        assert self._socket is not None
        socket = self._socket
        try:
            await asyncio.wait_for(socket.send_str(json.dumps(message, default=str)), timeout=self.timeout_s)
            reply = await asyncio.wait_for(socket.receive(), timeout=self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise EnvTimeoutError(f"the environment did not answer {message['type']!r} within "
                                  f"{self.timeout_s} s (rollout.env.timeout_s)") from exc
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            raise EnvCallError(f"the session dropped during {message['type']!r}: {type(exc).__name__}: {exc}"
                               ) from exc
        if reply.type != aiohttp.WSMsgType.TEXT:
            raise EnvCallError(f"the session ended during {message['type']!r} (websocket {reply.type.name})")
        try:
            payload = json.loads(reply.data)
        except json.JSONDecodeError as exc:
            raise EnvResponseError(f"the reply to {message['type']!r} is not JSON: {reply.data!r:.80}") from exc
        if not isinstance(payload, dict):
            raise EnvResponseError(f"the reply to {message['type']!r} is not an object: {payload!r:.80}")
        if payload.get("type") == "error":
            error = payload.get("data")
            data: dict[str, Any] = error if isinstance(error, dict) else {}
            raise EnvCallError(f"the environment failed {message['type']!r}: {data.get('message', payload)} "
                               f"(code {data.get('code', 'UNKNOWN')})")
        if payload.get("type") != expect:
            raise EnvResponseError(f"expected a {expect!r} reply to {message['type']!r}, got {payload!r:.120}")
        return payload.get("data", {})
