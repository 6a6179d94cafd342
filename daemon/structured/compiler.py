"""Compile StructuredSpecs into llguidance matchers for one tokenizer, with a bounded cache.

llguidance rather than xgrammar: xgrammar imports torch (and triton), and the frontend that
compiles grammars must stay torch-free.

Thread safe: the server validates requests (compiling their grammars) on its event loop while
the engine thread admits them; a compile takes about a millisecond for a typical schema.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

import llguidance

from cpud.errors import RequestError, one_line
from cpud.structured.grammar import grammar_text
from cpud.structured.spec import StructuredKind, StructuredSpec
from cpud.tokenizer import Tokenizer

COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class CompileStats:
    """What the metrics report: constrained requests by kind and a compile-time histogram
    (counts per COMPILE_BUCKETS upper bound, then the overflow; not cumulative)."""

    requests: dict[str, int] = field(default_factory=dict)
    compile_counts: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS) + 1))
    compile_seconds: float = 0.0

    def copy(self) -> CompileStats:
        return CompileStats(dict(self.requests), list(self.compile_counts), self.compile_seconds)


def build_ll_tokenizer(
    tokenizer: Tokenizer, eos_token_ids: Collection[int] = ()
) -> llguidance.LLTokenizer:
    """llguidance's view of cpud's tokenizer (the HF and GGUF tokenizers are both a
    `tokenizers.Tokenizer` underneath), ending outputs with the engine's end-of-sequence
    tokens; about 0.2 s for a 49k vocabulary."""
    return llguidance.LLTokenizer(
        tokenizer.to_json(),
        n_vocab=tokenizer.vocab_size,
        eos_token=sorted(eos_token_ids or tokenizer.eos_token_ids) or None,
    )


class GrammarCompiler:
    """spec -> a fresh matcher at the grammar's start. Compiled matchers are kept (LRU, at
    most cache_size) and handed out as copies; the tokenizer is converted on first use."""

    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: Collection[int] = (), cache_size: int = 256
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CompileStats()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer; RequestError when this tokenizer cannot be converted."""
        with self._lock:
            return self._tokenizer_locked()

    def prepare_in_background(self) -> threading.Thread:
        """Convert the tokenizer on a thread now, so that the first constrained request does
        not wait for it on the server's event loop."""

        def prepare() -> None:
            try:
                self.ll_tokenizer()
            except RequestError:
                pass  # kept, and reported to each constrained request

        thread = threading.Thread(target=prepare, name="cpud-grammar-tokenizer", daemon=True)
        thread.start()
        return thread

    def _tokenizer_locked(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None and self._tokenizer_error is None:
            try:
                self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.eos_token_ids)
            except Exception as exc:  # the Rust side raises plain exceptions
                self._tokenizer_error = one_line(f"{type(exc).__name__}: {exc}", 300)
        if self._ll_tokenizer is None:
            raise RequestError(
                "constrained output is not available with this model's tokenizer "
                f"({self._tokenizer_error})"
            )
        return self._ll_tokenizer

    def check(self, spec: StructuredSpec) -> None:
        """RequestError (naming spec.source) when the spec does not compile."""
        self.matcher(spec)

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A new matcher for spec at its start state; RequestError when it does not compile.
        Compiling holds no lock (llguidance releases the GIL meanwhile), so a slow grammar
        delays only its own request."""
        if not isinstance(spec.value, str) or not all(isinstance(c, str) for c in spec.choices):
            raise RequestError(f"{spec.source}: the constraint must be given as text", spec.source)
        key = (spec.kind, spec.value, tuple(spec.choices))  # the grammar, whatever its source
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled.deep_copy()
            try:
                tokenizer = self._tokenizer_locked()
            except RequestError as exc:
                raise RequestError(f"{spec.source}: {exc}", spec.source) from None
        compiled = self._compile(spec, tokenizer)
        fresh = compiled.deep_copy()  # before others can reach the cached one
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return fresh

    def _compile(
        self, spec: StructuredSpec, tokenizer: llguidance.LLTokenizer
    ) -> llguidance.LLMatcher:
        started = time.perf_counter()
        grammar = grammar_text(spec)
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        seconds = time.perf_counter() - started
        with self._lock:
            self._stats.compile_counts[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
            self._stats.compile_seconds += seconds
        if compiled.is_error():
            problem = one_line(compiled.get_error(), 400)
            raise RequestError(
                f"{spec.source}: cannot compile the {spec.kind} constraint: {problem}", spec.source
            )
        return compiled

    def count_request(self, kind: StructuredKind) -> None:
        with self._lock:
            self._stats.requests[kind] = self._stats.requests.get(kind, 0) + 1

    def stats(self) -> CompileStats:
        with self._lock:
            return self._stats.copy()
