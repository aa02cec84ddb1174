"""Helpers the stream parsers share: text deltas arrive in arbitrary pieces, so a tag such as
`</think>` may be split across deltas (we emit what cannot be the start of the tag and hold back
the rest until the next delta decides), and a JSON value may arrive in pieces (we find where it
ends before decoding it)."""

from __future__ import annotations


def split_holdback(buffer: str, tag: str) -> tuple[str, str]:
    """(safe to emit, held back): the held part is the longest suffix of `buffer` that is a
    proper prefix of `tag`."""
    for keep in range(min(len(tag) - 1, len(buffer)), 0, -1):
        if tag.startswith(buffer[-keep:]):
            return buffer[:-keep], buffer[-keep:]
    return buffer, ""


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at text[start] ends (the index after its closing
    bracket), or None while it is still open. Brackets inside strings do not count; the value is
    only delimited here, not validated (json.loads does that)."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
