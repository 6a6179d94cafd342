"""The CLI, the supervisor and the frontend never import torch: only the ranks pay for it at
startup (about 1.3 s of CPU each on the 2-core machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "cpud.cli",
        "cpud.supervisor",
        "cpud.frontend.server",
        "cpud.model.model_dir",
        "cpud.process.parent_death",
        "cpud.native",
        "cpud.native.shm_allreduce",
    ],
)
def test_module_does_not_import_torch(module):
    code = f"import sys, {module}; print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} imports torch: {out.stdout}"


def test_serve_help_does_not_import_torch():
    code = (
        "import sys\nfrom cpud.cli import main\ntry:\n    main(['serve', '--help'])\n"
        "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--model" in out.stdout and out.stderr.strip().endswith("False")


def test_supervisor_side_of_the_shm_segment_needs_no_torch(tmp_path):
    """What the supervisor does at tp > 1: create the segment, abort it, close it."""
    code = (
        "import sys\nfrom cpud import native\nfrom cpud.native.shm_allreduce import ShmGroup\n"
        "assert native.available(), native.load_error()\n"
        f"g = ShmGroup.create({str(tmp_path / 'seg')!r}, 2, 1 << 16)\n"
        "g.abort(1)\ng.close()\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_frontend_imports_neither_the_offline_engine_nor_rank_binding():
    code = (
        "import sys, cpud.frontend.server\n"
        "print(sorted({'cpud.llm', 'cpud.ranks.binding'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
