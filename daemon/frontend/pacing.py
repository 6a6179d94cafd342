"""Large request bodies share one byte rate and a few reading slots: past the first
`free_bytes` of a body, its bytes are read no faster than `bytes_per_s` across all clients
together, and at most `slots` such bodies are read at once. Small bodies never wait; a flood
of huge ones waits in its senders' TCP buffers instead of taking the CPU and the memory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class BodyPacer:
    def __init__(self, bytes_per_s: float, free_bytes: int, slots: int):
        self.bytes_per_s = bytes_per_s
        self.free_bytes = free_bytes
        self._slots = asyncio.Semaphore(slots)
        self._next_free = 0.0  # monotonic time when the byte budget is clear again

    async def take_slot(self) -> None:
        await self._slots.acquire()

    async def wait_for_budget(self, nbytes: int) -> None:
        now = time.monotonic()
        start = max(now, self._next_free)
        self._next_free = start + nbytes / self.bytes_per_s
        if start > now:
            await asyncio.sleep(start - now)

    @asynccontextmanager
    async def body(self) -> AsyncIterator[PacedBody]:
        paced = PacedBody(self)
        try:
            yield paced
        finally:
            if paced.holds_slot:
                self._slots.release()


class PacedBody:
    """One body being read: call `admit` before taking each chunk."""

    def __init__(self, pacer: BodyPacer):
        self.pacer = pacer
        self.received = 0
        self.holds_slot = False

    async def admit(self, chunk: int) -> None:
        pacer = self.pacer
        paced = min(chunk, max(0, self.received + chunk - pacer.free_bytes))
        self.received += chunk
        if paced == 0:
            return
        if not self.holds_slot:
            await pacer.take_slot()
            self.holds_slot = True
        await pacer.wait_for_budget(paced)
