"""How the requests on the engine's paths end when the server stops serving them.

Every such HTTP request is counted from its arrival to the last byte of its answer (`Tracked`).
Two signals end them with an error answer instead of a cut connection:

* refusal (a drain began, or the engine failed): a request still waiting for the tokenizer
  threads is answered at once; one admitted to the engine goes on.
* cut (the drain timeout passed, or the engine failed): every request still open is answered
  with the error, a stream with an error event.

The HTTP server stops only after the open requests have been answered (or a grace passed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from cpud.frontend.errors import APIError

T = TypeVar("T")
CANCEL_GRACE_S = 1.0  # a handler told to stop gets this long to clean up (abort its requests)


class Lifecycle:
    """Lives on the event loop's thread; every method is called from it."""

    def __init__(self) -> None:
        self.open = 0  # tracked requests not yet answered in full
        self.refused = 0  # answered 503 because the server was draining
        self.refusal: APIError | None = None
        self.cut_error: APIError | None = None
        self._refused: asyncio.Future | None = None
        self._cut: asyncio.Future | None = None

    @staticmethod
    def _signal(current: asyncio.Future | None, fired: bool) -> asyncio.Future:
        """The signal's future on the running loop (a state served by a second loop, as tests
        do, gets a new one), done once the signal has fired."""
        loop = asyncio.get_running_loop()
        if current is None or current.get_loop() is not loop:
            current = loop.create_future()
        if fired and not current.done():
            current.set_result(None)
        return current

    def refuse(self, error: APIError) -> None:
        """Requests not yet admitted get `error` now (the first refusal stays)."""
        if self.refusal is None:
            self.refusal = error
        self._refused = self._signal(self._refused, True)

    def cut(self, error: APIError) -> None:
        """Every open request gets `error` now; a refusal too, for those still arriving."""
        self.refuse(error)
        if self.cut_error is None:
            self.cut_error = error
        self._cut = self._signal(self._cut, True)

    async def before_admission(self, work: Awaitable[T]) -> T:
        """`work` (tokenizing, templating), unless the server stops admitting meanwhile."""
        self._refused = self._signal(self._refused, self.refusal is not None)
        return await self._unless(work, self._refused, lambda: self.refusal)

    async def until_cut(self, work: Awaitable[T]) -> T:
        """`work` (a request's handler), unless the open requests are cut meanwhile."""
        self._cut = self._signal(self._cut, self.cut_error is not None)
        return await self._unless(work, self._cut, lambda: self.cut_error)

    @staticmethod
    async def _unless(
        work: Awaitable[T], signal: asyncio.Future, error: Callable[[], APIError | None]
    ) -> T:
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait({task, signal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped = not task.done()
            if stopped:
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not stopped:
            return task.result()
        raised = error()
        assert raised is not None  # the signal came first
        raise raised

    async def settle(self, timeout: float) -> bool:
        """Wait until every tracked request is answered; False if `timeout` passed first."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return not self.open


class Tracked:
    """ASGI middleware: counts the HTTP requests on `paths` from arrival to the end of the
    answer in `lifecycle.open`."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, paths: Collection[str]):
        self.app = app
        self.lifecycle = lifecycle
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        self.lifecycle.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.open -= 1
