"""Serve an environment class over HTTP and WebSocket in OpenEnv's wire shape (``openenv-core`` 0.3's
``EnvClient``/``GenericEnvClient`` talk to it unchanged): one environment instance per WebSocket session at ``/ws``
(messages ``reset``/``step``/``state``/``close``), and OpenEnv's stateless HTTP routes ``POST /reset``,
``POST /step``, ``GET /state``, ``GET /health`` (each on a fresh instance, as OpenEnv's server does).

Loopback by default, on a free port; every route sits under a per-server random token (``/<token>/ws``), so the
base URL is the secret (OpenEnv's client sends no headers: the token rides in the URL path). Driving episodes for
rollouts is :mod:`hybridflow.agent.env_loop`'s; what an environment implements is :mod:`hybridflow.agent.environment`'s.
``python -m hybridflow.agent.env_server package.module:Class`` serves a class until interrupted, printing its base URL.
Stability: experimental.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import secrets
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import WSMsgType, web

from hybridflow.agent.environment import EnvResponseError, filter_kwargs, parse_step
from hybridflow.agent.loop_thread import LoopThread
from hybridflow.errors import EngineError

__all__ = ["EnvServer", "main"]


async def _call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``: awaited when it is async, else run in a thread (an environment may block)."""
    if inspect.iscoroutinefunction(function):
        return await function(*args, **kwargs)
    result = await asyncio.to_thread(function, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            await _call(close)


def _error(message: str, code: str) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code}}


class EnvServer:
    """Serves ``factory()`` instances (an environment class and its constructor ``options``) on ``host:port``.

    ``token``: the path prefix every route needs (default: a random one per server; ``""``: none, for a server
    behind your own gateway). ``start()`` binds in a thread of its own and returns :attr:`base_url`.
    """

    def __init__(self, factory: Callable[..., Any], options: Mapping[str, Any] | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None, max_sessions: int = 0) -> None:
        self.factory = factory
        self.options = dict(options or {})
        self.host, self.port = host, port
        self.token = secrets.token_urlsafe(24) if token is None else token
        self.max_sessions = max_sessions
        self.sessions = 0
        self.sessions_opened = 0
        self._server = LoopThread("env-server")
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port/<token>``: what an OpenEnv client's ``base_url`` is (it appends ``/ws``)."""
        if not self._server.running:
            raise EngineError("the environment server is not started; call start() first")
        return f"http://{self.host}:{self.port}{self._prefix}"

    @property
    def _prefix(self) -> str:
        return f"/{self.token}" if self.token else ""

    def start(self, timeout_s: float = 30.0) -> str:
        """Bind and serve in a daemon thread; returns :attr:`base_url`."""
        if not self._server.running:
            try:
                self._server.start(self._bind, self._unbind, timeout_s)
            except BaseException as exc:
                raise EngineError(f"the environment server could not bind {self.host}:{self.port}: {exc}. Fix: free "
                                  "the port or set rollout.env.port=0 (any free port)") from exc
        return self.base_url

    def stop(self) -> None:
        self._server.stop()

    async def _unbind(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _bind(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        prefix = self._prefix
        app.router.add_get(f"{prefix}/health", self._health)
        app.router.add_post(f"{prefix}/reset", self._reset)
        app.router.add_post(f"{prefix}/step", self._step)
        app.router.add_get(f"{prefix}/state", self._state)
        app.router.add_get(f"{prefix}/ws", self._session)
        # stop() does not wait on sessions in flight (a hung environment's step) past a second
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = getattr(getattr(site, "_server", None), "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])

    # --- stateless HTTP routes (OpenEnv's: each request gets a fresh instance) -----------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    async def _reset(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        return await self._stateless(lambda env: self._do_reset(env, body))

    async def _step(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("action"), Mapping):
            return web.json_response({"detail": "the body must be {\"action\": {...}}"}, status=422)
        return await self._stateless(lambda env: self._do_step(env, body["action"]))

    async def _state(self, request: web.Request) -> web.Response:
        return await self._stateless(self._do_state)

    async def _json_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
        except json.JSONDecodeError as exc:
            return web.json_response({"detail": f"invalid JSON: {exc}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"detail": "the body must be a JSON object"}, status=422)
        return body

    async def _stateless(self, action: Callable[[Any], Any]) -> web.Response:
        env = await _call(self.factory, **self.options)
        try:
            return web.json_response(await action(env))
        except Exception as exc:  # noqa: BLE001 - the environment's failure is the response
            return web.json_response({"detail": f"{type(exc).__name__}: {exc}"}, status=500)
        finally:
            await _close(env)

    # --- the session protocol (OpenEnv's /ws) ----------------------------------------------------------------------
    async def _do_reset(self, env: Any, data: Mapping[str, Any]) -> dict[str, Any]:
        return parse_step(await _call(env.reset, **filter_kwargs(env.reset, data))).to_json()

    async def _do_step(self, env: Any, action: Mapping[str, Any]) -> dict[str, Any]:
        return parse_step(await _call(env.step, dict(action))).to_json()

    async def _do_state(self, env: Any) -> dict[str, Any]:
        state = await _call(env.state) if callable(getattr(env, "state", None)) else getattr(env, "state", {})
        if hasattr(state, "model_dump"):
            state = state.model_dump()
        if not isinstance(state, Mapping):
            raise EnvResponseError(f"state() must return a mapping, got {type(state).__name__}")
        return dict(state)

    async def _session(self, request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024)
        await socket.prepare(request)
        if self.max_sessions and self.sessions >= self.max_sessions:
            await socket.send_json(_error(f"{self.sessions} sessions are open, the most this server allows "
                                          f"(max_sessions={self.max_sessions})", "CAPACITY_REACHED"))
            await socket.close()
            return socket
        try:
            env = await _call(self.factory, **self.options)
        except Exception as exc:  # noqa: BLE001 - reported to the client, which fails its episode
            await socket.send_json(_error(f"{type(exc).__name__}: {exc}", "FACTORY_ERROR"))
            await socket.close()
            return socket
        self.sessions += 1
        self.sessions_opened += 1
        try:
            async for message in socket:
                if message.type != WSMsgType.TEXT:
                    break
                reply = await self._answer(env, message.data)
                if reply is None:
                    break
                await socket.send_json(reply)
        finally:
            self.sessions -= 1
            await _close(env)
            await socket.close()
        return socket

    async def _answer(self, env: Any, raw: str) -> dict[str, Any] | None:
        """The reply to one session message (None: the client closed the session)."""
        try:
            message = json.loads(raw)
        except json.JSONDecodeError as exc:
            return _error(f"Invalid JSON: {exc}", "INVALID_JSON")
        kind = message.get("type") if isinstance(message, dict) else None
        data = message.get("data", {}) if isinstance(message, dict) else {}
        try:
            if kind == "reset":
                return {"type": "observation", "data": await self._do_reset(env, data or {})}
            if kind == "step":
                if not isinstance(data, Mapping):
                    return _error("a step message's data must be the action object", "VALIDATION_ERROR")
                return {"type": "observation", "data": await self._do_step(env, data)}
            if kind == "state":
                return {"type": "state", "data": await self._do_state(env)}
            if kind == "close":
                return None
        except Exception as exc:  # noqa: BLE001 - the environment's failure, as OpenEnv reports it
            return _error(f"{type(exc).__name__}: {exc}", "EXECUTION_ERROR")
        return _error(f"Unknown message type: {kind}", "UNKNOWN_TYPE")


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridflow.agent.env_server package.module:Class [--host H] [--port P] [--token T]
    [--options JSON]``: serve until interrupted (SIGINT or SIGTERM); the first line printed is the base URL
    (``rollout.env.url``)."""
    import argparse

    from hybridflow.agent.environment import load_environment_class

    parser = argparse.ArgumentParser(prog="python -m hybridflow.agent.env_server", description=(
        "Serve an environment class over OpenEnv's protocol (/ws sessions; /reset, /step, /state, /health)."))
    parser.add_argument("entry", help="package.module:Class (reset/step/state)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    parser.add_argument("--token", default=None, help="the URL path token (default: a random one; '' for none)")
    parser.add_argument("--options", default="{}", help="the class's constructor keyword arguments, as JSON")
    args = parser.parse_args(argv)
    server = EnvServer(load_environment_class(args.entry, key="entry"), json.loads(args.options), host=args.host,
                       port=args.port, token=args.token)
    # SIGINT and SIGTERM end it, also when it was started with SIGINT ignored (a shell's background job, a pytest-xdist
    # worker's child), where Python installs no KeyboardInterrupt handler of its own
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.default_int_handler)
    print(server.start(), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
