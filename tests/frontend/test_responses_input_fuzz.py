"""/v1/responses input items of every shape: a malformed item is a 400 naming the field that
is wrong, never a 500."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output", "id", "status"]
WORDS = [
    "message",
    "function_call",
    "function_call_output",
    "input_text",
    "output_text",
    "user",
    "system",
    "developer",
    "assistant",
    "tool",
    "call_1",
    "{}",
    '{"a": 1}',
    "",
]
SCALARS = st.one_of(
    st.sampled_from(WORDS), st.text(max_size=8), st.integers(), st.booleans(), st.none()
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["type", "text", "annotations", "x"]), inner, max_size=3),
    ),
    max_leaves=6,
)
ITEMS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=5)


def post(server, body: dict) -> httpx.Response:
    body = {"model": "tiny", "max_output_tokens": 1, "temperature": 0, **body}
    return httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)


def test_a_role_that_is_not_a_string_is_a_400_naming_it(server):
    reply = post(server, {"input": [{"role": ["x"], "content": "hi"}]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "input[0].role"


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(items=st.lists(ITEMS, min_size=1, max_size=3))
def test_no_input_item_shape_is_a_server_error(server, items):
    reply = post(server, {"input": items})
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        error = reply.json()["error"]
        assert error["param"], error
