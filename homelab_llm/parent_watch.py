"""A child started by the control app ends when the app ends, however the app ends.

The app puts its pid in HOMELAB_LLM_PARENT_PID when it launches `homelab-llm serve`; the CLI calls
`start_from_env()` first thing. A daemon thread then polls getppid(): once the parent is gone
(SIGKILL, a crash, a closed terminal) the child's process group gets SIGTERM (the server drains
and exits), and SIGKILL after a grace period, so nothing keeps holding the GPU or the port.

The variable is removed from this process's environment at once, so grandchildren (TP workers,
whose parent is the server, not the app) never inherit a watch on the wrong parent.

Children the server starts itself (the engine process, tensor-parallel ranks) call
`die_with_parent()` instead: the kernel kills them when their parent dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_PID_ENV = "HOMELAB_LLM_PARENT_PID"
POLL_S = 0.5
GRACE_S = 10.0


def start_from_env() -> threading.Thread | None:
    raw = os.environ.pop(PARENT_PID_ENV, "")
    if not raw.isdigit():
        return None
    thread = threading.Thread(target=watch_parent, args=(int(raw),), name="parent-watch",
                              daemon=True)
    thread.start()
    return thread


def watch_parent(parent: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> None:
    while os.getppid() == parent:  # reparented (to init or a subreaper) once the parent dies
        time.sleep(poll_s)
    print(f"[homelab-llm] parent process {parent} is gone; stopping", file=sys.stderr, flush=True)
    _signal_own_group(signal.SIGTERM)
    time.sleep(grace_s)
    _signal_own_group(signal.SIGKILL)


def _signal_own_group(sig: signal.Signals) -> None:
    # The app starts the child as its own group's leader, so the group is exactly the server and
    # its workers; anything else (run by hand) only signals itself.
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), sig)
    else:
        os.kill(os.getpid(), sig)


def die_with_parent(parent: int | None = None) -> None:
    """Linux: get SIGKILL when the process that started us dies, so no child is orphaned. The
    signal follows the thread that started us, so start children from a long-lived thread. With
    `parent`, exit at once if it is already gone (it died before the request was in place)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)
