"""The GPU compile check (test_gpu_compile.py) off the suite's critical path.

Its compiles take ~800 s of CPU (~7 minutes of wall on two cores) and need nothing from the
other tests, while most of the suite runs on one core (the interpreter, single-threaded Python).
So when a run selects a test that needs the compile report, the compiles start right after
collection in a child process at lower CPU priority, the tests that read the report move to the
end of the run, and they wait for it there. The child (and its compile workers, one process
group) is killed and reaped when the session ends, whatever happened before.

Run alone, `python -m tests.engine.kernels.compile_background OUT TARGETS JOBS TIMEOUT` writes
gpu_compile.run_all's report to OUT as JSON (what the child does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.engine.kernels.gpu_compile import REPO, TARGETS, run_all
from tests.engine.kernels.parent_death import die_with_parent

# The fixture the report tests take: a selected test that uses it starts the compiles.
REPORT_FIXTURE = "compile_report"
JOBS = max(1, min(2, os.cpu_count() or 1))
TIMEOUT = 3000.0  # s from the start: a slow machine is not a failed compile (a loaded box took 1,800+)
NICENESS = 10  # the child's CPU priority below the tests' own (CFS gives it ~10% when both want a core)


class BackgroundCompile:
    def __init__(self, targets: list[str], jobs: int, timeout: float) -> None:
        self.timeout = timeout
        self._dir = tempfile.TemporaryDirectory(prefix="gpu_compile_bg_")
        self._out = Path(self._dir.name) / "report.json"
        self._log = open(Path(self._dir.name) / "log.txt", "w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engine.kernels.compile_background", str(self._out),
             ",".join(targets), str(jobs), str(timeout)],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, process_group=0)
        # Its own process group (stop() kills it whole) but the tests' session: with the kernel's
        # autogroup scheduling, a new session would be a new CPU group, where NICENESS counts only
        # against its own workers, and the compiles would take a full core from the tests.
        self.pid = self._proc.pid  # also the process group's id
        self._started = time.monotonic()

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    def result(self) -> dict:
        """Wait for the report (up to the timeout from the start); raise with the child's log
        when it failed."""
        left = max(1.0, self._started + self.timeout - time.monotonic())
        try:
            code = self._proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if code or not self._out.exists():
            self._log.seek(0)
            raise RuntimeError(f"background compile exited {code}:\n{self._log.read()[-3000:]}")
        return json.loads(self._out.read_text())

    def stop(self) -> None:
        """Kill the child and its workers if still running, reap it, drop the files."""
        if self.running:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.wait()
        self._log.close()
        self._dir.cleanup()


# The running compile of each pytest config (by id: a plain dict, so that kernels_selftest's
# stand-in for pytest, which has no config stash, can import this module).
_RUNNING: dict[int, BackgroundCompile] = {}


def schedule(config, items: list, jobs: int = JOBS, timeout: float = TIMEOUT) -> None:
    """After collection (and deselection): if any item takes the report, move those items to
    the end and start the compiles."""
    reads = [REPORT_FIXTURE in getattr(item, "fixturenames", ()) for item in items]
    if not any(reads):
        return
    items[:] = [i for i, r in zip(items, reads) if not r] + [i for i, r in zip(items, reads) if r]
    _RUNNING[id(config)] = BackgroundCompile(list(TARGETS), jobs, timeout)


def started(config) -> BackgroundCompile | None:
    return _RUNNING.get(id(config))


def stop(config) -> None:
    handle = _RUNNING.pop(id(config), None)
    if handle is not None:
        handle.stop()


def _main(argv: list[str]) -> int:
    out, targets, jobs, timeout = argv[0], argv[1].split(","), int(argv[2]), float(argv[3])
    die_with_parent()  # a pytest killed by a signal runs no stop(): go with it
    os.nice(NICENESS)  # before the compile workers start: they inherit it
    Path(out).write_text(json.dumps(run_all(targets, jobs=jobs, timeout=timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
