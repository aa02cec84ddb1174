"""A helper both stream parsers share: text deltas arrive in arbitrary pieces, so a tag such as
`</think>` may be split across deltas. We emit what cannot be the start of the tag and hold back
the rest until the next delta decides."""

from __future__ import annotations


def split_holdback(buffer: str, tag: str) -> tuple[str, str]:
    """(safe to emit, held back): the held part is the longest suffix of `buffer` that is a
    proper prefix of `tag`."""
    for keep in range(min(len(tag) - 1, len(buffer)), 0, -1):
        if tag.startswith(buffer[-keep:]):
            return buffer[:-keep], buffer[-keep:]
    return buffer, ""
