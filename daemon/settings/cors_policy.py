"""Cross-origin access for browser UIs, vLLM's --allowed-origins / --allowed-methods /
--allowed-headers: off unless the operator lists origins. Off, no preflight is answered, so a
web page can send only the requests a form could, and the JSON routes refuse those (415)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cpud.settings import CORS_ALLOW_ANY
from cpud.settings.errors import ConfigError

_ORIGIN = re.compile(r"^[a-z][a-z0-9+.\-]*://[^/\s?#]+$", re.IGNORECASE)
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z\-]+$")  # an HTTP token (RFC 9110)


def word_list(values: Iterable[str] | None) -> tuple[str, ...]:
    """Flag values as separate words, comma-separated, or one JSON list (vLLM's spelling)."""
    words: list[str] = []
    for value in values or ():
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            if isinstance(parsed, list) and all(isinstance(v, str) for v in parsed):
                words += [v.strip() for v in parsed if v.strip()]
                continue
        for part in text.split(","):
            part = part.strip().strip("[]\"' ")
            if part:
                words.append(part)
    return tuple(words)


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = ()  # empty: cross-origin requests get no CORS headers
    methods: tuple[str, ...] = CORS_ALLOW_ANY
    headers: tuple[str, ...] = CORS_ALLOW_ANY

    def __post_init__(self) -> None:
        for origin in self.origins:
            if origin != "*" and not _ORIGIN.match(origin):
                raise ConfigError(
                    f"--allowed-origins: {origin!r} is not an origin: give scheme://host[:port] "
                    "with no path or trailing slash (e.g. http://localhost:3000), or *"
                )
        for flag, words in (
            ("--allowed-methods", self.methods),
            ("--allowed-headers", self.headers),
        ):
            bad = next((w for w in words if w != "*" and not _TOKEN.match(w)), None)
            if bad is not None:
                raise ConfigError(f"{flag}: {bad!r} is not an HTTP method or header name")

    @property
    def enabled(self) -> bool:
        return bool(self.origins)
