"""A child started by the control app ends when the app ends, however the app ends.

The app puts its pid in HOMELAB_LLM_PARENT_PID when it launches `homelab-llm serve`; the CLI calls
`start_from_env()` first thing. A daemon thread then polls getppid(): once the parent is gone
(SIGKILL, a crash, a closed terminal) the child's process group gets SIGTERM (the server drains
and exits), and SIGKILL after a grace period, so nothing keeps holding the GPU or the port.

The variable is removed from this process's environment at once, so grandchildren (TP workers,
whose parent is the server, not the app) never inherit a watch on the wrong parent.
"""

from __future__ import annotations

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
