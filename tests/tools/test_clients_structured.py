"""The clients agent code uses, unmodified, against cpud serving the default model: the openai
SDK's parse() and tool round trips (sync and streamed), LangChain's with_structured_output and
bind_tools, and an OpenAI Agents SDK agent calling its function tool."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel
from tool_models import run_agent


class City(BaseModel):
    name: str
    country: str
    is_capital: bool


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


def test_openai_parse_with_a_pydantic_model(smol_client):
    completion = smol_client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def round_trip_messages(call_id: str, name: str, arguments: str) -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 24 C"},
    ]


def test_openai_tools_round_trip(smol_client):
    first = smol_client.chat.completions.create(
        model="tiny",
        messages=[QUESTION],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    final = smol_client.chat.completions.create(
        model="tiny",
        messages=round_trip_messages(call.id, call.function.name, call.function.arguments),
        tools=TOOLS,
        max_tokens=30,
        temperature=0,
    )
    assert final.choices[0].message.content


def test_openai_tools_round_trip_streamed(smol_client):
    stream = smol_client.chat.completions.create(
        model="tiny",
        messages=[QUESTION],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    call_id = name = None
    arguments, reasons = "", []
    for chunk in stream:
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or ():
            call_id = call_id or delta.id
            name = name or delta.function.name
            arguments += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and name == "get_weather"
    assert isinstance(json.loads(arguments)["city"], str)
    final = smol_client.chat.completions.create(
        model="tiny",
        messages=round_trip_messages(call_id, name, arguments),
        tools=TOOLS,
        max_tokens=30,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in final if c.choices)
    assert text


def test_langchain_structured_output_and_bound_tools(smol):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return "sunny"

    llm = ChatOpenAI(
        base_url=smol.base_url + "/v1",
        api_key="unused",
        model="tiny",
        temperature=0,
        max_tokens=80,
        max_retries=0,
    )
    city = llm.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City) and city.name
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?"
    )
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_runs_an_agent_with_a_function_tool(smol, api):
    from agents import function_tool

    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    settings = dict(tool_choice="required", temperature=0, max_tokens=200)
    final = run_agent(
        smol.base_url,
        api,
        settings,
        instructions="Answer with the weather tool.",
        tools=[get_weather],
    )
    assert cities and all(isinstance(c, str) and c for c in cities)
    assert isinstance(final, str) and final
