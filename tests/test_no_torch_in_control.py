"""A running daemon's control processes never map libtorch: the supervisor and the frontend
hold no libtorch*.so and no library from torch's package (its bundled libgomp included), at
tp=1 and at tp=2, where the supervisor sets up the shared-memory all-reduce segment through the
native library.  The ranks do map them, so the test reads the right files."""

from __future__ import annotations

import importlib.util
import re
import signal
from pathlib import Path

import httpx
import pytest

from cpud_server_helpers import child_pids, rank_pids, start_server

TORCH_DIR = str(Path(importlib.util.find_spec("torch").origin).parent)
LIBTORCH = re.compile(r"/libtorch[^/]*\.so")


def mapped_files(pid: int) -> set[str]:
    """Paths of the files mapped into process pid."""
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.add(fields[5])
    return paths


def torch_files(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if LIBTORCH.search(p) or p.startswith(TORCH_DIR + "/"))


@pytest.mark.parametrize("tp", [1, 2])
def test_supervisor_and_frontend_never_map_libtorch(model_factory, tmp_path, tp):
    extra = ("--max-model-len", "256")
    if tp == 2:
        extra += ("--tp", "2", "--bind", "0|1")
    srv = start_server(model_factory("qwen3"), tmp_path / "serve.log", *extra)
    try:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        frontends = child_pids(srv.proc.pid, b"cpud.frontend.server")
        ranks = rank_pids(srv.proc.pid)
        assert len(frontends) == 1 and len(ranks) == tp
        control = {"supervisor": srv.proc.pid, "frontend": frontends[0]}
        maps = {name: mapped_files(pid) for name, pid in control.items()}
        rank_maps = [mapped_files(pid) for pid in ranks]
    finally:
        srv.stop(signal.SIGTERM)
    for name, paths in maps.items():
        assert torch_files(paths) == [], f"the {name} maps torch's libraries"
    native_in_supervisor = any("_cpud_native" in p for p in maps["supervisor"])
    assert native_in_supervisor == (tp == 2), "the supervisor sets up the segment only at tp=2"
    for paths in rank_maps:
        found = torch_files(paths)
        assert any("/libtorch_cpu.so" in p for p in found), found
        # torch's OpenMP runtime is the one the ranks' kernels run on: torch loads first
        gomp = [p for p in paths if "/libgomp" in p]
        assert gomp and all(p.startswith(TORCH_DIR + "/") for p in gomp), gomp
