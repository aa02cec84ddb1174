"""Structured-output grammars compiled off the engine process's step loop.

The server compiles a request's grammar in its prepare thread (server/structured.py), but that
cache lives in the server's process. In the engine process `add_request` would compile it again,
on the step loop: milliseconds per new grammar, and seconds for the first one of a large
vocabulary (the tokenizer's llguidance view), stalling every stream. So an add that carries a
grammar is held here while a helper thread compiles it into the engine process's cache
(engine/structured/matcher.py, keyed by tokenizer and grammar text); the add is then released to
the loop, where `GrammarState.start` is a lookup.

Invariants: held adds are released in arrival order among themselves; an abort of a held add
drops it (`on_drop` answers its caller), so no request outlives its abort; a compile error is not
ours to report: the add is released and `add_request` raises it to the caller as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from homelab_llm.server.step_loop import Abort, Add, Command

log = logging.getLogger("homelab_llm.server")

POLL_S = 0.005  # while compiles are pending, the loop looks for finished ones this often


def compile_into_cache(tokenizer: Any, grammar: str) -> None:
    from homelab_llm.engine.structured.matcher import compile_grammar

    try:
        compile_grammar(tokenizer, grammar)
    except Exception:  # noqa: BLE001 - add_request reports it to the request's caller
        log.debug("grammar compile failed (reported by add_request)", exc_info=True)


class GrammarPrefetch:
    def __init__(self, tokenizer: Any, on_drop: Callable[[Add], None],
                 compile_fn: Callable[[Any, str], None] = compile_into_cache) -> None:
        self.tokenizer = tokenizer
        self.on_drop = on_drop
        self.compile_fn = compile_fn
        self.held: dict[str, tuple[Add, Future]] = {}  # request id -> the add, its compile
        self.pool: ThreadPoolExecutor | None = None

    @property
    def pending(self) -> bool:
        return bool(self.held)

    def filter(self, item: Command) -> Command | None:
        """The command to apply now, or None if it is held (an add being compiled for) or
        consumed (an abort of a held add)."""
        if isinstance(item, Add) and item.params.grammar is not None and self.tokenizer is not None:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            self.held[item.request_id] = (item, self.pool.submit(
                self.compile_fn, self.tokenizer, item.params.grammar))
            return None
        if isinstance(item, Abort) and item.request_id in self.held:
            add, _ = self.held.pop(item.request_id)  # never reached the engine: nothing to free
            self.on_drop(add)
            return None
        return item

    def ready(self) -> list[Add]:
        """Held adds whose grammar is compiled, in arrival order (up to the first still busy)."""
        released: list[Add] = []
        for request_id, (add, future) in list(self.held.items()):
            if not future.done():
                break
            del self.held[request_id]
            released.append(add)
        return released

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
