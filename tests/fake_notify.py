"""A stand-in for systemd's notification socket: collects every datagram with its arrival time."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


class FakeNotifySocket:
    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def fields(self) -> list[tuple[float, str]]:
        """Every KEY=VALUE line received, in order, with its arrival time."""
        return [(t, line) for t, text in list(self.messages) for line in text.splitlines()]

    def times(self, line: str) -> list[float]:
        return [t for t, got in self.fields() if got == line]

    def wait_for(self, line: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if hits := self.times(line):
                return hits[0]
            time.sleep(0.05)
        raise AssertionError(f"{line!r} never arrived; got {[f for _, f in self.fields()]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
