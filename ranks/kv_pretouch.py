"""Fault the KV cache's pages in while the rank is idle, so requests do not pay for them.

torch.empty leaves the cache unmapped, and the first write to each page faults: about 2.6 s per
GiB on this VM, most of it host-side, 8 % of a 512-token prefill that lands on fresh blocks.
vLLM zeroes its cache during its 90-second start; cpud serves at once and lets one helper
thread populate the pages with MADV_POPULATE_WRITE, which maps a page without writing to it,
so a block a step already uses keeps its contents.

The helper runs only after the rank has run no step for QUIET_S. A low scheduling priority
alone is not enough: on a VM the host's share of a fault stalls the vCPU whatever the guest
thread's priority, and a SCHED_IDLE populate halved decode speed here. Each madvise call
covers at most CALL_BYTES, so a step that arrives waits for at most one call (under 1 ms).
The thread walks the blocks in the order the block manager hands them out (lowest id first,
every layer). It holds the cache only through weak references, taken strong for the length of
each madvise call: once the cache is freed the thread stops, and it never populates another
allocation that reuses the freed addresses. An owner's bound method as `idle_seconds` is held
weakly too, so the thread never keeps its owner (and the owner's weights) alive. At interpreter
exit the thread is stopped and joined before the interpreter tears down (a daemon thread that
freed the last reference to the cache while it finalizes would end the process in torch's
C++ code).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import inspect
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cpud.ranks.libc import libc

log = logging.getLogger("cpud.ranks")

MADV_POPULATE_WRITE = 23  # Linux 5.14
PAGE = os.sysconf("SC_PAGE_SIZE")
CALL_BYTES = 256 << 10  # per madvise call and tensor
QUIET_S = 0.25  # seconds without a step before the helper works

Madvise = Callable[[int, int, int], int]  # (address, length, advice) -> 0 or an errno


@dataclass(frozen=True)
class Region:
    """One cache tensor: base address, bytes per block, blocks."""

    address: int
    block_bytes: int
    num_blocks: int


def regions_of(caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Region]:
    """The KV tensors ([blocks, ...], contiguous) as address ranges."""
    regions = []
    for pair in caches:
        for tensor in pair:
            if not tensor.is_contiguous() or tensor.dim() == 0 or tensor.shape[0] == 0:
                raise ValueError("KV cache tensors must be contiguous with blocks first")
            regions.append(
                Region(tensor.data_ptr(), tensor.nbytes // tensor.shape[0], tensor.shape[0])
            )
    return regions


def populate_order(regions: Sequence[Region], call_bytes: int = CALL_BYTES) -> list[range]:
    """Page-aligned address ranges to populate: block runs of about call_bytes per tensor, the
    lowest blocks of every tensor first."""
    if not regions:
        return []
    blocks_per_call = max(1, call_bytes // max(r.block_bytes for r in regions))
    ranges = []
    for first in range(0, max(r.num_blocks for r in regions), blocks_per_call):
        for r in regions:
            if first >= r.num_blocks:
                continue
            last = min(first + blocks_per_call, r.num_blocks)
            start = (r.address + first * r.block_bytes) // PAGE * PAGE
            end = -(-(r.address + last * r.block_bytes) // PAGE) * PAGE
            ranges.append(range(start, end))
    return ranges


def libc_madvise() -> Madvise:
    lib = libc()

    def madvise(address: int, length: int, advice: int) -> int:
        return 0 if lib.madvise(address, length, advice) == 0 else ctypes.get_errno()

    return madvise


class KVPretouch:
    """A daemon thread populating the given KV cache whenever `idle_seconds()` (seconds since
    the owner's last step, 0 during one) reaches quiet_s; `done` is set when it stops (all pages
    mapped, or a reason in `stopped_because`)."""

    def __init__(
        self,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        idle_seconds: Callable[[], float],
        madvise: Madvise | None = None,
        call_bytes: int = CALL_BYTES,
        quiet_s: float = QUIET_S,
    ):
        self.ranges = populate_order(regions_of(caches), call_bytes)
        self._cache_refs = [weakref.ref(t) for pair in caches for t in pair]
        self.total_bytes = sum(len(r) for r in self.ranges)
        self.touched_bytes = 0
        self.seconds = 0.0
        self.policy: int | None = None
        self.stopped_because: str | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self.paused_s = 0.0
        self._idle_seconds = _held_weakly(idle_seconds)
        self._quiet_s = quiet_s
        self._madvise = madvise
        self._thread = threading.Thread(target=self._run, name="kv-pretouch", daemon=True)

    def start(self) -> KVPretouch:
        atexit.register(self.stop)  # taken back when the thread ends
        try:
            self._thread.start()
        except BaseException:
            atexit.unregister(self.stop)
            raise
        return self

    def stop(self) -> None:
        """Stop the thread after its madvise call in flight (under 1 ms) and wait for it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    def _run(self) -> None:
        try:
            self._populate()
        except Exception as exc:  # a helper thread must never take the rank down
            self.stopped_because = f"{type(exc).__name__}: {exc}"
        finally:
            atexit.unregister(self.stop)
            self.done.set()
            if self.stopped_because and not self._stop.is_set():
                log.info("KV cache pre-fault stopped: %s", self.stopped_because)

    def _populate(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            self.stopped_because = f"SCHED_IDLE is not permitted ({exc}); pages fault on use"
            return
        self.policy = os.sched_getscheduler(0)
        madvise = self._madvise or libc_madvise()
        started = time.perf_counter()
        for span in self.ranges:
            self._wait_quiet()
            if self._stop.is_set():
                self.stopped_because = "stopped"
                return
            cache = [ref() for ref in self._cache_refs]
            if any(t is None for t in cache):
                self.stopped_because = "the KV cache was freed"
                return
            error = madvise(span.start, len(span), MADV_POPULATE_WRITE)
            del cache
            if error:
                self.stopped_because = _reason(error)
                return
            self.touched_bytes += len(span)
        self.seconds = time.perf_counter() - started
        log.info(
            "KV cache pre-faulted: %.2f GiB in %.1f s (%.1f s of it waiting for idle)",
            self.touched_bytes / (1 << 30),
            self.seconds,
            self.paused_s,
        )

    def _wait_quiet(self) -> None:
        while not self._stop.is_set() and (idle := self._idle_seconds()) < self._quiet_s:
            pause = self._quiet_s - idle
            self._stop.wait(pause)
            self.paused_s += pause


def _held_weakly(idle_seconds: Callable[[], float]) -> Callable[[], float]:
    """idle_seconds, or for a bound method the same through a weak reference to its object
    (gone: idle, so the thread moves on and finds the cache freed)."""
    if not inspect.ismethod(idle_seconds):
        return idle_seconds
    method = weakref.WeakMethod(idle_seconds)

    def idle() -> float:
        bound = method()
        return math.inf if bound is None else bound()

    return idle


def _reason(error: int) -> str:
    if error == errno.EINVAL:
        return "MADV_POPULATE_WRITE needs Linux 5.14 or later; pages fault on first use"
    if error == errno.ENOMEM:
        return "memory ran out"
    return f"madvise failed: {os.strerror(error)}"
