"""Work done once per start: the supervisor parses a GGUF file's metadata once and hands what it
found to its children (the config and tensor table in the engine spec, the built tokenizer in
the frontend's spec), so the frontend and the ranks parse none (a parse of a 49k-token
vocabulary costs ~0.7 s of CPU in each process that does it). The ranks start before the plan
and import torch meanwhile; a refused start leaves none behind.

Every process of a real `cpud serve` runs with a sitecustomize on PYTHONPATH that records each
construction of the gguf package's reader (the one metadata parser every path goes through)
with the process's main module."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import httpx
from gguf import GGMLQuantizationType as T

from cpud_server_helpers import launch, wait_healthy

COUNTER = textwrap.dedent(
    """
    import importlib.abc, importlib.util, os, sys

    LOG = os.environ["CPUD_TEST_PARSE_LOG"]


    class CountReaders(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "gguf.gguf_reader":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                init = module.GGUFReader.__init__

                def counted(reader, *args, **kwargs):
                    main = os.path.basename(sys.argv[0]) if sys.argv else "?"
                    with open(LOG, "a") as log:
                        log.write(f"{os.getpid()} {main}\\n")
                    init(reader, *args, **kwargs)

                module.GGUFReader.__init__ = counted

            spec.loader.exec_module = exec_module
            return spec


    sys.meta_path.insert(0, CountReaders())
    """
)


def role(main: str) -> str:
    return {"worker.py": "rank", "server.py": "frontend"}.get(main, "supervisor")


def test_a_start_parses_the_gguf_metadata_once_in_the_supervisor_only(gguf_file, tmp_path):
    path = gguf_file("llama", T.Q8_0)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(COUNTER)
    parses = tmp_path / "parses.log"
    parses.touch()
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
        "CPUD_TEST_PARSE_LOG": str(parses),
    }
    server = launch(path, tmp_path / "serve.log", "--weight-cache", str(tmp_path / "w"), env=env)
    try:
        wait_healthy(server)
        reply = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    finally:
        assert server.stop() == 0, server.log()
    by_pid = collections.Counter(Path(parses).read_text().split("\n")[:-1])
    per_role: dict[str, list[int]] = collections.defaultdict(list)
    for line, count in by_pid.items():
        per_role[role(line.split()[1])].append(count)
    assert per_role == {"supervisor": [1]}, (per_role, server.log())


def marked_processes(marker: str) -> list[int]:
    """Live processes whose environment holds CPUD_TEST_MARK=marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"CPUD_TEST_MARK={marker}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_refused_start_leaves_no_rank_behind(gguf_file, tmp_path):
    """The ranks start before the plan (they import torch meanwhile); a plan that refuses the
    start ends with the one-line error and exit 2, and no rank process outlives it."""
    marker = uuid.uuid4().hex
    path = gguf_file("llama", T.Q8_0)
    done = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "serve", "--model", str(path), "--block-size", "24"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CPUD_TEST_MARK": marker},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["cpud: error: block_size must be a multiple of 16, got 24"]
    assert marked_processes(marker) == []


def test_a_rank_whose_spec_never_comes_exits_quietly():
    """A rank started ahead of its spec whose owner closes its stdin unwritten (a refused
    start) exits 0 without a word."""
    from cpud.process.child_process import module_command

    command = module_command("cpud.ranks.worker", "/nonexistent.json", str(os.getpid()))
    command.append("--when-told")
    done = subprocess.run(command, input=b"", capture_output=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
