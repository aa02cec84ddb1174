"""Run one part of a step (the forward, or sampling) so that one request's fault fails that
request only.

The part runs over all its items; if it raises, faults.classify decides: a fatal fault ends the
engine (on_fatal's error is raised); a SequenceFault names its sequence; an out-of-memory error
blames the largest prefill (no prefill: fatal); any other error is pinned down by running each
item alone. The culprits are handed to on_fault (which ends their requests) and the part runs
again without them, so the healthy items get exactly what they would have got alone: sampling is
keyed per request, and a forward rewrites the same KV slots with the same values. What a run
changes in place that a second run would change again (a hybrid model's recurrent states) is
before_retry's to handle: it gets the healthy items before each rerun and returns those to rerun.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from homelab_llm.engine.faults import FaultKind, SequenceFault, classify

T = TypeVar("T")
R = TypeVar("R")


def run_isolated(items: list[T], run: Callable[[list[T]], R],
                 request_id: Callable[[T], str],
                 oom_victim: Callable[[list[T]], T | None],
                 on_fault: Callable[[T, BaseException], None],
                 on_fatal: Callable[[BaseException], BaseException],
                 before_retry: Callable[[list[T]], list[T]] | None = None) -> tuple[list[T], R | None]:
    """(the items that ran, run's result over them); (the empty list, None) if none is left."""
    items = list(items)
    while items:
        try:
            return items, run(items)
        except Exception as exc:  # noqa: BLE001 - classified below; fatal ones re-raised
            culprits = _culprits(items, exc, run, request_id, oom_victim, on_fatal)
        for item, err in culprits:
            on_fault(item, err)
        gone = {id(item) for item, _ in culprits}
        items = [item for item in items if id(item) not in gone]
        if items and before_retry is not None:
            items = before_retry(items)
    return [], None


def _culprits(items: list[T], exc: Exception, run: Callable[[list[T]], R],
              request_id: Callable[[T], str], oom_victim: Callable[[list[T]], T | None],
              on_fatal: Callable[[BaseException], BaseException]) -> list[tuple[T, BaseException]]:
    kind = classify(exc)
    if kind is FaultKind.FATAL:
        raise on_fatal(exc) from exc
    if isinstance(exc, SequenceFault):
        named = [item for item in items if request_id(item) == exc.request_id]
        if named:
            return [(named[0], exc)]
    if kind is FaultKind.OOM:
        victim = oom_victim(items)
        if victim is None:
            raise on_fatal(exc) from exc
        return [(victim, exc)]
    if len(items) == 1:
        return [(items[0], exc)]
    found: list[tuple[T, BaseException]] = []
    for item in items:
        try:
            run([item])
        except Exception as err:  # noqa: BLE001
            if classify(err) is FaultKind.FATAL:
                raise on_fatal(err) from err
            found.append((item, err))
    # Not reproducible one at a time: the items fail together rather than loop forever.
    return found or [(item, exc) for item in items]
