"""A request answered before its body was read (413 for a body over the limit, 401, 404, 415)
must not hold its connection forever. hypercorn hands body chunks to the app through a queue of
`max_app_queue_size` messages; once the app has answered without reading, nothing takes from
that queue, so when it is full the connection's reader waits on it for good: the client's write
stalls, the answer's `Connection: close` is never acted on, and a shutdown waits out its
graceful timeout for the connection. Here, from the answer's last message on, the rest of the
request is taken off the queue and dropped, until its end or the disconnect that closing the
connection (or the stream) puts there."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class DropUnreadBody:
    """ASGI middleware: after an HTTP answer, the unread rest of its request is discarded."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._draining: set[asyncio.Task] = set()  # referenced until each one ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ended = False

        async def tracked_receive() -> Message:
            nonlocal ended
            message = await receive()
            ended = ended or request_ended(message)
            return message

        async def guarded_send(message: Message) -> None:
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last and not ended:
                # Before the send: hypercorn puts the disconnect while this send runs.
                task = asyncio.ensure_future(drop_rest(tracked_receive))
                self._draining.add(task)
                task.add_done_callback(self._draining.discard)
            await send(message)

        await self.app(scope, tracked_receive, guarded_send)


def request_ended(message: Message) -> bool:
    body_done = message["type"] == "http.request" and not message.get("more_body", False)
    return body_done or message["type"] == "http.disconnect"


async def drop_rest(receive: Receive) -> None:
    while not request_ended(await receive()):
        pass
