"""An asyncio event loop serving in a daemon thread of its own: what the OpenAI endpoint and the environment server
each run their aiohttp app on (they are called from synchronous worker code)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

__all__ = ["LoopThread"]


class LoopThread:
    """``start(bind, unbind)``: a new loop in a daemon thread runs ``bind()`` (its failure is raised to the caller),
    then serves until :meth:`stop`, then runs ``unbind()`` and closes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, bind: Callable[[], Awaitable[None]], unbind: Callable[[], Awaitable[None]],
              timeout_s: float) -> None:
        """Raises what ``bind()`` raised, or :class:`TimeoutError` when it did not finish within ``timeout_s``."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(bind())
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(unbind())
            loop.close()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failure:
            self._thread = None
            raise failure[0] if failure else TimeoutError(f"not bound within {timeout_s} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)
        self._thread = None
