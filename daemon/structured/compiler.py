"""Compile StructuredSpecs into llguidance matchers for one tokenizer, with a bounded cache.

llguidance rather than xgrammar: xgrammar imports torch (and triton), and the frontend that
compiles grammars must stay torch-free.

A grammar's work is bounded: it runs on the compile threads (few, at lowered CPU priority;
never the engine thread, never the event loop) within llguidance's parser limits, and the
request waits for it at most `compile_timeout` seconds. The work covers the compile, the first
mask and one token past it, so a grammar its input makes unusable is refused at validation
(a 400), not at the first token. A request that ends first cancels its compile if it has not
started. Thread safe.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import time
from collections.abc import Collection
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

import llguidance

from cpud.settings.errors import CpudError, RequestError, one_line
from cpud.structured.cache import ByteBoundedCache
from cpud.structured.grammar import grammar_text
from cpud.structured.limits import GrammarLimits
from cpud.structured.matcher import StartedGrammar
from cpud.structured.pool import CompilePool, current_scope
from cpud.structured.spec import StructuredKind, StructuredSpec
from cpud.text.tokenizer import Tokenizer

COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Resident bytes a compiled grammar holds per byte of llguidance grammar text (measured: JSON
# schemas of 1k to 15k properties hold 130-160); the growth measured while compiling counts
# instead when larger (a lexer expanded by a few bytes of regex).
BYTES_PER_GRAMMAR_BYTE = 192
REJECTIONS = ("invalid", "timeout", "busy", "cancelled")
PAGE = os.sysconf("SC_PAGE_SIZE")
TRIM_AFTER_BYTES = 32 << 20  # RSS growth after which a compile thread trims the heap


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


class GrammarBusyError(CpudError):
    """Grammars compiling ahead of this request's took all of its wait: retry shortly."""


@dataclass
class CompileStats:
    """What the metrics report: constrained requests by kind, a compile-time histogram (counts
    per COMPILE_BUCKETS upper bound, then the overflow; not cumulative), constraints refused
    by reason (REJECTIONS) and the cache's estimated bytes."""

    requests: dict[str, int] = field(default_factory=dict)
    compile_counts: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS) + 1))
    compile_seconds: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)
    cache_bytes: int = 0

    def copy(self) -> CompileStats:
        return CompileStats(
            dict(self.requests),
            list(self.compile_counts),
            self.compile_seconds,
            dict(self.rejected),
            self.cache_bytes,
        )


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


def failure_text(exc: BaseException) -> str:
    """A failure of llguidance as one line; re-raises interpreter exits. llguidance's Rust
    panics arrive as PanicException, a BaseException that `except Exception` misses."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise exc
    return one_line(f"{type(exc).__name__}: {exc}", 300)


def resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * PAGE


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc keeps what a big grammar
    freed in its per-thread arenas, where the next grammar may not fit: RSS only grows)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def first_allowed(mask: bytes, skip: Collection[int]) -> int | None:
    """The lowest token id the mask allows, other than those in skip."""
    for index, byte in enumerate(mask):
        while byte:
            low = byte & -byte
            token = index * 8 + low.bit_length() - 1
            if token not in skip:
                return token
            byte ^= low
    return None


class GrammarCompiler:
    """spec -> a StartedGrammar (kept in a cache bounded in bytes; matchers are handed out as
    copies); the tokenizer is converted on first use."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: Collection[int] = (),
        limits: GrammarLimits | None = None,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.limits = limits = limits or GrammarLimits()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._cache: ByteBoundedCache[StartedGrammar] = ByteBoundedCache(limits.cache_bytes)
        self._pool = CompilePool(limits.compile_threads, exit_wait_s=limits.compile_timeout)
        self._lock = threading.Lock()
        self._stats = CompileStats()
        self._trimmed_at = resident_bytes()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer; RequestError when this tokenizer cannot be converted."""
        with self._lock:
            return self._tokenizer_locked()

    def prepare_in_background(self) -> Future:
        """Convert the tokenizer on a compile thread now, so that the first constrained
        request does not wait for it on the server's event loop."""

        def prepare() -> None:
            try:
                self.ll_tokenizer()
            except RequestError:
                pass  # kept, and reported to each constrained request

        return self._pool.submit(prepare)

    def _tokenizer_locked(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None and self._tokenizer_error is None:
            try:
                self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.eos_token_ids)
            except BaseException as exc:  # a panic too: converted once, failed once
                self._tokenizer_error = failure_text(exc)
        if self._ll_tokenizer is None:
            raise RequestError(
                "constrained output is not available with this model's tokenizer "
                f"({self._tokenizer_error})"
            )
        return self._ll_tokenizer

    def check(self, spec: StructuredSpec) -> None:
        """RequestError (naming spec.source) when the spec cannot be used."""
        self.start(spec)

    def matcher(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        """A new matcher for spec at its start state; RequestError when it cannot be used."""
        return self.start(spec).matcher()

    def start(self, spec: StructuredSpec) -> StartedGrammar:
        """spec compiled, with its first mask; RequestError when the spec cannot be used
        (malformed, past a limit, too slow to compile, allowing no output), GrammarBusyError
        when other grammars held the compile threads for all of the wait."""
        if not isinstance(spec.value, str) or not all(isinstance(c, str) for c in spec.choices):
            raise RequestError(f"{spec.source}: the constraint must be given as text", spec.source)
        key = (spec.kind, spec.value, tuple(spec.choices))  # the grammar, whatever its source
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        try:
            tokenizer = self.ll_tokenizer()
        except RequestError as exc:
            raise RequestError(f"{spec.source}: {exc}", spec.source) from None
        future = self._pool.submit(lambda: self._build(spec, tokenizer, key))
        return self._wait(spec, future)

    def _wait(self, spec: StructuredSpec, future: Future) -> StartedGrammar:
        deadline = time.monotonic() + self.limits.compile_timeout
        scope = current_scope()
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                error = future.exception(timeout=min(remaining, 0.1))
            except TimeoutError:
                error = None
            except CancelledError:
                break
            else:
                if error is None:
                    return future.result()
                del future  # the error, re-raised here, must not reach it: a reference cycle
                raise error
            if scope is not None and scope.closed.is_set():
                break
        if scope is not None and scope.closed.is_set():
            future.cancel()
            self._reject("cancelled")
            raise RequestError(f"{spec.source}: the request ended before its constraint compiled")
        if future.cancel():  # never started: the threads were busy with others' grammars
            self._reject("busy")
            raise GrammarBusyError(
                f"{spec.source}: other constraints kept the grammar compiler busy for "
                f"{self.limits.compile_timeout:g} s; retry shortly"
            )
        self._reject("timeout")
        raise RequestError(
            f"{spec.source}: the {spec.kind} constraint did not compile within "
            f"{self.limits.compile_timeout:g} s: simplify it",
            spec.source,
        )

    def _build(
        self, spec: StructuredSpec, tokenizer: llguidance.LLTokenizer, key: tuple
    ) -> StartedGrammar:
        """On a compile thread: the compile, the first mask, one token past it."""
        try:
            return self._build_measured(spec, tokenizer, key, resident_bytes())
        finally:
            self._release_if_grown()

    def _release_if_grown(self) -> None:
        """Gives free pages back once RSS has grown TRIM_AFTER_BYTES since it last did."""
        now = resident_bytes()
        with self._lock:
            grown = now - self._trimmed_at > TRIM_AFTER_BYTES
            self._trimmed_at = min(self._trimmed_at, now)
        if grown:
            release_free_memory()
            with self._lock:
                self._trimmed_at = resident_bytes()

    def _build_measured(
        self, spec: StructuredSpec, tokenizer: llguidance.LLTokenizer, key: tuple, before: int
    ) -> StartedGrammar:
        started = time.perf_counter()
        try:
            grammar = grammar_text(spec)
            compiled = llguidance.LLMatcher(
                tokenizer, grammar, log_level=0, limits=self.limits.parser_limits()
            )
            self._refuse_if_failed(compiled, spec, f"cannot compile the {spec.kind} constraint")
            probe = compiled.deep_copy()
            first_mask = probe.compute_bitmask()
            self._refuse_if_failed(probe, spec, f"the {spec.kind} constraint allows no output")
            token = first_allowed(first_mask, self.eos_token_ids)
            if token is not None:
                probe.consume_token(token)
                probe.compute_bitmask()
                self._refuse_if_failed(
                    probe, spec, f"the {spec.kind} constraint fails at its first token"
                )
        except RequestError:
            self._reject("invalid")
            raise
        except BaseException as exc:
            self._reject("invalid")
            raise RequestError(
                f"{spec.source}: llguidance failed on the {spec.kind} constraint "
                f"({failure_text(exc)})",
                spec.source,
            ) from None
        seconds = time.perf_counter() - started
        ready = StartedGrammar(compiled, first_mask)
        size = max(BYTES_PER_GRAMMAR_BYTE * len(grammar), resident_bytes() - before)
        self._cache.put(key, ready, size + len(first_mask))
        with self._lock:
            self._stats.compile_counts[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
            self._stats.compile_seconds += seconds
        return ready

    @staticmethod
    def _refuse_if_failed(matcher: llguidance.LLMatcher, spec: StructuredSpec, what: str) -> None:
        """RequestError `<source>: <what>: <llguidance's reason>` when the matcher failed."""
        if matcher.is_error():
            problem = one_line(matcher.get_error().replace("<non-verbose/>", ""), 400)
            raise RequestError(f"{spec.source}: {what}: {problem}", spec.source)

    def _reject(self, reason: str) -> None:
        with self._lock:
            self._stats.rejected[reason] = self._stats.rejected.get(reason, 0) + 1

    def count_request(self, kind: StructuredKind) -> None:
        with self._lock:
            self._stats.requests[kind] = self._stats.requests.get(kind, 0) + 1

    def stats(self) -> CompileStats:
        with self._lock:
            stats = self._stats.copy()
        stats.cache_bytes = self._cache.bytes
        return stats

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown()
