"""Shared-memory all-reduce (cpud.native.ShmGroup) between real processes and threads.

Process tests spawn 2 and 4 ranks once each; every rank runs a battery of named
checks and writes "ok" or the failure per check to a JSON file, one test per
check reads them.  Inputs are seeded per (rank, case), so every rank computes
the expected fixed-order sum (rank 0 + rank 1 + ... in fp32) itself and
compares bit for bit.  Fault cases (timeout, abort, mismatch, dead peer) and
the tier cross-check run on threads of this process: the C waits release the
GIL.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import stat
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cpud import native
from cpud.native import (
    CollectiveMismatch,
    CollectiveTimeout,
    GroupAborted,
    PeerDied,
    ShmGroup,
)

MAX_BYTES = 4096  # small slots: most cases below need several chunks
SIZES = (1, 7, 4097)
CONSECUTIVE = 300


# ------------------------------------------------------------------ inputs


def _data(rank: int, case: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def _fixed_order_sum(world: int, case: int, shape: tuple[int, ...], dtype: torch.dtype):
    acc = _data(0, case, shape, dtype).float()
    for r in range(1, world):
        acc = acc + _data(r, case, shape, dtype).float()
    return acc.to(dtype)


def _expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else None
        raise AssertionError(f"{what}: {got.dtype} {tuple(got.shape)}, max |diff| {diff}")


# ------------------------------------------------- per-rank checks (spawned)


def _check_sums(g: ShmGroup, dtype: torch.dtype, case0: int) -> None:
    shapes = [(n,) for n in SIZES] + [(33, 65)]
    for i, shape in enumerate(shapes):
        x = _data(g.rank, case0 + i, shape, dtype)
        assert g.all_reduce(x) is x
        _expect_equal(x, _fixed_order_sum(g.size, case0 + i, shape, dtype), f"{dtype} {shape}")


def _check_chunked(g: ShmGroup) -> None:
    n = 5 * MAX_BYTES // 4 + 3  # 5+ chunks of fp32, 10+ of bf16
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        x = _data(g.rank, 300 + i, (n,), dtype)
        g.all_reduce(x)
        _expect_equal(x, _fixed_order_sum(g.size, 300 + i, (n,), dtype), f"chunked {dtype}")


def _check_consecutive(g: ShmGroup) -> None:
    inputs = [_data(r, 400, (17,), torch.float32) for r in range(g.size)]
    for i in range(CONSECUTIVE):
        x = inputs[g.rank] + i
        g.all_reduce(x)
        want = inputs[0] + i
        for r in range(1, g.size):
            want = want + (inputs[r] + i)
        _expect_equal(x, want, f"call {i}")


def _check_gather(g: ShmGroup) -> None:
    cases = [((3, 5), torch.float32), ((2, 3000), torch.bfloat16), ((4097,), torch.float32)]
    for i, (shape, dtype) in enumerate(cases):
        out = g.gather_last_dim(_data(g.rank, 500 + i, shape, dtype))
        if g.rank != 0:
            assert out is None, "non-root ranks get None"
            continue
        want = torch.cat([_data(r, 500 + i, shape, dtype) for r in range(g.size)], dim=-1)
        assert out is not None
        _expect_equal(out, want, f"gather {shape} {dtype}")
    ints = g.gather_last_dim(torch.full((2, 3), g.rank, dtype=torch.int64))
    if g.rank == 0:
        assert ints is not None
        assert ints.tolist() == [[r for r in range(g.size) for _ in range(3)]] * 2


def _check_barrier(g: ShmGroup) -> None:
    for _ in range(20):
        g.barrier()
    x = torch.ones(3)
    g.all_reduce(x)
    assert x.tolist() == [float(g.size)] * 3


BATTERY: dict[str, Callable[[ShmGroup], None]] = {
    "sum_fp32": lambda g: _check_sums(g, torch.float32, 100),
    "sum_bf16": lambda g: _check_sums(g, torch.bfloat16, 200),
    "chunked": _check_chunked,
    "consecutive": _check_consecutive,
    "gather_last_dim": _check_gather,
    "barrier": _check_barrier,
}


def _fault_timeout(g: ShmGroup) -> None:
    """Rank 0 waits for a rank 1 that never calls; rank 1 then sees the group aborted."""
    if g.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="rank 1 did not arrive") as info:
            g.all_reduce(torch.ones(4))
        assert info.value.rank == 1 and 0.4 < time.monotonic() - t0 < 5
        with pytest.raises(GroupAborted):
            g.all_reduce(torch.ones(4))  # the group stays unusable
        return
    deadline = time.monotonic() + 20
    while g.aborted_by() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(GroupAborted, match="rank 1 at fault"):
        g.barrier()


def _fault_dead_peer(g: ShmGroup) -> None:
    """Rank 1 exits without calling: rank 0 learns it within seconds, not the 30 s timeout."""
    if g.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(PeerDied, match="rank 1") as info:
            g.all_reduce(torch.ones(4))
        assert info.value.rank == 1 and time.monotonic() - t0 < 10


def _run_rank(paths: dict[str, str], rank: int, world: int, out_dir: str) -> None:
    """Spawned rank: runs the battery (and, at world 2, the fault cases), writes results."""
    torch.set_num_threads(1)
    groups = {name: ShmGroup.attach(p, rank, world, timeout=30.0) for name, p in paths.items()}
    if "timeout" in groups:
        groups["timeout"].timeout = 0.5
    checks: dict[str, Callable[[ShmGroup], None]] = dict(BATTERY)
    if world == 2:
        checks["fault_timeout"] = lambda _: _fault_timeout(groups["timeout"])
        checks["fault_dead_peer"] = lambda _: _fault_dead_peer(groups["dead"])
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            check(groups["main"])
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 - reported to the parent
            results[name] = traceback.format_exc()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    for g in groups.values():
        g.close()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def battery(request, tmp_path_factory) -> tuple[int, list[dict[str, str]]]:
    world: int = request.param
    out = tmp_path_factory.mktemp(f"allreduce{world}")
    names = ["main", "timeout", "dead"] if world == 2 else ["main"]
    paths = {n: f"/dev/shm/cpud-test-{os.getpid()}-{world}-{n}" for n in names}
    owners = [ShmGroup.create(p, world, MAX_BYTES) for p in paths.values()]
    try:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_run_rank, args=(paths, r, world, str(out))) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        for p in procs:
            if p.is_alive():
                p.kill()
    finally:
        for o in owners:
            o.unlink()
            o.close()
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {})
    return world, results


@pytest.mark.parametrize("check", list(BATTERY))
def test_processes(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    _assert_ok(battery, check)


@pytest.mark.parametrize("battery", [2], indirect=True, ids=["world2"])
@pytest.mark.parametrize("check", ["fault_timeout", "fault_dead_peer"])
def test_process_faults(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    _assert_ok(battery, check)


def _assert_ok(battery: tuple[int, list[dict[str, str]]], check: str) -> None:
    world, results = battery
    for rank, res in enumerate(results):
        detail = res.get(check, "no result")
        assert detail == "ok", f"rank {rank}/{world} {check}:\n{detail}"


# ------------------------------------------------------- in-process (threads)


@pytest.fixture
def seg_path(tmp_path) -> Iterator[str]:
    path = f"/dev/shm/cpud-test-{os.getpid()}-{tmp_path.name}"
    yield path
    for p in (path, *(str(q) for q in Path("/dev/shm").glob(Path(path).name + ".*"))):
        if os.path.exists(p):
            os.unlink(p)


def _threads(
    path: str,
    world: int,
    fn: Callable[[ShmGroup], Any],
    isa: str | None = None,
    per_rank_isa: list[str] | None = None,
) -> list[Any]:
    """Runs fn(group) for every rank on its own thread; returns results or exceptions."""
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        tier = per_rank_isa[rank] if per_rank_isa else isa
        try:
            with ShmGroup.attach(path, rank, world, timeout=10.0, isa=tier) as g:
                out[rank] = fn(g)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_segment_is_private(seg_path: str) -> None:
    with ShmGroup.create(seg_path, 2, 10_000) as owner:
        mode = os.stat(seg_path).st_mode
        assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600
        assert owner.max_bytes == 12288 and owner.rank == -1 and owner.size == 2
        os.chmod(seg_path, 0o644)
        with pytest.raises(PermissionError, match="0644"):
            ShmGroup.attach(seg_path, 0, 2)
        os.chmod(seg_path, 0o600)
        with pytest.raises(ValueError, match="world_size 4"):
            ShmGroup.attach(seg_path, 0, 4)
        with ShmGroup.attach(seg_path, 1, 2):
            with pytest.raises(RuntimeError, match="already attached"):
                ShmGroup.attach(seg_path, 1, 2)
        with pytest.raises(ValueError, match="not a member"):
            owner.all_reduce(torch.ones(2))


def test_create_replaces_stale_segment(seg_path: str) -> None:
    Path(seg_path).write_bytes(b"stale")
    with ShmGroup.create(seg_path, 1, 4096):
        with ShmGroup.attach(seg_path, 0, 1) as g:
            x = torch.arange(5.0)
            assert torch.equal(g.all_reduce(x), torch.arange(5.0))
            assert torch.equal(g.gather_last_dim(x), x)


def test_argument_checks(seg_path: str) -> None:
    with ShmGroup.create(seg_path, 1, 4096), ShmGroup.attach(seg_path, 0, 1) as g:
        for bad in (
            torch.ones(4, dtype=torch.float16),
            torch.ones(4, 4).t(),
            torch.ones(2, 3)[:, 1],
        ):
            with pytest.raises(ValueError, match="all_reduce"):
                g.all_reduce(bad)
        assert g.all_reduce(torch.empty(0)).numel() == 0
        assert g.gather_last_dim(torch.empty(3, 0)).shape == (3, 0)


def test_mismatched_sizes_fail_fast(seg_path: str) -> None:
    with ShmGroup.create(seg_path, 2, 4096):
        res = _threads(seg_path, 2, lambda g: g.all_reduce(torch.ones(8 + g.rank)))
    assert all(isinstance(r, CollectiveMismatch | GroupAborted) for r in res), res
    assert any(isinstance(r, CollectiveMismatch) for r in res)


def test_owner_abort_wakes_waiting_rank(seg_path: str) -> None:
    """The supervisor aborts (rank 1 died, say): rank 0, waiting for it, raises at once."""
    with ShmGroup.create(seg_path, 2, 4096) as owner, ShmGroup.attach(seg_path, 0, 2) as g:
        timer = threading.Timer(0.3, owner.abort, args=(1,))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(GroupAborted, match="rank 1 at fault") as info:
            g.all_reduce(torch.ones(4))
        timer.join()
        assert time.monotonic() - t0 < 5 and info.value.rank == 1
        assert owner.aborted_by() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiers_agree_bitwise(seg_path: str, dtype: torch.dtype) -> None:
    """One rank per ISA tier (scalar .. avx512): still the fixed-order sum, bit for bit."""
    tiers = native.supported_isas()
    world, n = len(tiers), 1000 + 37  # vector body + scalar tail
    with ShmGroup.create(seg_path, world, 4096):
        res = _threads(
            seg_path,
            world,
            lambda g: g.all_reduce(_data(g.rank, 700, (n,), dtype)),
            isa=None,
            per_rank_isa=tiers,
        )
    for tier, got in zip(tiers, res):
        _expect_equal(got, _fixed_order_sum(world, 700, (n,), dtype), f"tier {tier}")


def test_large_tensor_parallel_copy(seg_path: str) -> None:
    """1 MiB fp32 through 512 KiB slots: chunks big enough for the OpenMP copy and sum."""
    shape = (256, 1024)
    with ShmGroup.create(seg_path, 2, 512 << 10):
        res = _threads(
            seg_path, 2, lambda g: g.all_reduce(_data(g.rank, 800, shape, torch.float32))
        )
    for r in res:
        _expect_equal(r, _fixed_order_sum(2, 800, shape, torch.float32), "1 MiB")
