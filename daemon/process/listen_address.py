"""Whether the HTTP address can be bound, checked before anything loads (the frontend binds it
for real a moment later)."""

from __future__ import annotations

import socket

from cpud.settings.errors import ConfigError


def check_listen_address(host: str, port: int) -> None:
    """Fail before anything loads when the HTTP address cannot be bound (the frontend binds it
    for real a moment later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}: fix --host") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror}: choose another --port "
                "(CPUD_PORT) or stop the process that holds it"
            ) from None
