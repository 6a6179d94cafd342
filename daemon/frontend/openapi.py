"""/openapi.json, generated from the msgspec request types."""

from __future__ import annotations

from functools import lru_cache

import msgspec

from cpud import __version__
from cpud.frontend.anthropic_schemas import CountTokensRequest, MessagesRequest
from cpud.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeRequest,
)

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"],
        },
    },
    "required": ["type", "error"],
}


def _post(schema_name: str, summary: str, error: str = "Error") -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema_name}"}}
                },
            },
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                "400": {
                    "description": "Bad request",
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}
                    },
                },
                "404": {
                    "description": "Unknown model",
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}
                    },
                },
                "413": {
                    "description": "Body too large",
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}
                    },
                },
                "429": {
                    "description": "Queue full",
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}
                    },
                },
                "503": {
                    "description": "Loading or draining",
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}
                    },
                },
            },
        }
    }


def _get(summary: str) -> dict:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": "OK"}, "503": {"description": "Not ready"}},
        }
    }


def _model_get() -> dict:
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {
        "get": {
            "summary": "One served model",
            "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {
                "200": {"description": "OK"},
                "404": {"description": "Not a served model", "content": error},
            },
        }
    }


@lru_cache(maxsize=1)
def openapi_document() -> dict:
    types = (
        CompletionRequest,
        ChatCompletionRequest,
        ResponsesRequest,
        TokenizeRequest,
        DetokenizeRequest,
        EmbeddingRequest,
        MessagesRequest,
        CountTokensRequest,
    )
    (_, components) = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    components["Error"] = ERROR_SCHEMA
    components["AnthropicError"] = ANTHROPIC_ERROR_SCHEMA
    return {
        "openapi": "3.1.0",
        "info": {"title": "cpud", "version": __version__},
        "paths": {
            "/v1/completions": _post("CompletionRequest", "Text completion"),
            "/v1/chat/completions": _post("ChatCompletionRequest", "Chat completion"),
            "/v1/completions/render": _post(
                "CompletionRequest", "vLLM: each prompt's token ids and sampling parameters"
            ),
            "/v1/chat/completions/render": _post(
                "ChatCompletionRequest", "vLLM: the prompt's token ids and sampling parameters"
            ),
            "/v1/responses": _post("ResponsesRequest", "Response (stateless)"),
            "/v1/responses/render": _post(
                "ResponsesRequest", "vLLM: the prompt's token ids and sampling parameters"
            ),
            "/v1/embeddings": _post("EmbeddingRequest", "Embeddings of strings or token ids"),
            "/v1/messages": _post("MessagesRequest", "Anthropic Messages", "AnthropicError"),
            "/v1/messages/count_tokens": _post(
                "CountTokensRequest", "Anthropic Messages: the prompt's tokens", "AnthropicError"
            ),
            "/tokenize": _post("TokenizeRequest", "Prompt or messages to token ids"),
            "/detokenize": _post("DetokenizeRequest", "Token ids to text"),
            "/tokenizer_info": _get("Tokenizer configuration: special tokens, chat template"),
            "/v1/models": _get("Served models"),
            "/v1/models/{model}": _model_get(),
            "/health": _get("200 when serving, 503 while loading or draining"),
            "/health_generate": _get("vllm-router: the engine's health, as /health"),
            "/get_load": _get("vllm-router: requests in flight, as {load: n}"),
            "/get_model_info": _get("vllm-router: the served model"),
            "/get_server_info": _get("vllm-router: the engine's settings and state"),
            "/version": _get("cpud version"),
            "/metrics": _get("Prometheus metrics"),
        },
        "components": {"schemas": components},
    }
