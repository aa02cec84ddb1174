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
        def __init__(self, targets, jobs, timeout) -> None:
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


def test_a_started_compile_is_killed_with_its_workers() -> None:
    handle = bg.BackgroundCompile(["sm80"], 1, 60.0)
    assert handle.running
    handle.stop()
    assert not handle.running
    with pytest.raises(ProcessLookupError):
        os.killpg(handle.pid, 0)  # the group (child and any worker) is gone


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
