"""Find the line that says why a child failed, among its last output lines.

A crashed server's last lines are usually shutdown noise (uvicorn's "Waiting for application
shutdown", "Finished server process"); the reason came earlier: `homelab-llm serve: error: ...`,
a Python exception line closing a traceback, or a `fatal:`/`ERROR` log line. The toast and the
service bar show that line; the Logs screen keeps everything.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Our CLI's one-line errors and other programs' explicit ones, strongest first.
_CLI_ERROR = re.compile(r"(^|\s)error:\s*\S", re.IGNORECASE)
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure))(:|$)")
_LOGGED = re.compile(r"^\s*(\[?(fatal|error|critical)\]?[:\s])|\b(ERROR|CRITICAL|FATAL)\b")
_NOISE = ("waiting for application shutdown", "application shutdown complete",
          "finished server process", "shutting down", "stopping", "[homelab-llm]")


def _is_noise(line: str) -> bool:
    lower = line.lower()
    return not line.strip() or any(word in lower for word in _NOISE)


def this_run(lines: Sequence[str]) -> list[str]:
    """The lines since the last start (the manager logs `$ argv` before each launch)."""
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    return list(lines[starts[-1] + 1:] if starts else lines)


def first_error_line(lines: Sequence[str]) -> str:
    """The most telling error line, or the last non-noise line, or "" for no output at all."""
    candidates = [line.strip() for line in lines if not _is_noise(line)]
    for pattern in (_CLI_ERROR, _EXCEPTION, _LOGGED):
        # The first hit: later errors tend to be fallout of the first one.
        hit = next((line for line in candidates if pattern.search(line)), None)
        if hit is not None:
            return hit
    return candidates[-1] if candidates else ""
