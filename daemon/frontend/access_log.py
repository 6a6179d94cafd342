"""One access line per HTTP request, whatever its status, written when the answer is complete:

    127.0.0.1:50312 "POST /v1/chat/completions" 200 0.412s id=chatcmpl-1f2e model=qwen
        prompt_tokens=21 completion_tokens=16

(one line). Handlers add what they know to the request's AccessNote (request id, model, token
counts, the error message of an error answer); never prompt or output text. 5xx answers but 503
log at ERROR, the rest at INFO."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cpud.settings.errors import one_line

log = logging.getLogger("cpud.access")
SCOPE_KEY = "cpud.access"
MAX_PATH_CHARS = 200


@dataclass
class AccessNote:
    """What a handler learnt about its request, for the access line."""

    request_id: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None  # "code: message" of an error answer
    failed: bool = False  # an internal error after the status went out (a stream)


def access_note(where: Request | Scope) -> AccessNote:
    """The request's note (a detached one outside AccessLog, e.g. in unit tests)."""
    scope = where.scope if isinstance(where, Request) else where
    note = scope.get(SCOPE_KEY)
    return note if isinstance(note, AccessNote) else AccessNote()


def logs_access(scope: Scope) -> bool:
    """True inside AccessLog: the request's access line will carry its note."""
    return isinstance(scope.get(SCOPE_KEY), AccessNote)


def _path(scope: Scope) -> str:
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    text = raw.decode("latin-1")
    safe = "".join(c if c.isprintable() and c not in '" ' else f"\\x{ord(c):02x}" for c in text)
    return safe if len(safe) <= MAX_PATH_CHARS else safe[:MAX_PATH_CHARS] + "..."


def _client(scope: Scope) -> str:
    client = scope.get("client")
    if not client:
        return "-"
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def access_line(scope: Scope, status: int, seconds: float, note: AccessNote) -> str:
    parts = [
        f'{_client(scope)} "{scope.get("method", "-")} {_path(scope)}"',
        str(status) if status else "-",
        f"{seconds:.3f}s",
    ]
    if note.request_id:
        parts.append(f"id={note.request_id}")
    if note.model:
        parts.append(f"model={one_line(note.model, 100).replace(' ', '_')}")
    if note.prompt_tokens is not None:
        parts.append(f"prompt_tokens={note.prompt_tokens}")
    if note.completion_tokens is not None:
        parts.append(f"completion_tokens={note.completion_tokens}")
    if note.error:
        parts.append(f"error={one_line(note.error, 300)}")
    return " ".join(parts)


class AccessLog:
    """ASGI middleware, outermost: times each HTTP request and logs its access line."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        note = AccessNote()
        scope[SCOPE_KEY] = note
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            if not status:
                status = 500
                note.error = note.error or f"internal_error: {type(exc).__name__}"
            raise
        finally:
            level = logging.INFO
            if note.failed or (status >= 500 and status != 503):
                level = logging.ERROR
            log.log(level, "%s", access_line(scope, status, time.perf_counter() - started, note))
