"""Stop strings on streamed text, one rule for both places that apply it: the engine's output
processor (offline, and the server's in-thread engine) and the server's detokenizer when the
engine runs in its own process (server/detokenize.py).

A stop string is matched on the decoded text and cut from it (kept with include_stop_str_in_output).
Text that could still be the start of a stop string is held back until it cannot be, so a client
never sees the head of a stop string that later completes."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], emitted: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends past `emitted` (what was already handed out
    cannot hold a whole stop string: it was held back), as (index, stop string)."""
    search_from = max(0, emitted - max(len(s) for s in stops))
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        idx = text.find(s, search_from)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def cut_at_stop(text: str, idx: int, stop: str, include: bool) -> str:
    return text[: idx + len(stop)] if include else text[:idx]


def releasable_end(text_len: int, emitted: int, stops: Sequence[str], finished: bool) -> int:
    """How far the text may be handed out now: all of it once finished, else all but what may
    still grow into a stop string."""
    if finished or not stops:
        return text_len
    return max(emitted, text_len - (max(len(s) for s in stops) - 1))
