"""Work done once per start: the supervisor parses a GGUF file's metadata once and hands what it
found to its children (the config and tensor table in the engine spec, the built tokenizer in
the frontend's spec), so the frontend and the ranks parse none (a parse of a 49k-token
vocabulary costs ~0.7 s of CPU in each process that does it).

Every process of a real `cpud serve` runs with a sitecustomize on PYTHONPATH that records each
construction of the gguf package's reader (the one metadata parser every path goes through)
with the process's main module."""

from __future__ import annotations

import collections
import textwrap
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
    import os

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
