"""An OpenAI-compatible HTTP endpoint in front of a rollout engine: ``/v1/chat/completions`` (tools through the chat
template, ``n``, ``temperature``, ``top_p``, ``max_tokens``, ``logprobs``, streaming), ``/v1/completions`` and
``/v1/models``, on loopback by default, each call authorised by a session's key (derived from a per-run token) and
recorded token for token in that session's log.

Token-in/token-out: a chat prompt is rendered by the tokenizer's chat template, and when the rendered text starts
with the text of a call this session already made (its prompt + completion) the prompt ids are that call's ids plus
the tokens of the new text only, so nothing the model generated is ever re-tokenized. An assistant message the
endpoint returned (found by its tool-call ids or its exact content) is rendered from the raw text the model wrote.
Concurrent requests are batched into one ``generate_from_tokens`` call per sampling setting. Building training
sequences from the log is :mod:`hybridflow.agent.trajectories`'; running agents is :mod:`hybridflow.agent.code_agent`'s.
Stability: experimental.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hybridflow.agent.format import ChatFormat, parse_tool_calls
from hybridflow.agent.loop_thread import LoopThread
from hybridflow.agent.trajectories import CallRecord, SessionLog
from hybridflow.engines import SamplingParams, TokenCompletion, TokenContinuationEngine
from hybridflow.errors import ConfigError, EngineError

__all__ = ["OpenAIEndpoint", "EndpointSession", "RequestError"]

_MAX_CHOICES = 16


class RequestError(Exception):
    """A request the endpoint refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


@dataclass(slots=True)
class EndpointSession:
    """One sample's session: its key, its call budget, its log; ``greedy`` forces temperature 0 (validation)."""

    session_id: str
    api_key: str
    max_calls: int
    greedy: bool = False
    requests: int = 0
    refused: int = 0
    closed: bool = False
    log: SessionLog = field(default_factory=SessionLog)
    #: tool-call id → the raw text of the completion that made it (rendered in place of the returned message)
    raw_by_call_id: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Job:
    prompt_ids: list[int]
    max_tokens: int
    future: asyncio.Future[TokenCompletion]


class OpenAIEndpoint:
    """Serves one engine (capability ``continue_from_tokens``) over HTTP on ``host:port`` (0: a free port).

    ``max_new_tokens`` caps a call's ``max_tokens`` (and is its default); ``max_context_tokens`` caps prompt +
    completion (a call's ``max_tokens`` is cut to the room left; a prompt that leaves none gets OpenAI's
    ``context_length_exceeded``). Sampling seeds come from ``seed`` (a
    request's own ``seed`` is ignored: concurrent calls share one generate call)."""

    def __init__(self, engine: TokenContinuationEngine, chat_format: ChatFormat, *, max_new_tokens: int,
                 max_context_tokens: int, host: str = "127.0.0.1", port: int = 0, seed: int | None = None,
                 model_name: str = "hybridflow-policy") -> None:
        if "continue_from_tokens" not in engine.capabilities:
            raise EngineError(f"the OpenAI endpoint generates from token ids, which needs a rollout engine with "
                              f"capability continue_from_tokens; {type(engine).__name__} has "
                              f"{sorted(engine.capabilities)}. Use rollout.engine: hf or vllm")
        if max_new_tokens < 1 or max_context_tokens <= max_new_tokens:
            raise ConfigError(f"the endpoint needs max_new_tokens >= 1 and max_context_tokens > max_new_tokens; got "
                              f"{max_new_tokens} and {max_context_tokens}")
        self.engine = engine
        self.format = chat_format
        self.max_new_tokens = max_new_tokens
        self.max_context_tokens = max_context_tokens
        self.host, self.port = host, port
        self.seed = seed
        self.model_name = model_name
        self.run_token = secrets.token_urlsafe(24)
        self.sessions: dict[str, EndpointSession] = {}
        self._by_key: dict[str, EndpointSession] = {}
        self._lock = threading.Lock()
        self._server = LoopThread("openai-endpoint")
        self._runner: web.AppRunner | None = None
        self._queue: asyncio.Queue[tuple[tuple[Any, ...], _Job]] | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._engine_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="endpoint-gen")
        self.generate_calls = 0
        self.generate_seconds = 0.0

    # --- lifecycle ----------------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        if not self._server.running:
            raise EngineError("the endpoint is not started; call start() first")
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> str:
        """Bind and serve in a thread of its own; returns :attr:`base_url`."""
        if not self._server.running:
            try:
                self._server.start(self._bind, self._unbind, timeout_s)
            except TimeoutError as exc:
                raise EngineError(f"the OpenAI endpoint did not bind {self.host}:{self.port} within {timeout_s} s") \
                    from exc
            except BaseException as exc:
                raise EngineError(f"the OpenAI endpoint could not bind {self.host}:{self.port}: {exc}. Fix: free the "
                                  "port or set rollout.agent.port=0 (any free port)") from exc
        return self.base_url

    def stop(self) -> None:
        if not self._server.running:
            return
        self._server.stop()
        self._engine_thread.shutdown(wait=False, cancel_futures=True)

    async def _bind(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        self._queue = asyncio.Queue()
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def _unbind(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler
        if self._runner is not None:
            await self._runner.cleanup()

    # --- sessions -----------------------------------------------------------------------------------------------
    def open_session(self, session_id: str, *, max_calls: int, greedy: bool = False) -> EndpointSession:
        """A new session; its ``api_key`` authorises calls recorded under ``session_id``."""
        with self._lock:
            if session_id in self.sessions:
                raise ConfigError(f"endpoint session {session_id!r} is already open")
            session = EndpointSession(session_id=session_id, api_key=f"hf-{self.run_token}-{secrets.token_hex(8)}",
                                      max_calls=max_calls, greedy=greedy)
            self.sessions[session_id] = session
            self._by_key[session.api_key] = session
        return session

    def close_session(self, session_id: str) -> list[CallRecord]:
        """Refuse the session's further calls and return its records (calls still in flight are not recorded)."""
        with self._lock:
            session = self.sessions.pop(session_id)
            session.closed = True
            self._by_key.pop(session.api_key, None)
        return session.log.calls()

    def _session(self, request: web.Request, body: Mapping[str, Any] | None) -> EndpointSession:
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        if not key:
            raise RequestError(401, "You didn't provide an API key. Pass the session's key as a bearer token "
                                    "(Authorization: Bearer <api_key>; the openai client's api_key=).",
                               code="invalid_api_key")
        with self._lock:
            session = self._by_key.get(key)
            if session is None and secrets.compare_digest(key, self.run_token):
                # the run token with the session named in a header or the body's `user` field
                named = request.headers.get("X-Session-Id") or (body or {}).get("user")
                session = self.sessions.get(str(named)) if named is not None else None
                if session is None:
                    raise RequestError(401, f"the run token needs an open session named by the X-Session-Id header "
                                            f"or the body's `user` field; got {named!r}", code="invalid_session")
        if session is None:
            raise RequestError(401, "Incorrect API key provided: it is not the key of an open session of this run "
                                    "(each sample's agent gets its own api_key; a session's key stops working when "
                                    "its agent has ended or timed out).", code="invalid_api_key")
        return session

    def _admit(self, session: EndpointSession) -> None:
        with self._lock:
            if session.closed:
                raise RequestError(401, "the session has ended (its agent finished or timed out)",
                                   code="invalid_api_key")
            if session.requests >= session.max_calls:
                session.refused += 1
                raise RequestError(429, f"the session's call budget is spent: {session.max_calls} calls "
                                        "(rollout.agent.max_calls)", code="call_budget_exhausted",
                                   kind="rate_limit_error")
            session.requests += 1

    # --- generation ---------------------------------------------------------------------------------------------
    async def _generate(self, prompt_ids: list[int], sampling_key: tuple[Any, ...], max_tokens: int,
                        n: int) -> list[TokenCompletion]:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        jobs = [_Job(list(prompt_ids), max_tokens, loop.create_future()) for _ in range(n)]
        for job in jobs:
            self._queue.put_nowait((sampling_key, job))
        try:
            return list(await asyncio.gather(*[job.future for job in jobs]))
        except Exception as exc:  # an engine failure is the server's error (raised again, not swallowed)
            raise RequestError(500, f"generation failed: {type(exc).__name__}: {exc}", kind="server_error") from exc

    async def _schedule(self) -> None:
        """Take every queued job, one generate call per sampling setting, in the engine's thread; repeat."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self._queue.get()]
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            groups: dict[tuple[Any, ...], list[_Job]] = {}
            for key, job in pending:
                groups.setdefault(key, []).append(job)
            for key, jobs in groups.items():
                try:
                    completions = await loop.run_in_executor(self._engine_thread, self._run_engine, key, jobs)
                except Exception as exc:  # noqa: BLE001 - each waiting request answers with it
                    for job in jobs:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                for job, completion in zip(jobs, completions):
                    if not job.future.done():
                        job.future.set_result(completion)

    def _run_engine(self, key: tuple[Any, ...], jobs: list[_Job]) -> list[TokenCompletion]:
        temperature, top_p, stop_ids = key
        width = max(job.max_tokens for job in jobs)
        seed = None if self.seed is None else self.seed + 7919 * self.generate_calls
        self.generate_calls += 1
        sampling = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_new_tokens=width, seed=seed)
        started = time.perf_counter()
        completions = self.engine.generate_from_tokens([job.prompt_ids for job in jobs], sampling,
                                                       stop_token_ids=stop_ids)
        self.generate_seconds += time.perf_counter() - started
        if len(completions) != len(jobs):
            raise EngineError(f"generate_from_tokens returned {len(completions)} completions for {len(jobs)} prefixes")
        clipped = []
        for job, completion in zip(jobs, completions):
            if len(completion.log_probs) != len(completion.token_ids):
                raise EngineError(f"generate_from_tokens returned {len(completion.token_ids)} ids but "
                                  f"{len(completion.log_probs)} log-probs")
            if len(completion.token_ids) > job.max_tokens:  # a prefix of what was sampled is still what was sampled
                completion = TokenCompletion(token_ids=completion.token_ids[:job.max_tokens],
                                             log_probs=completion.log_probs[:job.max_tokens], finish_reason="length")
            clipped.append(completion)
        return clipped

    # --- request parsing ----------------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from exc
        if not isinstance(body, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    def _sampling(self, body: Mapping[str, Any], session: EndpointSession, *,
                  stop_ids: tuple[int, ...]) -> tuple[tuple[Any, ...], int, int]:
        """((temperature, top_p, stop ids), max_tokens, n) of a request, checked."""
        temperature = _number(body, "temperature", 1.0, low=0.0, high=2.0)
        top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
        if top_p == 0.0:
            raise RequestError(400, "top_p must be > 0 and <= 1, got 0", param="top_p", code="invalid_value")
        n = _integer(body, "n", 1, low=1, high=_MAX_CHOICES)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = self.max_new_tokens if limit is None else _integer(body, name, 1, low=1, high=None)
        stop = body.get("stop")
        if stop not in (None, [], ""):
            raise RequestError(400, f"`stop` strings are not supported by this endpoint (got {stop!r}): the model "
                                    "stops at its end-of-turn token and after a tool call; leave `stop` out",
                               param="stop", code="unsupported_parameter")
        if session.greedy:
            temperature = 0.0
        return (temperature, top_p, stop_ids), min(max_tokens, self.max_new_tokens), n

    def _fit_context(self, prompt_ids: Sequence[int], max_tokens: int) -> int:
        """``max_tokens`` cut to the room the context leaves (the call then ends with finish_reason "length", as a
        conversation that ran out of its token budget does in the built-in loop); OpenAI's
        ``context_length_exceeded`` when the prompt leaves no room at all."""
        room = self.max_context_tokens - len(prompt_ids)
        if room < 1:
            raise RequestError(400, f"This model's maximum context length is {self.max_context_tokens} tokens. "
                                    f"However, your messages resulted in {len(prompt_ids)} tokens, which leaves no "
                                    "room for a completion. Please reduce the length of the messages "
                                    "(rollout.agent.max_tokens sets the room after the first prompt).",
                               param="messages", code="context_length_exceeded")
        return min(max_tokens, room)

    def _prompt_from_text(self, session: EndpointSession, text: str) -> tuple[list[int], int | None]:
        """Prompt ids for ``text``: a recorded call's ids + the new text's tokens when ``text`` extends that call's
        prompt + completion text, else the whole text's tokens."""
        parent = session.log.longest_text_prefix(text)
        if parent is None:
            return self.format.encode(text), None
        return list(parent.ids) + self.format.encode(text[len(parent.text):]), parent.index

    # --- handlers -----------------------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request, None)
        except RequestError as error:
            return error.response()
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "hybridflow"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            session = self._session(request, body)
            messages, tools = self._chat_inputs(body, session)
            sampling_key, max_tokens, n = self._sampling(body, session, stop_ids=tuple(self.format.stop_token_ids))
            logprobs = bool(body.get("logprobs") or False)
            if body.get("top_logprobs"):
                raise RequestError(400, "top_logprobs is not supported (the engine returns the sampled token's "
                                        "log-prob only); use logprobs=true without top_logprobs",
                                   param="top_logprobs", code="unsupported_parameter")
            try:
                text = str(self.format.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                                     add_generation_prompt=True))
            except Exception as exc:  # the template's own error (jinja raises many types), reported to the caller
                raise RequestError(400, f"the chat template could not render these messages: "
                                        f"{type(exc).__name__}: {exc}", param="messages") from exc
            prompt_ids, spliced_on = self._prompt_from_text(session, text)
            max_tokens = self._fit_context(prompt_ids, max_tokens)
            self._admit(session)
            completions = await self._generate(prompt_ids, sampling_key, max_tokens, n)
        except RequestError as error:
            return error.response()
        choices = [self._chat_choice(session, index, completion, text, prompt_ids, spliced_on, logprobs)
                   for index, completion in enumerate(completions)]
        usage = _usage(prompt_ids, completions)
        created, response_id = int(time.time()), f"chatcmpl-{secrets.token_hex(12)}"
        extra = {"prompt_token_ids": prompt_ids} if body.get("return_token_ids") else {}
        if body.get("stream"):
            return await self._stream_chat(request, body, response_id, created, choices, usage)
        for choice in choices:
            if not body.get("return_token_ids"):
                choice.pop("token_ids")
        return web.json_response({"id": response_id, "object": "chat.completion", "created": created,
                                  "model": self.model_name, "choices": choices, "usage": usage, **extra})

    def _chat_inputs(self, body: Mapping[str, Any], session: EndpointSession
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            got = "an empty list" if messages == [] else type(messages).__name__
            raise RequestError(400, f"`messages` must be a non-empty list of {{role, content}} objects, got {got}",
                               param="messages", code="invalid_type")
        rendered = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool",
                                                                             "developer"):
                raise RequestError(400, f"messages[{index}] must be an object whose role is system, developer, "
                                        f"user, assistant or tool; got {message!r}", param=f"messages[{index}]",
                                   code="invalid_value")
            rendered.append(self._render_message(message, session, index))
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                  for t in tools):
            raise RequestError(400, "`tools` must be a list of {\"type\": \"function\", \"function\": {name, "
                                    "description, parameters}} objects", param="tools", code="invalid_type")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise RequestError(400, f"tool_choice={choice!r} is not supported: the model decides (use \"auto\")",
                               param="tool_choice", code="unsupported_parameter")
        return rendered, [dict(t) for t in tools] if choice != "none" else []

    def _render_message(self, message: Mapping[str, Any], session: EndpointSession, index: int) -> dict[str, Any]:
        """The message as the template sees it: an assistant turn this session's endpoint wrote becomes the raw text
        the model wrote (tool calls included), so the rendering extends the recorded tokens."""
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text parts carry into a text model
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        if content is not None and not isinstance(content, str):
            raise RequestError(400, f"messages[{index}].content must be a string, a list of text parts or null; got "
                                    f"{type(content).__name__}", param=f"messages[{index}].content",
                               code="invalid_type")
        out: dict[str, Any] = {"role": "system" if message["role"] == "developer" else message["role"],
                               "content": content or ""}
        calls = message.get("tool_calls") or []
        if message["role"] == "assistant" and calls:
            ids = [call.get("id") for call in calls if isinstance(call, dict)]
            raws = {session.raw_by_call_id.get(str(i)) for i in ids}
            if len(raws) == 1 and None not in raws:
                out["content"] = raws.pop()  # the model's own text: content and the <tool_call> blocks
            else:
                out["tool_calls"] = calls
        for key in ("name", "tool_call_id"):
            if key in message:
                out[key] = message[key]
        return out

    def _chat_choice(self, session: EndpointSession, index: int, completion: TokenCompletion, text: str,
                     prompt_ids: list[int], spliced_on: int | None, logprobs: bool) -> dict[str, Any]:
        ids = list(completion.token_ids)
        content_ids = ids[:-1] if ids and ids[-1] == self.format.eos_token_id else ids
        content = self.format.decode(content_ids)
        call_index = session.log.reserve()
        calls = [call for call in parse_tool_calls(content) if call.error is None and isinstance(call.name, str)]
        call_ids = [f"call_{call_index}_{k}_{secrets.token_hex(4)}" for k in range(len(calls))]
        tool_calls: list[dict[str, Any]] = [
            {"id": call_id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for call_id, call in zip(call_ids, calls)]
        for call_id in call_ids:
            session.raw_by_call_id[call_id] = content
        session.log.add(CallRecord(index=call_index, prompt_ids=tuple(prompt_ids), completion_ids=tuple(ids),
                                   log_probs=tuple(completion.log_probs), finish_reason=completion.finish_reason,
                                   prompt_text=text, completion_text=self.format.decode(ids),
                                   tool_calls=len(tool_calls), spliced_on=spliced_on))
        visible = content.split("<tool_call>")[0] if tool_calls else content
        message: dict[str, Any] = {"role": "assistant", "content": visible or (None if tool_calls else "")}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else completion.finish_reason
        choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish,
                                  "logprobs": {"content": self._token_logprobs(ids, completion.log_probs)}
                                  if logprobs else None, "token_ids": ids}
        return choice

    def _token_logprobs(self, ids: Sequence[int], log_probs: Sequence[float]) -> list[dict[str, Any]]:
        pieces = _pieces(self.format, ids)
        return [{"token": piece, "logprob": float(lp), "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                for piece, lp in zip(pieces, log_probs)]

    async def _stream_chat(self, request: web.Request, body: Mapping[str, Any], response_id: str, created: int,
                           choices: list[dict[str, Any]], usage: dict[str, int]) -> web.StreamResponse:
        """The completed choices as server-sent chunks (the engine generates a call's tokens in one go, so the
        chunks follow generation: one per token of content, one for the tool calls, one with the finish reason)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        base = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}

        async def send(payload: Mapping[str, Any]) -> None:
            await response.write(f"data: {json.dumps({**base, **payload})}\n\n".encode())

        for choice in choices:
            index, message = choice["index"], choice["message"]
            await send({"choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]})
            ids = choice["token_ids"]
            lps = choice["logprobs"]["content"] if choice["logprobs"] else [None] * len(ids)
            pieces = _pieces(self.format, ids[:-1] if ids and ids[-1] == self.format.eos_token_id else ids)
            visible = message["content"] or ""
            sent = 0
            for piece, lp in zip(pieces, lps):
                take = piece[:max(0, len(visible) - sent)]
                sent += len(take)
                await send({"choices": [{"index": index, "delta": {"content": take} if take else {},
                                         "logprobs": {"content": [lp]} if lp is not None else None,
                                         "finish_reason": None}]})
            if "tool_calls" in message:
                deltas = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                await send({"choices": [{"index": index, "delta": {"tool_calls": deltas}, "logprobs": None,
                                         "finish_reason": None}]})
            await send({"choices": [{"index": index, "delta": {}, "logprobs": None,
                                     "finish_reason": choice["finish_reason"]}]})
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            await send({"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            session = self._session(request, body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                text, prompt_ids, spliced_on = "", [int(t) for t in prompt], None
            elif isinstance(prompt, str) and prompt:
                text = prompt
                prompt_ids, spliced_on = self._prompt_from_text(session, prompt)
            else:
                raise RequestError(400, f"`prompt` must be one non-empty string or one list of token ids (one prompt "
                                        f"per request), got {type(prompt).__name__}", param="prompt",
                                   code="invalid_type")
            if "max_tokens" not in body:
                body = {**body, "max_tokens": 16}  # OpenAI's default for completions
            sampling_key, max_tokens, n = self._sampling(body, session, stop_ids=())
            want = body.get("logprobs")
            if want is not None and (not isinstance(want, int) or isinstance(want, bool) or not 0 <= want <= 1):
                raise RequestError(400, f"logprobs must be 0 or 1 here (the sampled token's log-prob; no top "
                                        f"alternatives), got {want!r}", param="logprobs", code="unsupported_parameter")
            if body.get("echo"):
                raise RequestError(400, "echo is not supported; the prompt ids come back with return_token_ids=true",
                                   param="echo", code="unsupported_parameter")
            vocab = len(self.format.tokenizer)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise RequestError(400, f"prompt token ids must lie in [0, {vocab}); got "
                                        f"{[t for t in prompt_ids if not 0 <= t < vocab][:5]}", param="prompt",
                                   code="invalid_value")
            max_tokens = self._fit_context(prompt_ids, max_tokens)
            self._admit(session)
            completions = await self._generate(prompt_ids, sampling_key, max_tokens, n)
        except RequestError as error:
            return error.response()
        choices = []
        for index, completion in enumerate(completions):
            ids = list(completion.token_ids)
            completion_text = self.format.decode(ids)
            session.log.add(CallRecord(index=session.log.reserve(), prompt_ids=tuple(prompt_ids),
                                       completion_ids=tuple(ids), log_probs=tuple(completion.log_probs),
                                       finish_reason=completion.finish_reason, prompt_text=text,
                                       completion_text=completion_text if text else "", spliced_on=spliced_on))
            pieces = _pieces(self.format, ids)
            choice: dict[str, Any] = {"index": index, "text": completion_text,
                                      "finish_reason": completion.finish_reason, "logprobs": None}
            if body.get("logprobs") is not None:
                offsets = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
                choice["logprobs"] = {"tokens": pieces, "token_logprobs": [float(v) for v in completion.log_probs],
                                      "top_logprobs": None, "text_offset": offsets}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            choices.append(choice)
        usage = _usage(prompt_ids, completions)
        payload: dict[str, Any] = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
                                   "created": int(time.time()), "model": self.model_name, "choices": choices,
                                   "usage": usage}
        if body.get("return_token_ids"):
            payload["prompt_token_ids"] = prompt_ids
        if not body.get("stream"):
            return web.json_response(payload)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for choice in choices:
            chunk = {**payload, "choices": [choice]}
            chunk.pop("usage")
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _pieces(chat_format: ChatFormat, ids: Sequence[int]) -> list[str]:
    """Each id's text as it extends the decoded text, so the pieces concatenate to the decoded whole: a prefix that
    ends inside a character (a byte-level token holding part of its UTF-8 bytes decodes to U+FFFD) gives an empty
    piece, and the character comes whole with the id that completes it."""
    pieces, emitted = [], ""
    for end in range(1, len(ids) + 1):
        now = chat_format.decode(ids[:end])
        if end < len(ids) and now.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(now[len(emitted):] if now.startswith(emitted) else now)
        emitted = now
    return pieces


def _usage(prompt_ids: Sequence[int], completions: Sequence[TokenCompletion]) -> dict[str, int]:
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": generated,
            "total_tokens": len(prompt_ids) + generated}


def _number(body: Mapping[str, Any], name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
        raise RequestError(400, f"{name} must be a number in [{low}, {high}], got {value!r}", param=name,
                           code="invalid_value")
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int, *, low: int, high: int | None) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(400, f"{name} must be an integer {bound}, got {value!r}", param=name, code="invalid_value")
    return value
