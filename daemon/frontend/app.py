"""The HTTP application: routes, body limits, API key, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from cpud import __version__
from cpud.frontend.access_log import AccessLog, access_note, logs_access
from cpud.frontend.anthropic_answer import error_response
from cpud.frontend.anthropic_api import counted_tokens, respond_messages
from cpud.frontend.anthropic_schemas import CountTokensRequest, MessagesRequest
from cpud.frontend.embeddings_api import respond_embeddings
from cpud.frontend.errors import APIError, bad_request, from_validation
from cpud.frontend.jobs import chat_job, completion_job
from cpud.frontend.lifecycle import Tracked
from cpud.frontend.null_fields import decode_without_unknown_nulls, unknown_null_field
from cpud.frontend.openai_api import respond
from cpud.frontend.openapi import openapi_document
from cpud.frontend.pacing import BodyPacer
from cpud.frontend.request_id import RequestIdHeader
from cpud.frontend.requests import (
    chat_prompt,
    check_generates,
    check_model,
    check_text_size,
    refuse_unsupported,
)
from cpud.frontend.responses_api import respond_responses
from cpud.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from cpud.frontend.state import Phase, ServerState
from cpud.frontend.vllm_render import rendered_chat, rendered_completions, rendered_responses
from cpud.frontend.vllm_worker import flush_prefix_cache, model_info, server_info, worker_load
from cpud.settings.cors_policy import CorsPolicy
from cpud.settings.errors import RequestError, one_line

log = logging.getLogger("cpud.frontend")
Handler = Callable[[Request], Awaitable[Response]]
OPEN_PATHS = frozenset({"/health", "/version"})
NEED_ENGINE = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/responses",
        "/v1/responses/render",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/get_model_info",
        "/get_server_info",
        "/flush_cache",
        "/reset_prefix_cache",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)


def body_too_large(limit: int) -> APIError:
    # The rest of the body is never read: the connection closes after the answer, so a client
    # still writing it gets the answer or a reset, not a stalled write.
    return APIError(
        413,
        f"request body over {limit} bytes",
        "invalid_request_error",
        None,
        "request_too_large",
        {"Connection": "close"},
    )


async def read_body(request: Request, limit: int, pacer: BodyPacer) -> bytearray:
    body = bytearray()
    async with pacer.body() as paced:
        async for chunk in request.stream():
            await paced.admit(len(chunk))
            body += chunk
            if len(body) > limit:
                raise body_too_large(limit)
    return body


def check_json_content_type(request: Request) -> None:
    """JSON routes take application/json only: a web page can send text/plain or form bodies
    to a local daemon cross-site without a CORS preflight, but not this."""
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"the request body must be JSON sent as Content-Type: application/json, "
            f"not {declared or 'no content type'}",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )


async def decode(request: Request, state: ServerState, kind: type) -> object:
    check_json_content_type(request)
    limit = state.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    try:
        # A body still arriving when the server stops admitting gets the refusal (a drain
        # does not wait for it).
        raw = await state.lifecycle.before_admission(
            asyncio.wait_for(read_body(request, limit, state.body_pacer), state.config.body_seconds)
        )
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {state.config.body_seconds:g} s",
            "invalid_request_error",
            None,
            "request_timeout",
        ) from None
    try:
        body = decoded(raw, kind)
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    except msgspec.ValidationError as exc:
        raise unsupported_field(exc) or from_validation(exc) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    refuse_unsupported(body)
    return body


def decoded(raw: bytearray, kind: type) -> object:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        if unknown_null_field(exc) is None:
            raise
    return decode_without_unknown_nulls(raw, kind)


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


def unsupported_field(exc: msgspec.ValidationError) -> APIError | None:
    """A field the request types do not know: cpud does not implement it, say so by name."""
    match = _UNKNOWN_FIELD.search(str(exc))
    if match is None:
        return None
    name, where = match.group(1), match.group(2)
    path = f"{where}.{name}" if where else name
    return bad_request(
        f"{path} is not supported by cpud; remove it from the request",
        param=path,
        code="unsupported_parameter",
    )


def answered(
    state: ServerState, scope: Scope, endpoint: str, error: APIError, detail: str | None = None
) -> None:
    """Count an error answer and put its message on the request's access line (or, for an app
    run without AccessLog, log it in a line of its own)."""
    state.metrics.requests.labels(endpoint, str(error.status)).inc()
    message = f"{error.code or error.type}: {detail or error.message}"
    if logs_access(scope):
        access_note(scope).error = message
        return
    level = logging.ERROR if error.status == 500 else logging.INFO
    method = scope.get("method", "-")
    log.log(level, "%s %s -> %d %s", method, endpoint, error.status, one_line(message, 300))


def guarded(
    state: ServerState,
    endpoint: str,
    handler: Callable[[Request, ServerState], Awaitable[Response]],
) -> Handler:
    """Errors become OpenAI-shaped responses; every answer is counted."""

    async def run(request: Request) -> Response:
        error: APIError | None = None
        detail = None
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
            work = handler(request, state)
            if endpoint in NEED_ENGINE:
                work = state.lifecycle.until_cut(work)
            response = await work
        except APIError as exc:
            error = exc
        except RequestError as exc:
            error = bad_request(str(exc), exc.param, exc.code)
        except ClientDisconnect:
            error = APIError(499, "client disconnected", "client_closed_request")
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            error = APIError(
                500,
                f"internal error ({type(exc).__name__}); the server logged it",
                "internal_error",
                None,
                "internal_error",
            )
        if error is None:
            state.metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response
        if error.code == Phase.DRAINING.value:
            state.lifecycle.refused += 1
        answered(state, request.scope, endpoint, error, detail)
        return error_response(endpoint, error)

    return run


async def completions(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, CompletionRequest)
    check_model(state, body.model)
    check_generates(state, body.model)
    return await respond(state, request, await state.off_loop(completion_job, state, body))


async def chat_completions(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, ChatCompletionRequest)
    check_model(state, body.model)
    check_generates(state, body.model)
    return await respond(state, request, await state.off_loop(chat_job, state, body))


async def render_completions(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, CompletionRequest)
    check_model(state, body.model)
    check_generates(state, body.model)
    return JSONResponse(await state.off_loop(rendered_completions, state, body))


async def render_chat(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, ChatCompletionRequest)
    check_model(state, body.model)
    check_generates(state, body.model)
    return JSONResponse(await state.off_loop(rendered_chat, state, body))


async def render_responses(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, ResponsesRequest)
    check_model(state, body.model)
    check_generates(state, body.model)
    return JSONResponse(await state.off_loop(rendered_responses, state, body))


async def responses(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, ResponsesRequest)
    check_model(state, body.model)
    check_generates(state, body.model)
    return await respond_responses(state, request, body)


async def messages(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, MessagesRequest)
    check_model(state, body.model)
    check_generates(state, body.model)
    return await respond_messages(state, request, body)


async def embeddings(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, EmbeddingRequest)
    check_model(state, body.model)
    return await respond_embeddings(state, request, body)


async def count_tokens(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, CountTokensRequest)
    check_model(state, body.model)
    return JSONResponse(await state.off_loop(counted_tokens, state, body))


def model_card(state: ServerState, name: str, created: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "cpud",
        "max_model_len": state.config.max_model_len,
    }


async def models(request: Request, state: ServerState) -> Response:
    created = int(time.time())
    data = [model_card(state, name, created) for name in state.config.served_model_names]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request, state: ServerState) -> Response:
    """GET /v1/models/{id}: one served model, or OpenAI's 404 for another id."""
    name = request.path_params["model"]
    check_model(state, name)
    return JSONResponse(model_card(state, name, int(time.time())))


async def tokenize(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, TokenizeRequest)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    tokens = await state.off_loop(tokenized, state, body)
    answer = {"tokens": tokens, "count": len(tokens), "max_model_len": state.config.max_model_len}
    if body.return_token_strs:
        answer["token_strs"] = [state.tokenizer.id_to_token(t) for t in tokens]
    return JSONResponse(answer)


def tokenized(state: ServerState, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        check_text_size(state, len(body.prompt), "prompt")
        return state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    chat = ChatCompletionRequest(
        messages=body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    return chat_prompt(state, chat).token_ids


async def detokenize(request: Request, state: ServerState) -> Response:
    body = await decode(request, state, DetokenizeRequest)
    check_model(state, body.model)
    vocab = state.engine.engine.config.model.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    text = await state.off_loop(state.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


async def tokenizer_info(request: Request, state: ServerState) -> Response:
    """The tokenizer's configuration as vLLM's /tokenizer_info gives it (lm-eval's remote
    tokenizer reads the special tokens and the chat template from it)."""
    tokenizer = state.tokenizer
    info = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "model_max_length": state.config.max_model_len,
    }
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return JSONResponse(info)


async def health(request: Request, state: ServerState) -> Response:
    stalled = state.stalled_seconds
    if state.phase is Phase.READY and state.engine_alive:
        if stalled < state.config.stall_seconds:
            return JSONResponse({"status": "ok"})
        status = f"stalled: no step finished for {stalled:.0f} s"
    elif state.phase is Phase.READY:
        status = "engine failed"
    else:
        status = state.phase.value
    return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "5"})


async def get_load(request: Request, state: ServerState) -> Response:
    return JSONResponse(worker_load(state))


async def get_model_info(request: Request, state: ServerState) -> Response:
    return JSONResponse(model_info(state))


async def get_server_info(request: Request, state: ServerState) -> Response:
    return JSONResponse(server_info(state))


async def flush_cache(request: Request, state: ServerState) -> Response:
    return JSONResponse(await flush_prefix_cache(state))


async def version(request: Request, state: ServerState) -> Response:
    return JSONResponse({"version": __version__})


async def metrics(request: Request, state: ServerState) -> Response:
    return Response(generate_latest(state.metrics.exposed), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request, state: ServerState) -> Response:
    return Response(json.dumps(openapi_document()), media_type="application/json")


class ApiKeyGate:
    """Deny by default: every path but the open ones needs the key, as `Authorization: Bearer
    <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's). The decision uses the raw
    request path, so encoded or dotted variants cannot slip by."""

    def __init__(
        self,
        app: ASGIApp,
        key: str,
        open_paths: frozenset[str],
        on_denied: Callable[[Scope, APIError], None],
    ):
        self.app = app
        self.key = key.encode()
        self.open_paths = open_paths
        self.on_denied = on_denied

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("raw_path") or scope["path"].encode()
        if raw.decode("latin-1") in self.open_paths and raw.decode("latin-1") == scope["path"]:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        header = headers.get(b"authorization", b"")
        token = header[7:] if header[:7].lower() == b"bearer " else b""
        # Both compared in full, whichever matches: the time taken tells nothing of the key.
        by_bearer = hmac.compare_digest(token, self.key)
        by_header = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
        if by_bearer | by_header:
            return await self.app(scope, receive, send)
        error = APIError(
            401,
            "a valid API key is required: send Authorization: Bearer <key> or x-api-key: <key>",
            "authentication_error",
            None,
            "invalid_api_key",
        )
        self.on_denied(scope, error)
        await error_response(scope["path"], error)(scope, receive, send)


def create_app(state: ServerState, cors: CorsPolicy | None = None) -> ASGIApp:
    routes = [
        ("/v1/completions", completions, ["POST"]),
        ("/v1/chat/completions", chat_completions, ["POST"]),
        ("/v1/completions/render", render_completions, ["POST"]),
        ("/v1/chat/completions/render", render_chat, ["POST"]),
        ("/v1/responses", responses, ["POST"]),
        ("/v1/responses/render", render_responses, ["POST"]),
        ("/v1/embeddings", embeddings, ["POST"]),
        ("/v1/messages", messages, ["POST"]),
        ("/v1/messages/count_tokens", count_tokens, ["POST"]),
        ("/v1/models", models, ["GET"]),
        ("/v1/models/{model:path}", model, ["GET"]),
        ("/tokenize", tokenize, ["POST"]),
        ("/detokenize", detokenize, ["POST"]),
        ("/tokenizer_info", tokenizer_info, ["GET"]),
        ("/health", health, ["GET"]),
        ("/health_generate", health, ["GET"]),
        ("/get_load", get_load, ["GET"]),
        ("/get_model_info", get_model_info, ["GET"]),
        ("/get_server_info", get_server_info, ["GET"]),
        ("/flush_cache", flush_cache, ["POST"]),
        ("/reset_prefix_cache", flush_cache, ["POST"]),
        ("/version", version, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/openapi.json", openapi, ["GET"]),
    ]
    known = {path for path, _, _ in routes}

    def unrouted(request: Request, error: APIError) -> Response:
        # Unknown paths share one label: a client must not grow the metric series.
        path = request.url.path if request.url.path in known else "unrouted"
        answered(state, request.scope, path, error)
        return error_response(request.url.path, error)

    app: ASGIApp = Starlette(
        routes=[Route(path, guarded(state, path, fn), methods=m) for path, fn, m in routes],
        exception_handlers={
            404: lambda request, exc: unrouted(
                request, APIError(404, f"no route {request.url.path}", "not_found_error")
            ),
            405: lambda request, exc: unrouted(
                request,
                APIError(
                    405,
                    f"{request.method} is not allowed on {request.url.path}",
                    "invalid_request_error",
                ),
            ),
        },
    )
    if state.config.api_key:
        # /get_load tells what /metrics does (vllm-router polls it without a key).
        open_paths = (
            OPEN_PATHS if state.config.metrics_need_key else OPEN_PATHS | {"/metrics", "/get_load"}
        )
        app = ApiKeyGate(
            app,
            state.config.api_key,
            open_paths,
            lambda scope, error: answered(state, scope, "unauthenticated", error),
        )
    app = Tracked(app, state.lifecycle, NEED_ENGINE)
    if cors is not None and cors.enabled:
        # Outside the API key gate: a preflight carries no credentials.
        app = CORSMiddleware(
            app,
            allow_origins=list(cors.origins),
            allow_methods=list(cors.methods),
            allow_headers=list(cors.headers),
            expose_headers=["X-Request-Id"],
        )
    return AccessLog(RequestIdHeader(app))
