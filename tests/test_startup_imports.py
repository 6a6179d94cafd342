"""The CLI, the supervisor and the frontend never import torch: only the ranks pay for it at
startup (about 1.3 s of CPU each on the 2-core machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["cpud.cli", "cpud.supervisor", "cpud.frontend.server"])
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
