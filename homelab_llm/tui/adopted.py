"""A service process this app did not start (an orphan of an earlier app), handled through the
same few calls the manager makes on a subprocess.Popen: pid, poll(), wait(), returncode.

Its output went to the app that started it, so there is no stdout to read, and its exit code
cannot be learnt by a non-parent: it reads as UNKNOWN_EXIT once the process is gone.
"""

from __future__ import annotations

import subprocess
import time

import psutil

UNKNOWN_EXIT = -1
POLL_S = 0.1


class AdoptedProcess:
    stdout = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.args = [f"pid {pid}"]

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                gone = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                gone = True
            if gone:
                self.returncode = UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(POLL_S)
        return UNKNOWN_EXIT
