"""The test modules of the slow lane (pytest -m slow); tests/conftest.py marks their tests."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Modules that start daemons, run load and fuzzing sessions or compare real models with
# transformers: most of the suite's wall time. `pytest -m "not slow"` leaves them out.
SLOW_MODULES = frozenset(
    {
        "frontend/test_anthropic_api.py",
        "frontend/test_busy_engine_http.py",
        "frontend/test_cors_and_n.py",
        "frontend/test_daemon_tp2.py",
        "frontend/test_decoy_folder.py",
        "frontend/test_drain_cut.py",
        "frontend/test_early_kill.py",
        "frontend/test_guarded_serve.py",
        "frontend/test_http2.py",
        "frontend/test_hung_engine.py",
        "frontend/test_hostile_grammars.py",
        "frontend/test_lifecycle.py",
        "frontend/test_lm_eval.py",
        "frontend/test_load.py",
        "frontend/test_request_bounds.py",
        "frontend/test_schemathesis.py",
        "frontend/test_supervisor.py",
        "test_chat_template_sources.py",
        "test_default_model.py",
        "test_gguf_fuzz.py",
        "test_grammar_memory.py",
        "test_gguf_model.py",
        "test_gguf_quantized.py",
        "test_native_engine.py",
        "test_startup_work.py",
        "test_tp_processes.py",
        "tools/test_tool_clients_schemas.py",
    }
)
