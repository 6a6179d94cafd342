"""The HTTP application: routes, body limits, API key, errors in OpenAI's shape."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from cpud import __version__
from cpud.errors import RequestError
from cpud.frontend.errors import APIError, bad_request, from_validation
from cpud.frontend.openai_api import chat_job, completion_job, respond
from cpud.frontend.openapi import openapi_document
from cpud.frontend.requests import chat_prompt, check_model
from cpud.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cpud.frontend.state import Phase, ServerState

Handler = Callable[[Request], Awaitable[Response]]
OPEN_PATHS = frozenset({"/health", "/version"})
NEED_ENGINE = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413,
            f"request body over {limit} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(
                413,
                f"request body over {limit} bytes",
                "invalid_request_error",
                None,
                "request_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def decode(request: Request, state: ServerState, kind: type) -> object:
    raw = await read_body(request, state.config.max_body_bytes)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def guarded(
    state: ServerState,
    endpoint: str,
    handler: Callable[[Request, ServerState], Awaitable[Response]],
) -> Handler:
    """Errors become OpenAI-shaped responses; every answer is counted."""

    async def run(request: Request) -> Response:
        try:
            if state.phase is not Phase.READY and endpoint in NEED_ENGINE:
                raise APIError(
                    503,
                    f"the server is {state.phase.value}",
                    "service_unavailable",
                    None,
                    state.phase.value,
                    {"Retry-After": "5"},
                )
            response = await handler(request, state)
        except APIError as exc:
            response = exc.response()
        except RequestError as exc:
            response = bad_request(str(exc), exc.param, exc.code).response()
        state.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    return run


async def completions(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, CompletionRequest)
    check_model(state, body.model)
    return await respond(state, request, completion_job(state, body))


async def chat_completions(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, ChatCompletionRequest)
    check_model(state, body.model)
    return await respond(state, request, chat_job(state, body))


async def models(request: Request, state: ServerState) -> Response:
    created = int(time.time())
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "cpud",
            "max_model_len": state.config.max_model_len,
        }
        for name in state.config.served_model_names
    ]
    return JSONResponse({"object": "list", "data": data})


async def tokenize(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, TokenizeRequest)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        chat = ChatCompletionRequest(messages=body.messages)
        tokens = chat_prompt(state, chat).token_ids
    return JSONResponse(
        {"tokens": tokens, "count": len(tokens), "max_model_len": state.config.max_model_len}
    )


async def detokenize(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, DetokenizeRequest)
    check_model(state, body.model)
    vocab = state.engine.engine.config.model.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})


async def health(request: Request, state: ServerState) -> Response:
    if state.phase is Phase.READY and state.engine_alive:
        return JSONResponse({"status": "ok"})
    failed = state.phase is Phase.READY and not state.engine_alive
    status = "engine failed" if failed else state.phase.value
    return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "5"})


async def version(request: Request, state: ServerState) -> Response:
    return JSONResponse({"version": __version__})


async def metrics(request: Request, state: ServerState) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request, state: ServerState) -> Response:
    return Response(json.dumps(openapi_document()), media_type="application/json")


class ApiKeyGate:
    """Deny by default: every path but the open ones needs `Authorization: Bearer <key>`.
    The decision uses the raw request path, so encoded or dotted variants cannot slip by."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str]):
        self.app = app
        self.key = key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("raw_path") or scope["path"].encode()
        if raw.decode("latin-1") in self.open_paths and raw.decode("latin-1") == scope["path"]:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        if hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        response = APIError(
            401,
            "a valid API key is required: send Authorization: Bearer <key>",
            "authentication_error",
            None,
            "invalid_api_key",
        ).response()
        await response(scope, receive, send)


def create_app(state: ServerState) -> ASGIApp:
    routes = [
        ("/v1/completions", completions, ["POST"]),
        ("/v1/chat/completions", chat_completions, ["POST"]),
        ("/v1/models", models, ["GET"]),
        ("/tokenize", tokenize, ["POST"]),
        ("/detokenize", detokenize, ["POST"]),
        ("/health", health, ["GET"]),
        ("/version", version, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/openapi.json", openapi, ["GET"]),
    ]
    app: ASGIApp = Starlette(
        routes=[Route(path, guarded(state, path, fn), methods=m) for path, fn, m in routes],
        exception_handlers={
            404: lambda request, exc: APIError(
                404, f"no route {request.url.path}", "not_found_error"
            ).response(),
            405: lambda request, exc: APIError(
                405,
                f"{request.method} is not allowed on {request.url.path}",
                "invalid_request_error",
            ).response(),
        },
    )
    if state.config.api_key:
        open_paths = OPEN_PATHS if state.config.metrics_need_key else OPEN_PATHS | {"/metrics"}
        app = ApiKeyGate(app, state.config.api_key, open_paths)
    return app
