"""/v1/embeddings in OpenAI's shape: every input is one engine request, all started together
(they share the continuous batch with whatever else runs); vectors come back as floats or as
base64 of float32 little-endian (what the openai SDK asks for and decodes)."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cpud.engine.admission import Admission
from cpud.engine.embedding import embeds_normalized, shortened, truncated, vector_bytes
from cpud.engine.outputs import EmbeddingRequestOutput
from cpud.frontend.access_log import access_note
from cpud.frontend.errors import bad_request
from cpud.frontend.openai_api import ENGINE_ERRORS, collect_or_abort, engine_error
from cpud.frontend.requests import check_text_size
from cpud.frontend.schemas import EmbeddingRequest
from cpud.frontend.state import ServerState
from cpud.settings.errors import RequestError

INPUT_KINDS = "a string, a list of strings, a list of token ids or a list of token id lists"


@dataclass(frozen=True)
class EmbeddingInput:
    token_ids: list[int]
    text: str | None
    admission: Admission  # what the engine's check found


def check_dimensions(state: ServerState, dimensions: int | None) -> None:
    """400 unless dimensions is absent or from 1 to the model's vector size."""
    if dimensions is None:
        return
    size = state.engine.engine.config.model.hidden_size
    if not 1 <= dimensions <= size:
        raise bad_request(
            f"dimensions must be from 1 to {size} (this model's embedding size), got {dimensions}",
            param="dimensions",
        )


def input_limit(state: ServerState) -> int:
    """Inputs one request may carry: OpenAI's limit, within the engine's queue."""
    return min(state.config.max_embedding_inputs, state.engine.max_waiting)


def embedding_inputs(state: ServerState, body: EmbeddingRequest) -> list[EmbeddingInput]:
    """The body's inputs tokenized (as the body says: special tokens, truncation) and each
    checked by the engine before any runs; a 400 names the first that fails. Runs on a
    worker thread."""
    raw = body.input
    single = isinstance(raw, str) or (
        bool(raw) and all(isinstance(p, int) and not isinstance(p, bool) for p in raw)
    )
    if single:
        items: list = [raw]
    elif not raw:
        raise bad_request("input must not be empty", param="input")
    elif all(isinstance(p, str) for p in raw) or all(isinstance(p, list) for p in raw):
        items = list(raw)
    else:
        raise bad_request(f"input must be {INPUT_KINDS}, not a mixture", param="input")
    limit = input_limit(state)
    if len(items) > limit:
        raise bad_request(
            f"at most {limit} inputs per request, got {len(items)}: send them in several",
            param="input",
        )
    max_len = state.config.max_model_len
    inputs = []
    for index, item in enumerate(items):
        where = "input" if single else f"input[{index}]"
        if not item:
            raise bad_request(f"{where} is empty: every input needs some text or tokens", "input")
        if isinstance(item, str):
            if body.truncate_prompt_tokens is None:  # else cut to fit, as long as it may be
                check_text_size(state, len(item), "input")
            tokens = state.tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
        else:
            tokens = list(item)
        try:
            tokens = truncated(tokens, body.truncate_prompt_tokens, max_len)
            admission = state.engine.validate_embedding(tokens, "input")
        except RequestError as exc:
            prefix = "" if single else f"{where}: "
            raise bad_request(f"{prefix}{exc}", param=exc.param, code=exc.code) from None
        text = item if isinstance(item, str) else None
        inputs.append(EmbeddingInput(tokens, text, admission))
    return inputs


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(vector)).decode("ascii")
    return vector


async def respond_embeddings(
    state: ServerState, request: Request, body: EmbeddingRequest
) -> Response:
    arrival = time.monotonic()
    check_dimensions(state, body.dimensions)
    inputs = await state.off_loop(embedding_inputs, state, body)
    request_id = f"embd-{uuid.uuid4().hex}"
    model_name = body.model or state.model_name
    prompt_tokens = sum(len(item.token_ids) for item in inputs)
    note = access_note(request)
    note.request_id, note.model, note.prompt_tokens = request_id, model_name, prompt_tokens
    try:
        state.engine.check_admission()
    except ENGINE_ERRORS as exc:
        raise engine_error(exc) from None
    streams = [
        state.engine.generate(f"{request_id}-{i}", item.admission, item.text)
        for i, item in enumerate(inputs)
    ]
    finals: list[EmbeddingRequestOutput] = await collect_or_abort(request, streams)
    metrics = state.metrics
    metrics.embedding_inputs.inc(len(inputs))
    metrics.prompt_tokens.inc(prompt_tokens)
    normalize = embeds_normalized(state.engine.engine.config.model)
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": encoded(
                shortened(final.outputs.embedding, body.dimensions, normalize),
                body.encoding_format,
            ),
        }
        for index, final in enumerate(finals)
    ]
    metrics.embedding_latency.observe(time.monotonic() - arrival)
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": model_name,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
