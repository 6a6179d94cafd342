"""KV cache pre-fault: pages mapped while the rank idles, contents kept, steps never shared."""

from __future__ import annotations

import ctypes
import errno
import gc
import hashlib
import math
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

from cpud import LLM, SamplingParams
from cpud.ranks.kv_pretouch import PAGE, KVPretouch, Region, populate_order
from cpud.ranks.stats import RankStatsCollector
from cpud.settings.config import EngineArgs, resolve_config

BLOCKS = 96
BLOCK_SHAPE = (2, 16, 128)  # kv heads, block size, head dim: 8 KiB per block in bf16
WAIT_S = 60


def fresh_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """bf16 tensor on a fresh anonymous mapping: never-touched pages, as the rank's cache is
    in a fresh process. torch.empty may reuse resident heap memory in a long test process,
    whatever the size (glibc serves large requests from free heap chunks before mmap)."""
    nbytes = 2 * math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.bfloat16).view(shape)


def fresh_cache(layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (BLOCKS * 64, *BLOCK_SHAPE)
    return [(fresh_tensor(shape), fresh_tensor(shape)) for _ in range(layers)]


def resident_fraction(tensor: torch.Tensor) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = tensor.data_ptr() // PAGE * PAGE
    end = -(-(tensor.data_ptr() + tensor.nbytes) // PAGE) * PAGE
    pages = (end - start) // PAGE
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, vector) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vector.raw) / pages


def always_idle() -> float:
    return 10.0


def test_the_order_covers_every_page_lowest_blocks_first():
    regions = [Region(0x10000 + 100, 8192, 10), Region(0x100000, 4096, 6)]
    ranges = populate_order(regions, call_bytes=8192 * 4)
    assert all(r.start % PAGE == 0 and r.stop % PAGE == 0 for r in ranges)
    # 4 blocks of each tensor per round; the second tensor runs out after two rounds
    starts = [r.start for r in ranges]
    assert starts[:2] == [0x10000, 0x100000]
    covered = set()
    for r in ranges:
        covered.update(range(r.start, r.stop, PAGE))
    for region in regions:
        first = region.address // PAGE * PAGE
        last = region.address + region.block_bytes * region.num_blocks - 1
        assert set(range(first, last + 1, PAGE)) <= covered
    assert len(ranges) == 3 + 2


def test_pages_get_mapped_and_contents_survive():
    caches = fresh_cache()
    key = caches[0][0]
    assert resident_fraction(key) < 0.1
    written = torch.randn(7, *BLOCK_SHAPE).to(torch.bfloat16)
    key[100:107] = written  # a block already in use when the helper arrives
    helper = KVPretouch(caches, always_idle).start()
    assert helper.done.wait(WAIT_S)
    assert helper.stopped_because is None
    assert helper.touched_bytes == helper.total_bytes >= sum(t.nbytes for p in caches for t in p)
    assert helper.policy == os.SCHED_IDLE
    for pair in caches:
        for tensor in pair:
            assert resident_fraction(tensor) == 1.0
    assert torch.equal(key[100:107], written)


def test_nothing_is_mapped_while_steps_run():
    caches = fresh_cache(layers=1)
    idle = threading.Event()
    helper = KVPretouch(caches, lambda: 10.0 if idle.is_set() else 0.0, quiet_s=0.05).start()
    time.sleep(0.5)
    assert helper.touched_bytes == 0 and not helper.done.is_set()
    assert resident_fraction(caches[0][0]) < 0.1
    idle.set()
    assert helper.done.wait(WAIT_S)
    assert helper.touched_bytes == helper.total_bytes
    assert helper.paused_s >= 0.4


@pytest.mark.parametrize(
    "error, reason",
    [(errno.EINVAL, "Linux 5.14"), (errno.ENOMEM, "ran out"), (errno.EIO, "madvise failed")],
)
def test_a_failing_madvise_stops_the_helper_with_a_reason(error, reason):
    calls = []

    def madvise(address: int, length: int, advice: int) -> int:
        calls.append((address, length, advice))
        return error if len(calls) == 3 else 0

    caches = fresh_cache(layers=1)
    helper = KVPretouch(caches, always_idle, madvise=madvise).start()
    assert helper.done.wait(WAIT_S)
    assert len(calls) == 3 and reason in helper.stopped_because
    assert helper.touched_bytes == sum(length for _, length, _ in calls[:2])


def test_a_freed_cache_stops_the_helper_before_it_touches_the_addresses_again():
    calls = []
    idle = threading.Event()
    caches = fresh_cache(layers=1)
    helper = KVPretouch(
        caches,
        lambda: 10.0 if idle.is_set() else 0.0,
        madvise=lambda address, length, advice: calls.append(address) or 0,
        quiet_s=0.05,
    ).start()
    del caches  # the owner frees its cache: the addresses may belong to anything next
    idle.set()
    assert helper.done.wait(WAIT_S)
    assert calls == [] and helper.touched_bytes == 0
    assert "freed" in helper.stopped_because


class Owner:
    """Holds its cache and the helper, whose idle_seconds is one of its own methods: the cycle
    a rank's runner makes."""

    def __init__(self) -> None:
        self.caches = fresh_cache(layers=1)
        self.busy = True  # the helper waits in a long sleep, between calls of idle_seconds
        self.helper = KVPretouch(self.caches, self.idle_seconds, quiet_s=3600).start()

    def idle_seconds(self) -> float:
        return 0.0 if self.busy else 10.0


def test_the_helper_never_keeps_its_owner_alive():
    gc.disable()  # freed by reference counts alone, as `del llm` frees an engine
    try:
        owner = Owner()
        helper, gone = owner.helper, weakref.ref(owner)
        cache = weakref.ref(owner.caches[0][0])
        del owner
        assert gone() is None and cache() is None
    finally:
        gc.enable()
    helper.stop()
    assert helper.done.is_set() and helper.touched_bytes == 0


def test_a_finished_helper_is_not_held_by_its_exit_hook():
    caches = fresh_cache(layers=1)
    helper = KVPretouch(caches, always_idle, madvise=lambda address, length, advice: 0).start()
    assert helper.done.wait(WAIT_S) and helper.stopped_because is None
    helper._thread.join(WAIT_S)
    gone = weakref.ref(helper)
    del helper
    gc.collect()
    assert gone() is None


def test_stop_ends_the_thread_between_madvise_calls():
    calls, caches = [], fresh_cache(layers=1)
    helper = KVPretouch(
        caches,
        always_idle,
        madvise=lambda address, length, advice: calls.append(time.sleep(0.01)) or 0,
        call_bytes=BLOCK_SHAPE[0] * BLOCK_SHAPE[1] * BLOCK_SHAPE[2] * 2,
    ).start()
    deadline = time.monotonic() + WAIT_S
    while not calls and time.monotonic() < deadline:
        time.sleep(0.001)
    helper.stop()
    assert helper.done.is_set() and helper.stopped_because == "stopped"
    assert 0 < len(calls) < BLOCKS * 64


EXIT_SCRIPT = """
    import atexit, torch
    from cpud.ranks.kv_pretouch import KVPretouch
    caches = [(torch.empty(64, 2, 16, 128), torch.empty(64, 2, 16, 128))]
    helpers = []
    # registered first, so it runs after the helper's own exit hook (atexit runs last in first)
    atexit.register(lambda: print("ended before teardown:", helpers[0].done.is_set()))
    helpers.append(KVPretouch(caches, lambda: 0.0).start())  # waits for idle forever
"""


def test_the_thread_has_ended_when_the_interpreter_tears_down():
    script = textwrap.dedent(EXIT_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "ended before teardown: True" in out.stdout


def test_a_dropped_engine_frees_its_weights_and_cache_at_once(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", num_kv_blocks=64)
    runner = llm.engine.executor.runner
    assert runner.kv_pretouch is not None
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert runner.kv_pretouch.done.wait(WAIT_S)  # its thread holds nothing now
    gone, cache = weakref.ref(runner), weakref.ref(runner.kv_caches[0][0])
    del runner
    gc.disable()
    try:
        del llm
        assert gone() is None and cache() is None
    finally:
        gc.enable()


def test_shutdown_frees_the_weights_and_cache(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", num_kv_blocks=64)
    gone = weakref.ref(llm.engine.executor.runner)
    gc.disable()
    try:
        llm.shutdown()
        assert gone() is None
    finally:
        gc.enable()


def test_the_engine_prefaults_its_cache_and_generates_the_same(model_factory):
    model = model_factory("qwen3")
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cold = LLM(model, dtype="float32", num_kv_blocks=64, kv_pretouch=False)
    assert cold.engine.executor.runner.kv_pretouch is None
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, greedy)]
    del cold
    warm = LLM(model, dtype="float32", num_kv_blocks=64)
    runner = warm.engine.executor.runner
    helper = runner.kv_pretouch
    assert helper is not None and helper.done.wait(WAIT_S)
    assert helper.touched_bytes >= runner.kv_cache_bytes
    assert runner.helper_threads == {helper.thread_id}
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, greedy)] == expected


def test_the_runner_is_busy_only_during_a_step(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", num_kv_blocks=64, kv_pretouch=False)
    runner = llm.engine.executor.runner
    seen = []
    forward = runner._forward

    def spy(plan):
        seen.append(runner.idle_seconds())
        return forward(plan)

    runner._forward = spy
    time.sleep(0.05)
    assert runner.idle_seconds() >= 0.05
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert seen and all(s == 0.0 for s in seen)
    assert 0 < runner.idle_seconds() < 5


def test_the_setting_reaches_the_config_and_the_cli(model_factory):
    from cpud.cli import apply_env_defaults, build_parser

    model = model_factory("qwen3")
    assert resolve_config(EngineArgs(), model).kv_pretouch is True
    assert resolve_config(EngineArgs(kv_pretouch=False), model).kv_pretouch is False
    parser = build_parser()
    assert parser.parse_args(["serve"]).kv_cache_pretouch is True
    assert parser.parse_args(["serve", "--no-kv-cache-pretouch"]).kv_cache_pretouch is False
    apply_env_defaults(parser, {"CPUD_KV_CACHE_PRETOUCH": "false"})
    assert parser.parse_args(["serve"]).kv_cache_pretouch is False


def test_the_helper_thread_does_not_count_as_a_busy_compute_thread():
    stop = threading.Event()
    ids = []

    def spin() -> None:
        # busy on a CPU, but hashing a large buffer without the GIL: a pure Python loop would
        # hold it and stall this test's main thread for seconds
        ids.append(threading.get_native_id())
        block = bytes(1 << 20)
        while not stop.is_set():
            hashlib.sha256(block).digest()

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        while not ids:
            time.sleep(0.01)
        everyone = frozenset(int(tid) for tid in os.listdir("/proc/self/task"))
        counted = RankStatsCollector(0, None, [0, 1, 2, 3], 4)
        helpers = RankStatsCollector(0, None, [0, 1, 2, 3], 4, everyone)
        time.sleep(0.3)
        assert ids[0] in everyone
        assert counted.snapshot(None, 0).threads_busy >= 1
        assert helpers.snapshot(None, 0).threads_busy == 0
    finally:
        stop.set()
        thread.join()
