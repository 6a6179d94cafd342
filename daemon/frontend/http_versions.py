"""Which HTTP versions the cleartext port speaks. HTTP/1.1 always. HTTP/2 (with prior knowledge,
or after an `Upgrade: h2c` request) only when turned on, and then with a bound on stream resets:
a connection whose client resets more than `max_resets` streams within `reset_window_s` seconds
is closed with GOAWAY (ENHANCE_YOUR_CALM), and a stream opened and reset within what one read
brought starts no request. Without these a client opening and resetting streams in a loop
("rapid reset") starts requests faster than any limit on concurrent streams can hold back.

Off, a prior-knowledge preface gets a 505 naming the flag and the connection is closed; an
`Upgrade: h2c` request is answered in HTTP/1.1, as a server that ignores an upgrade does.

hypercorn speaks both forms of cleartext HTTP/2 whenever the `h2` package is importable and has
no setting to stop it: `serve` puts its own protocol wrapper in hypercorn's TCP server while it
runs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import h2.errors
import h2.events
import h11
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from starlette.types import ASGIApp

log = logging.getLogger("cpud.frontend")
HTTP2_OFF = b"HTTP/2 is off on this server: speak HTTP/1.1, or start cpud with --http2\n"


@dataclass(frozen=True)
class Http2Policy:
    enabled: bool = False
    max_resets: int = 100  # stream resets a connection may make within reset_window_s
    reset_window_s: float = 10.0


class ServerHttpConfig(HypercornConfig):
    """hypercorn's settings with the HTTP/2 policy, which every connection's protocol reads."""

    http2: Http2Policy = Http2Policy()


def policy(config: HypercornConfig) -> Http2Policy:
    return getattr(config, "http2", Http2Policy())


class _Refused(Exception):
    """The connection was answered and closed: nothing more to do with it."""


class H11Only(H11Protocol):
    """HTTP/1.1 that leaves HTTP/2 alone while it is off."""

    async def _check_protocol(self, event: h11.Request) -> None:
        if policy(self.config).enabled:
            return await super()._check_protocol(event)
        if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
            headers = [(b"content-type", b"text/plain"), (b"connection", b"close")]
            headers.append((b"content-length", b"%d" % len(HTTP2_OFF)))
            await self._send_h11_event(h11.Response(status_code=505, headers=headers))
            await self._send_h11_event(h11.Data(data=HTTP2_OFF))
            await self._send_h11_event(h11.EndOfMessage())
            await self.send(Closed())
            raise _Refused
        # An `Upgrade: h2c` request goes on as the HTTP/1.1 request it also is.


class ResetLimitedH2(H2Protocol):
    """HTTP/2 whose client may reset only so many streams in a while."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self._resets: deque[float] = deque()

    async def handle(self, event: Event) -> None:
        await super().handle(event)
        if isinstance(event, Closed):
            # hypercorn stops sending when the connection closes, but a handler that answers
            # later would wait forever for its stream's buffer to drain: release them all.
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        limits = policy(self.config)
        now = time.monotonic()
        resets = self._resets
        resets.extend(now for e in events if isinstance(e, h2.events.StreamReset))
        while resets and now - resets[0] > limits.reset_window_s:
            resets.popleft()
        if len(resets) <= limits.max_resets:
            return await super()._handle_events(self._unstarted(events))
        # None of this batch's requests start: the connection ends here.
        log.warning(
            "closed an HTTP/2 connection from %s: more than %d stream resets in %g s",
            self.client[0] if self.client else "-",
            limits.max_resets,
            limits.reset_window_s,
        )
        resets.clear()
        self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        await self._flush()
        await self.send(Closed())

    def _unstarted(self, events: list[h2.events.Event]) -> list[h2.events.Event]:
        """The events less those of streams opened and reset within them: the client gave up
        on those requests before the server read them, so none of them starts."""
        reset = {e.stream_id for e in events if isinstance(e, h2.events.StreamReset)}
        if not reset:
            return events
        opened = {e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)}
        gone = reset & opened
        kept = []
        for event in events:
            if getattr(event, "stream_id", None) not in gone:
                kept.append(event)
            elif isinstance(event, h2.events.DataReceived):  # its bytes still count as read
                self.connection.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id
                )
        return kept


class GuardedProtocols(ProtocolWrapper):
    """hypercorn's per-connection protocol switch, with the classes above."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._parts = (
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.state,
            self.ssl,
            self.client,
            self.server,
            self.send,
        )
        h2_by_alpn = isinstance(self.protocol, H2Protocol)
        self.protocol = (ResetLimitedH2 if h2_by_alpn else H11Only)(*self._parts)

    async def handle(self, event: Event) -> None:
        try:
            return await self.protocol.handle(event)
        except _Refused:
            return None
        except H2ProtocolAssumedError as error:
            self.protocol = ResetLimitedH2(*self._parts)
            await self.protocol.initiate()
            data = error.data
        except H2CProtocolRequiredError as error:
            self.protocol = ResetLimitedH2(*self._parts)
            await self.protocol.initiate(error.headers, error.settings)
            data = error.data
        if data:
            await self.protocol.handle(RawData(data=data))
        return None


@contextmanager
def guarded_protocols() -> Iterator[None]:
    """hypercorn's TCP server uses GuardedProtocols for the connections it accepts meanwhile."""
    from hypercorn.asyncio import tcp_server

    current = getattr(tcp_server, "ProtocolWrapper", None)
    if current is GuardedProtocols:  # another server of this process put it there
        yield
        return
    if current is not ProtocolWrapper:
        raise RuntimeError(
            "this hypercorn version does not create connections the way cpud expects; "
            "cpud cannot control its HTTP/2"
        )
    tcp_server.ProtocolWrapper = GuardedProtocols  # type: ignore[misc]
    try:
        yield
    finally:
        tcp_server.ProtocolWrapper = ProtocolWrapper  # type: ignore[misc]


async def serve(
    app: ASGIApp, config: ServerHttpConfig, shutdown_trigger: Callable[[], Awaitable[object]]
) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve

    from cpud.frontend.unread_body import DropUnreadBody

    with guarded_protocols():
        app = DropUnreadBody(app)
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
