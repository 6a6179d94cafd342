"""Bounds on the work one output constraint may cost the server: llguidance's parser limits,
the time a request waits for its grammar, how many grammars compile at once, the cache size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpud.settings import setting
from cpud.settings.errors import ConfigError

if TYPE_CHECKING:
    import llguidance

MiB = 1 << 20


@dataclass(frozen=True)
class GrammarLimits:
    """compile_timeout: seconds a request waits for its grammar (compile and first mask),
    queueing included. compile_threads: grammars compiled at once, each on a thread of lowered
    CPU priority. cache_mib: memory the compiled-grammar cache may hold (estimated per entry).
    lexer_fuel, step_lexer_fuel, max_lexer_states, max_grammar_size: llguidance's parser
    limits (lexer work to build a grammar's lexer, lexer work per token, lexer states, grammar
    symbols); a grammar past one is refused."""

    compile_timeout: float = setting("grammar_compile_timeout").default
    compile_threads: int = setting("grammar_compile_threads").default
    cache_mib: int = setting("grammar_cache_mib").default
    lexer_fuel: int = 100_000
    step_lexer_fuel: int = 200_000
    max_lexer_states: int = 50_000
    max_grammar_size: int = 500_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compile_timeout) and self.compile_timeout > 0):
            raise ConfigError(
                "--grammar-compile-timeout must be a positive number of seconds, "
                f"got {self.compile_timeout}"
            )
        if self.compile_threads < 1:
            raise ConfigError(
                f"--grammar-compile-threads must be at least 1, got {self.compile_threads}"
            )
        if self.cache_mib < 0:
            raise ConfigError(f"--grammar-cache-mib must be 0 or more, got {self.cache_mib}")
        for name in ("lexer_fuel", "step_lexer_fuel", "max_lexer_states", "max_grammar_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"the grammar limit {name} must be positive")

    @property
    def cache_bytes(self) -> int:
        return self.cache_mib * MiB

    def parser_limits(self) -> llguidance.LLParserLimits:
        import llguidance  # here: settings are read where grammars never compile

        return llguidance.LLParserLimits(
            initial_lexer_fuel=self.lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,  # errors go to clients: no parser state dumps
        )
