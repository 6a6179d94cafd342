"""The command line of cpud's own Python children (the frontend, the ranks).

`python -m pkg.mod` puts the working directory first on sys.path, so a folder named `cpud` where
the daemon was started (the parent of a clone, say) would be imported instead of the installed
package. `-P` keeps it off, but only from Python 3.11; `-I` would also drop PYTHONPATH and the
user's site-packages, where cpud may be installed. The children therefore run a short program
that removes that entry and then runs the module as `-m` would (same sys.argv, `__main__`).
"""

from __future__ import annotations

import sys

# sys is built in; runpy is imported only once the working directory is off the path.
RUNNER = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "import runpy\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n"
)


def module_command(module: str, *args: str) -> list[str]:
    """argv that runs `module` as __main__ with `args`, the working directory off sys.path."""
    return [sys.executable, "-c", RUNNER, module, *args]
