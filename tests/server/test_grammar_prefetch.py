"""Adds with a grammar wait off the engine process's step loop until it is compiled."""

from __future__ import annotations

import threading

from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.server.grammar_prefetch import GrammarPrefetch
from homelab_llm.server.step_loop import Abort, Add, Call


def add(rid: str, grammar: str | None = None) -> Add:
    params = SamplingParams(max_tokens=4)
    params.grammar = grammar
    return Add(rid, [1, 2], params, ticket=rid)


class Gate:
    """A compile that finishes when the test says so."""

    def __init__(self) -> None:
        self.open: dict[str, threading.Event] = {}
        self.seen: list[tuple[object, str]] = []

    def __call__(self, tokenizer: object, grammar: str) -> None:
        self.seen.append((tokenizer, grammar))
        self.open.setdefault(grammar, threading.Event()).wait(10)

    def release(self, grammar: str) -> None:
        self.open.setdefault(grammar, threading.Event()).set()


def wait_ready(prefetch: GrammarPrefetch, count: int) -> list[Add]:
    out: list[Add] = []
    for _ in range(2000):
        out += prefetch.ready()
        if len(out) >= count:
            return out
        threading.Event().wait(0.005)
    raise AssertionError(f"only {len(out)} of {count} released")


def test_grammar_adds_wait_for_their_compile_and_leave_in_arrival_order() -> None:
    gate, dropped = Gate(), []
    prefetch = GrammarPrefetch("tok", dropped.append, compile_fn=gate)
    plain, call = add("plain"), Call(len, ticket="c")
    assert prefetch.filter(add("a", "G1")) is None and prefetch.filter(add("b", "G2")) is None
    assert prefetch.filter(plain) is plain and prefetch.filter(call) is call  # no grammar: now
    gate.release("G2")
    assert prefetch.ready() == [] and prefetch.pending  # "a" is first and still compiling
    gate.release("G1")
    assert [a.request_id for a in wait_ready(prefetch, 2)] == ["a", "b"]
    assert not prefetch.pending and gate.seen == [("tok", "G1"), ("tok", "G2")]
    assert dropped == []
    prefetch.close()


def test_an_abort_of_a_held_add_drops_it_and_answers_its_caller() -> None:
    gate, dropped = Gate(), []
    prefetch = GrammarPrefetch("tok", dropped.append, compile_fn=gate)
    held = add("a", "G")
    assert prefetch.filter(held) is None
    assert prefetch.filter(Abort("a")) is None  # consumed: the engine never had it
    assert dropped == [held] and not prefetch.pending
    other = Abort("b")
    assert prefetch.filter(other) is other  # not held: the engine frees it
    gate.release("G")
    prefetch.close()


def test_no_tokenizer_means_nothing_to_compile_here() -> None:
    prefetch = GrammarPrefetch(None, lambda a: None, compile_fn=lambda t, g: None)
    item = add("a", "G")
    assert prefetch.filter(item) is item
