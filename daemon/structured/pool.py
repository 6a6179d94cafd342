"""Where grammars compile: a few threads of lowered CPU priority, so a slow grammar takes CPU
only from what serving leaves idle, and a scope that cancels the compiles a request queued
when the request ends (its client left) before they start."""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
NICENESS = 10  # CFS weight 110 against 1024: about a tenth of a core that serving wants


class CompileScope:
    """The compiles of one request; `close` cancels those not started and tells the threads
    waiting on the others to stop waiting."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def add(self, future: Future) -> None:
        with self._lock:
            self._futures.append(future)
        if self.closed.is_set():
            future.cancel()

    def close(self) -> None:
        self.closed.set()
        with self._lock:
            futures, self._futures = self._futures, []
        for future in futures:
            future.cancel()


_SCOPE: contextvars.ContextVar[CompileScope | None] = contextvars.ContextVar(
    "cpud_compile_scope", default=None
)


@contextlib.contextmanager
def compile_scope() -> Iterator[CompileScope]:
    """Compiles started inside (threads started with the context, as asyncio.to_thread does,
    included) belong to the scope, which closes on the way out, cancelled or not."""
    scope = CompileScope()
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
        scope.close()


def current_scope() -> CompileScope | None:
    return _SCOPE.get()


def lower_priority() -> None:
    """Raise this thread's niceness (Linux schedules threads, so only this one slows)."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(current, NICENESS))
    except (OSError, AttributeError):
        pass  # best effort: the thread bound still holds


class CompilePool:
    """Daemon threads (a compile left running never holds up the process's exit for long)
    taking work in order; work whose future was cancelled before it started is skipped.

    At interpreter exit the pool closes: queued work is cancelled, none starts after, and the
    exit waits up to exit_wait_s for the work running. A daemon thread that retakes the GIL
    while the interpreter finalizes is ended by pthread_exit, whose forced unwind through
    llguidance's Rust frames crashes the process (SIGSEGV after all output was written)."""

    def __init__(self, threads: int, exit_wait_s: float = 10.0):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Condition()
        self._running = 0
        self._closed = False
        self._exit_wait_s = exit_wait_s
        for index in range(threads):
            name = f"cpud-grammar-{index}"
            threading.Thread(target=self._work, name=name, daemon=True).start()
        atexit.register(self._close_at_exit)

    def submit(self, fn: Callable[[], T]) -> Future:
        """Runs fn on a compile thread; the future belongs to the caller's scope, if any."""
        future: Future = Future()
        scope = current_scope()
        if scope is not None:
            scope.add(future)
        self._queue.put((future, fn))
        return future

    def shutdown(self) -> None:
        """Cancels the work not started."""
        while True:
            try:
                future, _ = self._queue.get_nowait()
            except queue.Empty:
                return
            future.cancel()

    def close(self, wait_s: float) -> bool:
        """Cancels the work not started, starts none after, and waits up to wait_s for the
        work running; True when none is left running."""
        with self._state:
            self._closed = True
        self.shutdown()
        with self._state:
            return self._state.wait_for(lambda: self._running == 0, timeout=wait_s)

    def _close_at_exit(self) -> None:
        if not self.close(self._exit_wait_s):
            print(
                f"cpud: a grammar compile was still running {self._exit_wait_s:g} s after "
                "exit began; exiting without it",
                file=sys.stderr,
            )

    def _work(self) -> None:
        lower_priority()
        while True:
            future, fn = self._queue.get()
            with self._state:
                if self._closed:
                    future.cancel()
                    return
                if not future.set_running_or_notify_cancel():
                    continue
                self._running += 1
            try:
                result = fn()
            except BaseException as exc:  # handed to the waiting request, whatever it is
                # Without the traceback, whose frames would keep the failed grammar alive.
                future.set_exception(exc.with_traceback(None))
            else:
                future.set_result(result)
            finally:
                with self._state:
                    self._running -= 1
                    self._state.notify_all()
            del future, fn
