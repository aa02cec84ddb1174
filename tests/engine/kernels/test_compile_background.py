"""compile_background: the report's tests go last, the compiles start once, and nothing outlives
the session (the compile itself is test_gpu_compile.py's)."""

from __future__ import annotations

import os
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
