"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

import msgspec
from starlette.responses import JSONResponse

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_validation(exc: msgspec.ValidationError) -> APIError:
    """msgspec says e.g. "Expected `float` <= 2.0 - at `$.temperature`": name the field."""
    text = str(exc)
    match = _PATH.search(text)
    if match:
        param = match.group(1).split("[")[0].split(".")[0] or None
    else:
        missing = _MISSING.search(text)
        param = missing.group(1) if missing else None
    return bad_request(text, param=param)
