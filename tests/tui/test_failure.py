"""The line that says why a child failed is found among shutdown noise."""

from __future__ import annotations

import pytest

from homelab_llm.tui.failure import first_error_line, this_run

UVICORN_TAIL = ["INFO:     Shutting down", "INFO:     Waiting for application shutdown.",
                "INFO:     Application shutdown complete.", "INFO:     Finished server process [7]"]


@pytest.mark.parametrize("lines,reason", [
    (["loading", "homelab-llm serve: error: --device cuda: no CUDA/HIP device is visible",
      *UVICORN_TAIL], "homelab-llm serve: error: --device cuda: no CUDA/HIP device is visible"),
    (["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
      "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", *UVICORN_TAIL],
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (["llama_model_load: loading", "ERROR failed to open model.gguf", "ERROR later fallout"],
     "ERROR failed to open model.gguf"),
    (["just a line", *UVICORN_TAIL], "just a line"),
    (UVICORN_TAIL, ""),
    ([], ""),
])
def test_first_error_line(lines: list[str], reason: str) -> None:
    assert first_error_line(lines) == reason


def test_this_run_starts_after_the_last_launch() -> None:
    assert this_run(["$ a", "error: old", "$ b", "ok"]) == ["ok"]
    assert this_run(["no launch line"]) == ["no launch line"]


async def test_logs_wrap_long_lines_and_filter() -> None:
    from textual.widgets import Input, RichLog

    from test_app import make_app

    app = make_app(start_mode="logs")
    reason = "homelab-llm serve: error: " + "a very long explanation " * 12 + "END"
    app.service.logs.extend(["INFO starting", reason, "INFO Waiting for application shutdown."])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.1)
        log = app.screen.query_one(RichLog)
        text = " ".join(strip.text.strip() for strip in log.lines)
        assert "END" in text and len(log.lines) > 3  # wrapped, not cut at the pane edge
        await pilot.press("slash", *"ERROR")
        await pilot.pause(0.1)
        assert app.screen.query_one("#log-filter", Input).value == "ERROR"
        text = " ".join(strip.text.strip() for strip in log.lines)
        assert "END" in text and "starting" not in text and "Waiting" not in text
        app.screen.append("INFO unrelated")
        app.screen.append("fatal: error again")
        await pilot.pause(0.05)
        text = " ".join(strip.text.strip() for strip in log.lines)
        assert "unrelated" not in text and "error again" in text
        await pilot.press("escape")
        await pilot.pause(0.05)
        assert "starting" in " ".join(strip.text for strip in log.lines)
