"""An answer given before the request body was read (a 413 for a body over the limit) leaves
no connection behind: the client's write ends, the connection closes after the answer, and the
server stops without waiting on it. The app waits before answering, so the whole body is
already queued for it (hypercorn's app queue full) when it answers: the case that hung."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from cpud.frontend.http_versions import ServerHttpConfig, serve
from cpud_server_helpers import free_port

BODY = b"a" * (16 << 20)  # more than the loopback socket buffers hold


async def answers_without_reading(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        return await send({"type": "lifespan.shutdown.complete"})
    await asyncio.sleep(0.5)
    headers = [(b"content-length", b"0"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


class Served:
    def __init__(self, port: int):
        self.config = ServerHttpConfig()
        self.config.bind = [f"127.0.0.1:{port}"]
        self.config.graceful_timeout = 5.0
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.run(),))
        self.stopped_in: float | None = None

    async def run(self) -> None:
        self.stop = asyncio.Event()
        await serve(answers_without_reading, self.config, self.stop.wait)

    def close(self) -> float:
        began = time.monotonic()
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        return time.monotonic() - began


def connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:  # the server's thread binds the port
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "the server never listened"
            time.sleep(0.02)


def send_all(sock: socket.socket, data: bytes, outcome: list[str]) -> None:
    try:
        sock.sendall(data)
        outcome.append("sent")
    except OSError as exc:  # reset by the close after the answer: the write ended too
        outcome.append(type(exc).__name__)


def test_an_answer_before_the_body_is_read_frees_the_connection():
    port = free_port()
    served = Served(port)
    served.thread.start()
    try:
        sock = connect(port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(BODY)
        outcome: list[str] = []
        writer = threading.Thread(target=send_all, args=(sock, head + BODY, outcome))
        writer.start()
        received = b""
        sock.settimeout(10)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError):  # closed, or no answer: asserted below
            pass
        writer.join(10)
        assert received.startswith(b"HTTP/1.1 413"), received[:200]
        assert outcome, "the client's write of the body never ended"
        sock.close()
    finally:
        stopped_in = served.close()
    assert not served.thread.is_alive()
    assert stopped_in < served.config.graceful_timeout, stopped_in
