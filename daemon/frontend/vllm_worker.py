"""What vllm-router reads from its workers beside the OpenAI API, in the shapes it parses:
`GET /get_load` (its power_of_two policy polls `{"load": n}`), `GET /get_model_info` and
`GET /get_server_info` (proxied to a worker as they are), `GET /health_generate` (proxied; the
engine's health, as /health), `POST /flush_cache` (sent to every worker; vLLM's
`/reset_prefix_cache` too): the prefix cache emptied."""

from __future__ import annotations

from cpud import __version__
from cpud.engine.llm_engine import LLMEngine
from cpud.frontend.errors import APIError
from cpud.frontend.state import ServerState


def worker_load(state: ServerState) -> dict:
    """Requests admitted and not finished (running or waiting for KV room)."""
    return {"load": state.in_flight}


def model_info(state: ServerState) -> dict:
    config = state.engine.engine.config
    return {
        "model_path": str(config.model_dir),
        "tokenizer_path": str(config.model_dir),
        "served_model_names": list(state.config.served_model_names),
        "is_generation": config.model.generates,
        "max_model_len": config.max_model_len,
    }


def server_info(state: ServerState) -> dict:
    config = state.engine.engine.config
    stats = state.engine.stats()
    return {
        "version": __version__,
        "served_model_names": list(state.config.served_model_names),
        "model_path": str(config.model_dir),
        "dtype": config.dtype,
        "tensor_parallel_size": config.tp,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": config.block_size,
        "num_kv_blocks": config.num_kv_blocks,
        "enable_prefix_caching": config.enable_prefix_caching,
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_cache_usage": stats.kv_usage,
    }


def _reset(engine: LLMEngine) -> bool:
    return engine.blocks.reset_prefix_cache()


async def flush_prefix_cache(state: ServerState) -> dict:
    """Empties the prefix cache between steps (KV-event subscribers get AllBlocksCleared); a
    409 while requests hold blocks, as vLLM refuses a reset then."""
    if not await state.engine.call(_reset):
        raise APIError(
            409,
            "requests are running: the prefix cache is flushed only while no request holds KV "
            "blocks; retry when idle",
            "invalid_request_error",
            None,
            "requests_running",
        )
    return {"flushed": True}
