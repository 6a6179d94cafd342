"""What a client saw of one request to `cpud serve`, for the tests of hangs and drains: the
status, the JSON body or the server-sent events, and whether the body arrived whole."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    status: int = 0
    body: dict | None = None  # the JSON body of a non-streamed answer
    events: list = field(default_factory=list)  # a stream's events, "[DONE]" as the string
    complete: bool = False  # the body arrived whole (no cut chunked encoding, no reset)
    retry_after: str | None = None
    failure: str | None = None  # what went wrong on the client side

    @property
    def error(self) -> dict | None:
        """The OpenAI error object of the answer: the body's, or a stream's error event's."""
        if self.body is not None and "error" in self.body:
            return self.body["error"]
        found = [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]
        return found[0] if found else None

    def describe(self) -> str:
        return (
            f"status={self.status} complete={self.complete} failure={self.failure} "
            f"body={self.body} events={self.events[-3:]}"
        )


def request(base_url: str, path: str, body: dict, timeout: float = 60) -> Outcome:
    outcome = Outcome()
    try:
        with httpx.stream("POST", base_url + path, json=body, timeout=timeout) as response:
            outcome.status = response.status_code
            outcome.retry_after = response.headers.get("retry-after")
            if body.get("stream") and response.status_code == 200:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        outcome.events.append(data if data == "[DONE]" else json.loads(data))
            else:
                text = response.read().decode()
                outcome.body = json.loads(text) if text else None
            outcome.complete = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome.failure = f"{type(exc).__name__}: {exc}"
    return outcome


class Requests:
    """Requests sent at once from threads; `wait` returns their outcomes in order."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.outcomes: list[Outcome] = []
        self.threads: list[threading.Thread] = []

    def send(self, path: str, body: dict, timeout: float = 60) -> Outcome:
        outcome = Outcome()
        self.outcomes.append(outcome)

        def run() -> None:
            outcome.__dict__.update(request(self.base_url, path, body, timeout).__dict__)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        return outcome

    def wait(self, timeout: float = 60) -> list[Outcome]:
        for thread in self.threads:
            thread.join(timeout)
        return self.outcomes
