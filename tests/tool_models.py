"""Pydantic models as clients build tool parameters from them: an Enum and a nested model, so
the JSON schema carries `$defs` and `$ref`s; the weather tool and the Agents SDK run the client
tests share."""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Any

from pydantic import BaseModel


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(BaseModel):
    city: str
    country: str


class Forecast(BaseModel):
    """The weather forecast of a place."""

    place: Place
    unit: Unit


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def run_agent(base_url: str, api: str, settings: dict[str, Any], **agent: Any) -> Any:
    """The final output of an Agents SDK agent (its chat or responses model on the server at
    base_url) asked for the weather in Paris."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    model_kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel

    async def run() -> Any:
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        model = model_kind(model="tiny", openai_client=client)
        weather = Agent(
            name="weather", model=model, model_settings=ModelSettings(**settings), **agent
        )
        result = await Runner.run(weather, "What is the weather in Paris?", max_turns=4)
        await client.close()
        return result.final_output

    return asyncio.run(run())
