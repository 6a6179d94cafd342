"""The systemd notification protocol (sd_notify(3)) without libsystemd: one datagram per
message to $NOTIFY_SOCKET. Outside systemd (no NOTIFY_SOCKET) every call does nothing."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("cpud.process.sd_notify")


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        self.address = address or None
        self.watchdog_seconds = _watchdog_seconds(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> None:
        """Send fields such as "READY=1" or "STATUS=loading" in one message."""
        if self.address is None:
            return
        payload = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(payload, self.address)
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self.address, exc)

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")


def _watchdog_seconds(env: Mapping[str, str]) -> float | None:
    """WatchdogSec as systemd passes it, when it is meant for this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6
