"""The app's exit is bounded, whatever blocks it.

A closed terminal (SIGHUP), SIGTERM or SIGINT asks the app to exit normally (children get their
grace period) and arms a deadline: if the process is still alive after DEADLINE_S, the children's
process groups are killed and the process ends with os._exit, skipping whatever thread join or
dead-tty write held it. A second signal does that at once. Handlers are plain `signal.signal`
ones, which run between bytecodes of the main thread even while it waits on a lock, unlike an
asyncio handler, which needs the event loop that may be the thing stuck.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

DEADLINE_S = 4.5  # the bound is 5 s from the signal to the process being gone
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class ExitGuard:
    def __init__(self, request_exit: Callable[[int], None], kill_children: Callable[[], None],
                 deadline_s: float = DEADLINE_S) -> None:
        """request_exit(code) must be safe to call from a signal handler (e.g. through
        loop.call_soon_threadsafe); kill_children() must not block."""
        self.request_exit = request_exit
        self.kill_children = kill_children
        self.deadline_s = deadline_s
        self.signals = 0
        self._armed = False

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        code = 128 + signum
        if self.signals > 1:
            self.end_now(code)
        self.arm(code)
        try:
            self.request_exit(code)
        except Exception:  # the loop may be closed already; the deadline still holds
            pass

    def arm(self, code: int) -> None:
        """End the process with `code` after the deadline unless it ended by itself."""
        if self._armed:
            return
        self._armed = True
        threading.Thread(target=self._deadline, args=(code,), name="exit-deadline",
                         daemon=True).start()

    def _deadline(self, code: int) -> None:
        time.sleep(self.deadline_s)
        self.end_now(code)

    def end_now(self, code: int) -> None:
        try:
            self.kill_children()
        finally:
            os._exit(code)
