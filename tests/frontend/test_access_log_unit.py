"""The access line and the level of plan warnings, without a daemon."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from cpud.frontend.access_log import AccessLog, AccessNote, access_line
from cpud.frontend.app import guarded
from cpud.frontend.server import api_key_line
from cpud.frontend.state import Phase, ServerConfig, ServerState
from cpud.process.log_setup import WarningLines
from cpud.text.tokenizer import Tokenizer


class Broken:
    async def __call__(self, request, state):
        raise KeyError("something nobody planned for")


def test_an_internal_error_is_one_error_line_the_access_line(model_factory, caplog):
    state = ServerState(ServerConfig(("tiny",), 256), Tokenizer(model_factory("qwen3")))
    state.phase = Phase.READY
    try:
        app = AccessLog(Starlette(routes=[Route("/boom", guarded(state, "/boom", Broken()))]))
        with caplog.at_level(logging.INFO, logger="cpud"):
            response = TestClient(app).get("/boom?q=1")
        assert response.status_code == 500
        records = [r for r in caplog.records if r.name.startswith("cpud")]
        assert [r.name for r in records] == ["cpud.access"]
        [record] = records
        message = record.getMessage()
        assert record.levelno == logging.ERROR and "\n" not in message
        assert '"GET /boom" 500 ' in message
        assert "error=internal_error: KeyError: 'something nobody planned for'" in message
    finally:
        state.close()


def test_the_access_line_escapes_what_could_forge_a_line():
    scope = {"method": "GET", "raw_path": b'/a"b\n c', "client": ("::1", 5)}
    line = access_line(scope, 404, 0.0126, AccessNote(model="my model", error="x\ny"))
    assert line == '[::1]:5 "GET /a\\x22b\\x0a\\x20c" 404 0.013s model=my_model error=x y'


def record(message: str, *args: object, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("cpud.placement", level, __file__, 1, message, args, None)


def test_plan_warning_lines_are_logged_at_warning_without_the_prefix():
    lines = WarningLines()
    warned = record("binding: %s", "warning: ranks 0,1 share NUMA node 0")
    assert lines.filter(warned)
    assert warned.levelno == logging.WARNING and warned.levelname == "WARNING"
    assert warned.getMessage() == "binding: ranks 0,1 share NUMA node 0"
    plain = record("binding: %s", "note: no core reserved")
    lines.filter(plain)
    assert plain.levelno == logging.INFO and plain.getMessage() == "binding: note: no core reserved"
    bare = record("warning: %d ranks", 2)
    lines.filter(bare)
    assert bare.levelno == logging.WARNING and bare.getMessage() == "2 ranks"
    error = record("memory: warning: x", level=logging.ERROR)
    lines.filter(error)
    assert error.levelno == logging.ERROR and error.getMessage() == "memory: warning: x"


def test_the_api_key_line_never_holds_the_key():
    assert api_key_line(None, False).startswith("API key off")
    on = api_key_line("s3cret", True)
    assert on.startswith("API key on") and "s3cret" not in on and "/metrics" not in on
    assert "/metrics" in api_key_line("s3cret", False)
