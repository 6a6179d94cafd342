"""Runs the engine loop on its own thread and hands outputs to asyncio callers.

Only the engine thread touches the LLMEngine. Callers submit commands (add, abort) through a
thread-safe queue; each request gets an asyncio queue that receives its RequestOutputs, each
holding what is new since the one before (or the exception that ended it). A failure that
belongs to one request (adding it, planning, its text) ends that request only; a failure of
the step itself (the executor, a rank) ends every in-flight request with that error, never a
hang.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from cpud.engine.admission import Admission
from cpud.engine.llm_engine import LLMEngine, RequestFailedError, describe
from cpud.engine.outputs import EmbeddingRequestOutput, RequestOutput
from cpud.engine.sampling_params import SamplingParams
from cpud.frontend.compute_activity import ComputeActivity
from cpud.settings.errors import CpudError, RequestError

log = logging.getLogger("cpud.engine")


class EngineDeadError(CpudError):
    """The engine loop stopped; requests cannot be served until the daemon restarts."""


class QueueFullError(CpudError):
    """Too many requests are waiting; the client should retry later."""


class StoppingError(CpudError):
    """The server is stopping: a request it did not admit ("draining"), or one the drain
    timeout ended ("drain_timeout")."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Add:
    request_id: str
    admission: Admission
    prompt: str | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run fn on the engine thread, between steps; its result or exception goes to future."""

    fn: Callable[[LLMEngine], object]
    future: Future


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    steps: int
    step_seconds: float


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 1024, rank_pids: Sequence[int] = ()):
        self.engine = engine
        engine.isolate_requests = True
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = 0
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._refusal: StoppingError | None = None  # set once the server stops admitting
        # The sinks of the requests being served, by the event loop's thread only.
        self._open: dict[str, asyncio.Queue] = {}
        self._steps = 0
        self._step_seconds = 0.0
        # Set by the engine thread only: None while idle, else when the last step ended (or
        # work arrived, if no step has ended since).
        self._last_progress: float | None = None
        self._thread = threading.Thread(target=self._run, name="cpud-engine", daemon=True)
        self._thread.start()
        # Read by the caller asking about progress (the event loop): a long step that keeps
        # the engine computing is progress too.
        self._activity = ComputeActivity(self._thread.ident or 0, rank_pids)
        self._busy_at = 0.0

    # ---- caller side (any thread / event loop) -----------------------------------------------

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return self._pending

    def seconds_without_progress(self) -> float:
        """0.0 while there is nothing to do; else seconds since a step last completed (or since
        work arrived, if none has completed since), unless the engine has been computing since
        the last call: a large step on a slow machine is busy, not stalled. Grows while a
        rank's step hangs. Called from one thread (the event loop)."""
        since, now = self._last_progress, time.monotonic()
        if self._activity.busy():  # asked while idle too, so that the next answer is fresh
            self._busy_at = now
        return 0.0 if since is None else max(0.0, now - max(since, self._busy_at))

    def stats(self) -> EngineStats:
        sched = self.engine.scheduler
        blocks = self.engine.blocks
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_usage=blocks.usage(),
            prefix_queries=blocks.prefix_queries,
            prefix_hits=blocks.prefix_hits,
            preemptions=sched.num_preemptions,
            steps=self._steps,
            step_seconds=self._step_seconds,
        )

    async def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> Admission:
        """The engine's one check of a request (RequestError when it does not fit); what it
        returns goes to `generate`. A constrained request compiles its grammar in a worker
        thread, so the event loop never waits on a compile."""
        if params.structured is not None:
            return await asyncio.to_thread(self.engine.validate, prompt_token_ids, params)
        return self.engine.validate(prompt_token_ids, params)

    def validate_embedding(self, prompt_token_ids: list[int], param: str = "input") -> Admission:
        """The engine's check of an embedding input (RequestError when it cannot run in one
        step); what it returns goes to `generate`, which yields one EmbeddingRequestOutput."""
        return self.engine.validate_embedding(prompt_token_ids, param)

    def _refuse(self) -> None:
        """Raise what a request arriving now gets instead of admission (with the lock held)."""
        if self.error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running: {self.error}")
        if self._refusal is not None:
            raise self._refusal
        if self._pending >= self.max_waiting:
            raise QueueFullError(f"{self._pending} requests in flight; retry shortly")

    def check_admission(self) -> None:
        """Raise now what `generate` would raise instead of admitting a request."""
        with self._lock:
            self._refuse()

    def stop_admitting(self, refusal: StoppingError) -> None:
        """From now on `generate` raises `refusal`; requests admitted before go on."""
        with self._lock:
            self._refusal = refusal

    def fail_open(self, error: BaseException) -> None:
        """End every request being served with `error`, wherever it is (queued for the engine
        thread, inside a step that hangs, streaming), whatever the engine thread is doing.
        Call from the event loop that runs the requests."""
        for sink in self._open.values():
            sink.put_nowait(error)

    async def generate(
        self, request_id: str, admission: Admission, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Yields the request's news after every step that advanced it (delta outputs:
        outputs.OutputAccumulator folds them whole); the last one has finished=True (an
        embedding request yields its one output). Leaving the iteration early (client gone)
        aborts the request."""
        sink: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            self._refuse()
            self._pending += 1
            # Under the lock: a failing engine thread fails every command queued before.
            self._commands.put(_Add(request_id, admission, prompt, sink, loop))
        self._open[request_id] = sink
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._open.pop(request_id, None)
            with self._lock:
                self._pending -= 1
            if not finished:
                self._commands.put(_Abort(request_id))
                self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.executor.shutdown()

    # ---- engine thread ---------------------------------------------------------------------

    @staticmethod
    def _post(
        sink: asyncio.Queue, loop: asyncio.AbstractEventLoop, item: RequestOutput | BaseException
    ) -> bool:
        """False when the caller's loop is closed: nobody is listening any more."""
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:
            return False
        return True

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._sinks.get(request_id)
        if entry is not None and not self._post(*entry, item):
            self._sinks.pop(request_id, None)

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """fn(engine) run on the engine thread between steps (nothing else touches the engine
        meanwhile); EngineDeadError once the engine has failed."""
        future: Future = Future()
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine failed: {describe(self.error)}")
            self._commands.put(_Call(fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.admit(command.request_id, command.admission, command.prompt)
        except RequestError as exc:
            self._post(command.sink, command.loop, exc)
            return
        except Exception as exc:
            log.error("request %s could not be added: %s", command.request_id, describe(exc))
            log.debug("request %s failure", command.request_id, exc_info=exc)
            error = RequestFailedError(
                f"the request could not be added to the engine ({type(exc).__name__}); "
                "the server logged it"
            )
            self._post(command.sink, command.loop, error)
            return
        self._sinks[command.request_id] = (command.sink, command.loop)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                self.engine.abort(command.request_id)
                self._sinks.pop(command.request_id, None)
            elif isinstance(command, _Call):
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as exc:
                    command.future.set_exception(exc)
            else:
                self._add(command)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._last_progress = None
                    self.engine.executor.check_health()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                if self._last_progress is None:
                    self._last_progress = time.monotonic()
                started = time.perf_counter()
                outputs = self.engine.step()
                self._steps += 1
                self._step_seconds += time.perf_counter() - started
                self._last_progress = time.monotonic()
                for output in outputs:
                    self._deliver(output.request_id, output)
                    if output.finished:
                        self._sinks.pop(output.request_id, None)
                for request_id, error in self.engine.take_failures():
                    self._deliver(request_id, error)
                    self._sinks.pop(request_id, None)
        except BaseException as exc:
            if isinstance(exc, CpudError):
                log.error("engine loop stopped: %s", exc)
            else:
                log.exception("engine loop failed")
            with self._lock:
                self.error = exc
            dead = EngineDeadError(f"the engine failed: {describe(exc)}")
            for request_id in list(self._sinks):
                self._deliver(request_id, dead)
            self._sinks.clear()
            self._fail_queued(dead)
        finally:
            self._last_progress = None

    def _fail_queued(self, error: EngineDeadError) -> None:
        """Requests that arrived while the failed step ran: never added, they fail too."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._post(command.sink, command.loop, error)
            elif isinstance(command, _Call):
                command.future.set_exception(error)
