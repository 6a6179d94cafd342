"""The X-Request-Id response header on every answer: the client's own id when it sent a
usable one, else the id the answer carries (chatcmpl-..., resp_...), else a fresh one. The
access line names the same id."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cpud.frontend.access_log import access_note

HEADER = b"x-request-id"
MAX_ID_CHARS = 256


def client_request_id(scope: Scope) -> str | None:
    """The client's X-Request-Id when it is printable ASCII of at most MAX_ID_CHARS."""
    for name, value in scope.get("headers", ()):
        if name.lower() == HEADER:
            text = value.decode("latin-1").strip()
            if 0 < len(text) <= MAX_ID_CHARS and text.isascii() and text.isprintable():
                return text
            return None
    return None


class RequestIdHeader:
    """ASGI middleware inside AccessLog: adds X-Request-Id to each HTTP answer."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = client_request_id(scope)
        note = access_note(scope)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                request_id = given or note.request_id or uuid.uuid4().hex
                if note.request_id is None:
                    note.request_id = request_id
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                headers.append((HEADER, request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, sending)
