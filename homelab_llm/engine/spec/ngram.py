"""N-gram (prompt lookup) drafts: continue the longest recent repeat of the sequence's own tail.

For a sequence t[0..L-1] (prompt + output) the proposer looks for an earlier occurrence of its
last n tokens, n from prompt_lookup_max down to prompt_lookup_min, and drafts the (up to) K tokens
that followed it. Among equally long matches the latest one with K tokens after it wins (an agent
re-reading the newest version of a file), else the earliest (the most tokens to copy).

Per request, on the host, in numpy: a token buffer per request grows by the new tokens only, the
candidates are the positions equal to the last token (one vectorised compare over the buffer),
and their match lengths are extended with at most prompt_lookup_max vectorised compares. The
proposer never sees a placeholder token (async scheduling is off while speculating).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class _TokenBuffer:
    data: np.ndarray = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    length: int = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The buffer holding exactly token_ids (tokens only ever get appended to a sequence)."""
        n = len(token_ids)
        if n < self.length:  # never expected; rebuild rather than trust a stale buffer
            self.length = 0
        if n > self.data.shape[0]:
            grown = np.empty(max(n, 2 * self.data.shape[0]), dtype=np.int64)
            grown[:self.length] = self.data[:self.length]
            self.data = grown
        if n > self.length:
            self.data[self.length:n] = token_ids[self.length:n]
            self.length = n
        return self.data[:n]


def find_draft(tokens: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """The draft for `tokens` (1-D int array): up to k tokens, [] without a match >= min_n."""
    length = tokens.shape[0]
    if k < 1 or length < min_n + 1:
        return []
    # Candidate match ends p < L-1 with t[p] == t[L-1]; the token after p exists.
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        if back >= length:
            break
        idx = ends - back
        ok = alive & (idx >= 0)
        ok[ok] = tokens[idx[ok]] == tokens[length - 1 - back]
        matched += ok
        alive = ok
        if not alive.any():
            break
    best = int(matched.max())
    if best < min_n:
        return []
    top = ends[matched == best]
    full = top[top + k <= length - 1]
    start = int(full[-1] if full.size else top[0]) + 1
    return tokens[start:start + k].tolist()


class NgramProposer:
    """Drafts for decoding sequences, keyed by request id; `forget` a request when it ends."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to min(k, K) draft tokens continuing token_ids."""
        buf = self._buffers.get(request_id)
        if buf is None:
            buf = self._buffers[request_id] = _TokenBuffer()
        return find_draft(buf.sync(token_ids), min(k, self.k), self.max_n, self.min_n)

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)
