"""--kv-events-config: vLLM's KVEventsConfig JSON, checked once into a frozen config (the
publisher is cpud.engine.kv_events)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from cpud.settings.errors import ConfigError


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: the same keys and defaults (the endpoint defaults to loopback,
    where vLLM's listens on every interface)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: zmq when events are enabled
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig:
        """--kv-events-config's JSON object; ConfigError naming what to change."""
        if text is None or not text.strip():
            return cls()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(
                f"--kv-events-config: unknown key(s) {', '.join(unknown)}; known: "
                f"{', '.join(known)}"
            )
        for name, value in data.items():
            _check_value(name, value)
        config = cls(**data)
        if config.publisher not in (None, "zmq", "null"):
            raise ConfigError(
                f'--kv-events-config: publisher must be "zmq" or "null", not {config.publisher!r}'
            )
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(config, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(
                    f"--kv-events-config: {name} must be tcp://HOST:PORT or ipc://PATH, "
                    f"not {endpoint!r}"
                )
        return config

    def for_replica(self, replica: int) -> KVEventsConfig:
        """Replica i's endpoints: tcp ports moved up by i, ipc paths suffixed (as vLLM moves
        each data-parallel rank's)."""
        if replica == 0:
            return self
        return KVEventsConfig(
            **{
                **{f.name: getattr(self, f.name) for f in fields(self)},
                "endpoint": offset_endpoint(self.endpoint, replica),
                "replay_endpoint": offset_endpoint(self.replay_endpoint, replica),
            }
        )


_TYPES = {
    "enable_kv_cache_events": bool,
    "publisher": (str, type(None)),
    "endpoint": str,
    "replay_endpoint": (str, type(None)),
    "buffer_steps": int,
    "hwm": int,
    "max_queue_size": int,
    "topic": str,
}


def _check_value(name: str, value: object) -> None:
    kind = _TYPES[name]
    wrong_bool = isinstance(value, bool) and kind is int
    if wrong_bool or not isinstance(value, kind):
        raise ConfigError(f"--kv-events-config: {name} has the wrong type ({value!r})")
    if kind is int and value < 1:
        raise ConfigError(f"--kv-events-config: {name} must be at least 1, got {value}")


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    if endpoint is None or offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"


# Every field is sent, null or not, as vLLM sends them (routers read them by name).
