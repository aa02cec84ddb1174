"""compile_background: the report's tests go last, the compiles start once, and nothing outlives
the session, even one ended by a signal (the compile itself is test_gpu_compile.py's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.engine.kernels import compile_background as bg


class Config:
    """A pytest config as compile_background sees it: only its identity."""


def item(name: str, uses_report: bool) -> SimpleNamespace:
    return SimpleNamespace(name=name, fixturenames=["request", bg.REPORT_FIXTURE] if uses_report else ["tmp_path"])


def test_nothing_starts_without_a_test_that_reads_the_report() -> None:
    config, items = Config(), [item("a", False), item("b", False)]
    bg.schedule(config, items)
    assert bg.started(config) is None and [i.name for i in items] == ["a", "b"]
    bg.stop(config)  # a no-op


def test_report_tests_move_last_and_stop_reaps_the_whole_group(monkeypatch) -> None:
    launched = []

    class Fake:
        def __init__(self, targets, jobs, timeout, folder) -> None:
            launched.append((targets, jobs, timeout))

        def stop(self) -> None:
            launched.append("stopped")

    monkeypatch.setattr(bg, "BackgroundCompile", Fake)
    config = Config()
    items = [item("compile", True), item("a", False), item("scan", False), item("captured", True)]
    bg.schedule(config, items, jobs=1, timeout=5.0)
    assert [i.name for i in items] == ["a", "scan", "compile", "captured"]
    assert launched == [(list(bg.TARGETS), 1, 5.0)]
    bg.stop(config)
    assert launched[-1] == "stopped" and bg.started(config) is None


def test_a_started_compile_is_killed_with_its_workers(tmp_path: Path) -> None:
    handle = bg.BackgroundCompile(["sm80"], 1, 60.0, folder=tmp_path)
    assert handle.running
    handle.stop()
    assert not handle.running
    with pytest.raises(ProcessLookupError):
        os.killpg(handle.pid, 0)  # the group (child and any worker) is gone
    assert (tmp_path / "exit").read_text() == str(-signal.SIGKILL)  # what a waiter elsewhere reads
    with pytest.raises(RuntimeError, match="exited -9"):
        bg.wait_report(tmp_path, 60.0)


def test_xdist_controller_starts_the_compile_once_for_a_report_test(monkeypatch) -> None:
    launched = []

    class Fake:
        def __init__(self, targets, jobs, timeout, folder) -> None:
            launched.append(folder)

        def stop(self) -> None:
            launched.append("stopped")

    monkeypatch.setattr(bg, "BackgroundCompile", Fake)
    config = Config()
    folder = bg.controller_folder(config)
    assert bg.controller_folder(config) == folder and Path(folder).is_dir()  # one folder for every worker
    bg.controller_collected(config, ["tests/server/test_api.py::test_a"])
    assert bg.started(config) is None and not launched
    ids = ["tests/server/test_api.py::test_a", bg.REPORT_MODULE + "test_kernels_compile[sm80]"]
    bg.controller_collected(config, ids)
    bg.controller_collected(config, ids)  # the second worker's collection: still one compile
    assert launched == [Path(folder)]
    bg.stop(config)
    assert launched[-1] == "stopped" and not Path(folder).exists()


def test_xdist_worker_waits_for_the_controllers_report(tmp_path: Path) -> None:
    config = Config()
    config.workerinput = {bg.WORKER_KEY: str(tmp_path)}
    items = [item("compile", True), item("a", False)]
    bg.schedule(config, items, timeout=60.0)
    assert [i.name for i in items] == ["a", "compile"]
    handle = bg.started(config)
    with pytest.raises(RuntimeError, match="started no compile"):
        handle.result()  # a controller that never started one: said at once, no wait
    (tmp_path / "started").write_text(repr(time.time()))
    (tmp_path / "log.txt").write_text("compiling\nboom\n")
    (tmp_path / "exit").write_text("1")
    with pytest.raises(RuntimeError, match="exited 1:\ncompiling\nboom"):
        handle.result()
    (tmp_path / "report.json").write_text('{"missing": {}}')
    (tmp_path / "exit").write_text("0")
    assert handle.result() == {"missing": {}}
    bg.stop(config)  # the worker owns nothing: the folder stays the controller's
    assert (tmp_path / "report.json").exists()


def test_a_waiter_gives_up_at_the_timeout(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "started").write_text(repr(time.time() - 100))  # started 100 s ago
    monkeypatch.setattr(bg, "POLL_S", 0.01)
    with pytest.raises(TimeoutError, match="still running after 50 s"):
        bg.wait_report(tmp_path, 50.0)


def _gone(pid: int) -> bool:
    """No process pid, or a zombie (dead, waiting for whoever reaps orphans here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_helpers_die_with_a_parent_killed_by_a_signal(tmp_path: Path) -> None:
    """A parent SIGKILLed (no hook of its runs: pytest killed by a CI timeout) takes its
    die_with_parent child along, as compile_background's child and gpu_compile's workers are."""
    pid_file = tmp_path / "child"
    child = ("import time; from tests.engine.kernels.parent_death import die_with_parent; "
             f"armed = die_with_parent(); open({str(pid_file)!r} + '.armed', 'w').write(str(armed)); time.sleep(120)")
    parent = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    env = dict(os.environ, PYTHONPATH=str(bg.REPO))
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=bg.REPO, env=env)
    pid = 0
    try:
        deadline = time.monotonic() + 60
        armed = Path(f"{pid_file}.armed")
        while not all(f.exists() and f.read_text() for f in (pid_file, armed)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert armed.read_text() == "True"
        assert not _gone(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
    finally:
        proc.kill()
        proc.wait()
        if pid and not _gone(pid):
            os.kill(pid, signal.SIGKILL)
