"""No orphans: a child process asks the kernel to kill it when its parent exits.  A leaf
module (ctypes and os only), so that the frontend and the ranks share it without importing each
other's packages."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to kill this process when its parent exits: no orphans. `parent` is the
    pid of the process that spawned this one: when it is no longer the parent, it died before
    the request was made (the kernel would never send the signal) and this process exits now.
    Call it first thing, before heavy imports: an orphan runs on until this call."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
