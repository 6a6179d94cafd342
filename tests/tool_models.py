"""Pydantic models as clients build tool parameters from them: an Enum and a nested model, so
the JSON schema carries `$defs` and `$ref`s."""

from __future__ import annotations

from enum import Enum

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
