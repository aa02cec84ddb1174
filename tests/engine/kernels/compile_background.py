"""The GPU compile check (test_gpu_compile.py) off the suite's critical path.

Its 935 compiles take ~1,800 s of CPU (943 s of wall on two idle cores of an AVX2 EPYC; the
TTGIR and LLVM IR passes ~70% of it, the assemblers ~20%), of which it runs only those whose
Triton cache key is not listed as passed (compile_known.py: after a kernel change, the changed
ones), and need nothing from the other tests. So when a run selects a test that needs the compile report, the compiles start right
after collection in a child process at lower CPU priority, the tests that read the report move
to the end of the run, and they wait for it there. The child (and its compile workers, one process
group) is killed and reaped when the session ends, whatever happened before.

Under pytest-xdist (`-n 2`, the README's command) the workers collect and run the tests, but the
compile belongs to the controller, which outlives them all: it starts the child when a worker's
collection holds a report test, and each worker waits for the report in the folder the
controller named in its `workerinput`. The files in that folder: `started` (the start's Unix
time), the child's `log.txt`, its `report.json` on success, and `exit` (its exit code, written
by the owner's reaper thread when it ends).

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
import threading
import time
from pathlib import Path

from tests.engine.kernels.gpu_compile import REPO, TARGETS, run_all
from tests.engine.kernels.parent_death import die_with_parent

# The fixture the report tests take: a selected test that uses it starts the compiles.
REPORT_FIXTURE = "compile_report"
# Under xdist the controller sees only test ids: the module whose tests take the fixture.
REPORT_MODULE = "tests/engine/kernels/test_gpu_compile.py::"
WORKER_KEY = "homelab_llm_compile_folder"  # workerinput's key for the controller's folder
JOBS = max(1, min(2, os.cpu_count() or 1))
TIMEOUT = 4000.0  # s from the start: a slow machine is not a failed compile (under -n 2 it ends last, ~28 min in here)
NICENESS = 10  # the child's CPU priority below the tests' own (CFS gives it ~10% when both want a core)
POLL_S = 0.5


def wait_report(folder: Path, timeout: float) -> dict:
    """The report the child in folder writes: wait for its exit (up to timeout from its start);
    raise with its log when it failed or never ended."""
    deadline = float((folder / "started").read_text()) + timeout
    exit_file = folder / "exit"
    while not exit_file.exists():
        if time.time() > deadline:
            raise TimeoutError(f"background compile in {folder} still running after {timeout:.0f} s")
        time.sleep(POLL_S)
    code, report = exit_file.read_text().strip(), folder / "report.json"
    if code != "0" or not report.exists():
        log = (folder / "log.txt").read_text() if (folder / "log.txt").exists() else ""
        raise RuntimeError(f"background compile exited {code}:\n{log[-3000:]}")
    return json.loads(report.read_text())


class BackgroundCompile:
    """The child that compiles, owned by the process that started it (pytest, or xdist's controller)."""

    def __init__(self, targets: list[str], jobs: int, timeout: float, folder: Path) -> None:
        self.timeout, self.folder = timeout, Path(folder)
        (self.folder / "started").write_text(repr(time.time()))
        self._log = open(self.folder / "log.txt", "w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engine.kernels.compile_background", str(self.folder / "report.json"),
             ",".join(targets), str(jobs), str(timeout)],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, process_group=0)
        # Its own process group (stop() kills it whole) but the tests' session: with the kernel's
        # autogroup scheduling, a new session would be a new CPU group, where NICENESS counts only
        # against its own workers, and the compiles would take a full core from the tests.
        self.pid = self._proc.pid  # also the process group's id
        # Reaped as soon as it ends, so a waiter in another process (an xdist worker) sees its code.
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        code = self._proc.wait()
        (self.folder / "exit.tmp").write_text(str(code))
        os.replace(self.folder / "exit.tmp", self.folder / "exit")

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    def result(self) -> dict:
        try:
            return wait_report(self.folder, self.timeout)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the child and its workers if still running, reap it."""
        if self.running:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.wait()
        self._reaper.join()
        self._log.close()


class ControllerCompile:
    """An xdist worker's view of the controller's compile: only its folder."""

    def __init__(self, folder: str, timeout: float) -> None:
        self.folder, self.timeout = Path(folder), timeout

    def result(self) -> dict:
        if not (self.folder / "started").exists():
            raise RuntimeError(f"the xdist controller started no compile in {self.folder} "
                               f"(its test ids did not start with {REPORT_MODULE!r})")
        return wait_report(self.folder, self.timeout)

    def stop(self) -> None:
        """The controller owns the child."""


# The running compile of each pytest config (by id: a plain dict, so that kernels_selftest's
# stand-in for pytest, which has no config stash, can import this module).
_RUNNING: dict[int, BackgroundCompile | ControllerCompile] = {}
_FOLDERS: dict[int, tempfile.TemporaryDirectory] = {}  # each config's compile folder (stop() drops it)


def schedule(config, items: list, jobs: int = JOBS, timeout: float = TIMEOUT) -> None:
    """After collection (and deselection): if any item takes the report, move those items to
    the end and start the compiles (an xdist worker: wait for the controller's)."""
    reads = [REPORT_FIXTURE in getattr(item, "fixturenames", ()) for item in items]
    if not any(reads):
        return
    items[:] = [i for i, r in zip(items, reads) if not r] + [i for i, r in zip(items, reads) if r]
    folder = getattr(config, "workerinput", {}).get(WORKER_KEY)
    _RUNNING[id(config)] = (ControllerCompile(folder, timeout) if folder is not None
                            else BackgroundCompile(list(TARGETS), jobs, timeout, Path(controller_folder(config))))


def controller_folder(config) -> str:
    """The folder of this config's compile (made once): the child's files; under xdist the
    controller names it in each worker's workerinput."""
    if id(config) not in _FOLDERS:
        _FOLDERS[id(config)] = tempfile.TemporaryDirectory(prefix="gpu_compile_bg_")
    return _FOLDERS[id(config)].name


def controller_collected(config, ids: list[str], jobs: int = JOBS, timeout: float = TIMEOUT) -> None:
    """A worker's collection reached the controller: start the compile once if it holds a report test."""
    if id(config) in _RUNNING or not any(i.startswith(REPORT_MODULE) for i in ids):
        return
    _RUNNING[id(config)] = BackgroundCompile(list(TARGETS), jobs, timeout, Path(controller_folder(config)))


def started(config) -> BackgroundCompile | ControllerCompile | None:
    return _RUNNING.get(id(config))


def stop(config) -> None:
    handle = _RUNNING.pop(id(config), None)
    if handle is not None:
        handle.stop()
    folder = _FOLDERS.pop(id(config), None)
    if folder is not None:
        folder.cleanup()


def _main(argv: list[str]) -> int:
    out, targets, jobs, timeout = argv[0], argv[1].split(","), int(argv[2]), float(argv[3])
    die_with_parent()  # a pytest killed by a signal runs no stop(): go with it
    os.nice(NICENESS)  # before the compile workers start: they inherit it
    Path(out).write_text(json.dumps(run_all(targets, jobs=jobs, timeout=timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
