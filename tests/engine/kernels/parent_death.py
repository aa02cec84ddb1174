"""Helper processes that die with their parent.

The GPU compile check runs in a child of pytest (compile_background) that starts compile workers
of its own (gpu_compile). pytest's session-finish hook kills that process group, but a pytest
killed by a signal (a CI timeout, a Ctrl-C'd xdist run, `kill`) runs no hook, and the workers went
on compiling for minutes, taking both cores from whatever ran next. On Linux each helper asks
the kernel for SIGKILL when its parent exits (prctl PR_SET_PDEATHSIG), so the chain unwinds
whatever way pytest ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> bool:
    """SIGKILL this process when its parent exits (Linux; elsewhere nothing). Exits at once if
    the parent went away before the request (re-parented meanwhile); a parent that is PID 1
    itself (pytest as a container's init) is a live parent. True when armed."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if armed and os.getppid() != parent:
        os._exit(1)
    return armed
