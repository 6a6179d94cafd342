"""Tool calling as clients send it, unmodified, against cpud serving the default model:
Pydantic-made tools (an Enum and a nested model: `$defs` / `$ref`) called by force through the
openai SDK, compact arguments, a forced call cut by max_tokens still a call, LangChain's
function-calling structured output, response_format beside forced and auto tools, and an
Agents SDK agent with an output_type and a Pydantic-Enum tool on both of its model APIs."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from tool_models import WEATHER, Forecast, Place, Unit, run_agent


class City(BaseModel):
    name: str
    country: str


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": City.model_json_schema(), "strict": True},
}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_pydantic_tool_with_defs_is_called_by_force(smol_client, choice):
    tool = openai.pydantic_function_tool(Forecast)
    assert "$defs" in tool["function"]["parameters"]
    forced = {"type": "function", "function": {"name": "Forecast"}}
    completion = smol_client.chat.completions.parse(
        model="tiny",
        messages=ASK,
        tools=[tool],
        tool_choice="required" if choice == "required" else forced,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    assert completion.choices[0].finish_reason == "tool_calls"
    [call] = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)


def streamed_call(smol, body: dict) -> tuple[list[str], list[str], str | None, str]:
    """(argument fragments, names, content, last finish_reason) of a streamed chat."""
    fragments, names, content, reason = [], [], None, None
    body = {"model": "tiny", "messages": ASK, "temperature": 0, "stream": True, **body}
    url = smol.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            reason = choice["finish_reason"] or reason
            if choice["delta"].get("content"):
                content = (content or "") + choice["delta"]["content"]
            for call in choice["delta"].get("tool_calls", ()):
                names += [call["function"]["name"]] if "name" in call["function"] else []
                fragments.append(call["function"].get("arguments", ""))
    return fragments, names, content, reason


def test_forced_arguments_stream_compact_from_the_first_tokens(smol):
    body = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 60}
    body["parallel_tool_calls"] = False
    fragments, names, content, reason = streamed_call(smol, body)
    assert names == ["get_weather"] and content is None and reason == "tool_calls"
    arguments = "".join(fragments)
    assert arguments == json.dumps(json.loads(arguments))  # no whitespace of the model's own


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(smol, stream):
    """As vLLM answers it: the call with its arguments as far as they came, finish_reason
    length, and no call markup in the content."""
    body = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 20}
    if stream:
        fragments, names, content, reason = streamed_call(smol, body)
        name, arguments = names[0], "".join(fragments)
    else:
        answer = httpx.post(
            smol.base_url + "/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "temperature": 0, **body},
            timeout=120,
        )
        choice = answer.json()["choices"][0]
        content, reason = choice["message"]["content"], choice["finish_reason"]
        [call] = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    assert reason == "length" and content is None
    assert name == "get_weather" and arguments.startswith('{"city"')
    with pytest.raises(ValueError):
        json.loads(arguments)  # cut: not yet a whole object


def test_a_forced_call_cut_by_max_output_tokens_is_a_function_call_item(smol_client):
    parameters = WEATHER["function"]["parameters"]
    response = smol_client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[{"type": "function", "name": "get_weather", "parameters": parameters}],
        tool_choice="required",
        max_output_tokens=20,
        temperature=0,
    )
    assert response.status == "incomplete"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments.startswith('{"city"')


def test_langchain_function_calling_structured_output(smol):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=smol.base_url + "/v1",
        api_key="unused",
        model="tiny",
        temperature=0,
        max_tokens=30,  # the arguments end by token 30 (with the whitespace left free: 34)
        max_retries=0,
    )
    structured = llm.with_structured_output(City, method="function_calling", include_raw=True)
    result = structured.invoke("Describe Paris.")
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], City) and result["parsed"].name


def chat(smol, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 60, "temperature": 0, **body}
    return httpx.post(smol.base_url + "/v1/chat/completions", json=body, timeout=120)


def test_response_format_beside_a_forced_call_lets_the_call_through(smol):
    answer = chat(
        smol,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        response_format=CITY_FORMAT,
    )
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


def test_auto_tools_beside_response_format_call_or_answer_in_the_format(smol):
    """With tool_choice auto either may come: a call first, the answer in the format after
    the tool's result."""
    first = chat(smol, tools=[WEATHER], parallel_tool_calls=False, response_format=CITY_FORMAT)
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    result = "Sunny, 24 C. Now answer the user in JSON."
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]
    answer = chat(smol, messages=messages, tools=[WEATHER], response_format=CITY_FORMAT)
    message = answer.json()["choices"][0]["message"]
    assert message.get("tool_calls") is None
    jsonschema.validate(json.loads(message["content"]), City.model_json_schema())


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_output_type_with_a_pydantic_enum_tool(smol, api):
    from agents import function_tool

    calls = []

    @function_tool
    def get_forecast(place: Place, unit: Unit) -> str:
        """The weather forecast of a place."""
        calls.append((place, unit))
        return f"Sunny, 24 degrees {unit.value}. Now answer the user in JSON."

    settings = dict(
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120
    )
    final = run_agent(smol.base_url, api, settings, tools=[get_forecast], output_type=City)
    assert calls and all(isinstance(u, Unit) and isinstance(p, Place) for p, u in calls)
    assert isinstance(final, City) and final.name
