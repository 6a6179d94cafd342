"""The frontend's two ways to stop while requests are open: a drain (SIGTERM) and an engine that
failed (a rank lost or hung). Either way every request gets an answer before the HTTP server
closes: a 503 in OpenAI's shape, or a stream's error event then [DONE]; never a cut connection."""

from __future__ import annotations

import logging
import time

from cpud.engine.llm_engine import describe
from cpud.frontend.async_engine import AsyncEngine, EngineDeadError, StoppingError
from cpud.frontend.openai_api import engine_error
from cpud.frontend.state import Phase, ServerState

log = logging.getLogger("cpud.frontend")
# How long the requests ended by a failure or the drain timeout get to send their error answer.
ANSWER_GRACE_S = 3.0


def end_open_requests(state: ServerState, engine: AsyncEngine | None, error: Exception) -> None:
    """Every open request ends with `error`: waiting to be admitted, queued for the engine
    thread, inside a step or streaming."""
    state.lifecycle.cut(engine_error(error))
    if engine is not None:
        engine.fail_open(error)


async def drain(state: ServerState, engine: AsyncEngine | None, timeout: float) -> None:
    """Admit nothing more (requests still being tokenized get 503 "draining" now), let the
    admitted ones finish up to `timeout`, then end the rest with a "drain_timeout" error."""
    state.phase = Phase.DRAINING
    refusal = StoppingError("the server is draining: it admits no new requests", "draining")
    if engine is not None:
        engine.stop_admitting(refusal)
    state.lifecycle.refuse(engine_error(refusal))
    started, admitted = time.monotonic(), state.in_flight
    log.info("draining: %d request(s) in flight, up to %g s", admitted, timeout)
    cut = unfinished = 0
    if not await state.lifecycle.settle(timeout):
        cut, unfinished = state.lifecycle.open, state.in_flight
        message = f"the drain timeout ({timeout:g} s) ended this request before it finished"
        end_open_requests(state, engine, StoppingError(message, "drain_timeout"))
        await state.lifecycle.settle(ANSWER_GRACE_S)
    log.log(
        logging.WARNING if cut else logging.INFO,
        "drained in %.1f s: %d request(s) finished, %d cut at the drain timeout, "
        "%d refused (not admitted)",
        time.monotonic() - started,
        admitted - unfinished,
        cut,
        state.lifecycle.refused,
    )


async def fail(state: ServerState, engine: AsyncEngine) -> None:
    """The engine stopped: every open request gets engine_dead, then the server may close."""
    cause = describe(engine.error) if engine.error is not None else "its thread ended"
    log.error("engine stopped (%s): exiting for a restart", cause)
    end_open_requests(state, engine, EngineDeadError(f"the engine failed: {cause}"))
    if not await state.lifecycle.settle(ANSWER_GRACE_S):
        open_now = state.lifecycle.open
        log.warning("%d request(s) still answering after %g s", open_now, ANSWER_GRACE_S)
