"""The Bench screen's form as plain data: the text a person typed -> a sweep to run, or the
problems with it, each tied to its field so the screen can mark it in place.

Kept apart from the widgets so the rules are tested without an app, and so the form accepts the
same spellings as `homelab-llm bench` (sizes like 8K, comma-separated lists).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

BenchKind = Literal["depth", "concurrency", "replay"]
KINDS: tuple[BenchKind, ...] = ("depth", "concurrency", "replay")
MAX_POINTS = 64  # a typo like 1,2,...,999 should not queue hours of work


@dataclass(frozen=True)
class FormIssue:
    field: str  # the form field's name: target, pp, tg, points, repetitions, turns
    message: str


@dataclass(frozen=True)
class BenchForm:
    """What the form holds, as typed (strings), so nothing is lost before validation."""

    kind: str = "depth"
    target: str = ""  # empty: the running service
    pp: str = "512"
    tg: str = "64"
    points: str = "0,2K,4K"  # depths (depth sweep) or concurrency levels (concurrency sweep)
    depth: str = "0"  # the one context depth of a concurrency sweep
    repetitions: str = "3"
    trace: str = "agent-cpu"
    turns: str = ""  # replay: first N turns (empty: all)


@dataclass(frozen=True)
class BenchSpec:
    """A validated sweep: everything the runner needs, nothing it must parse."""

    kind: BenchKind
    target: str
    pp: int = 512
    tg: int = 64
    points: tuple[int, ...] = (0,)
    depth: int = 0
    repetitions: int = 3
    trace: str = "agent-cpu"
    max_turns: int | None = None
    api_key: str | None = field(default=None, repr=False)

    @property
    def total_units(self) -> int:
        """Progress units as the bench room counts them (a repetition of a point, or a turn)."""
        return len(self.points) * self.repetitions


def parse_size(text: str) -> int:
    """'4096' or '4K' (x1024) -> int; ValueError with a message fit for the user."""
    raw = text.strip().replace("_", "")
    scale = 1024 if raw[-1:] in ("k", "K") else 1
    number = raw[:-1] if scale > 1 else raw
    try:
        return int(number) * scale
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a whole number (sizes like 4096 or 4K)") from None


def parse_sizes(text: str) -> tuple[int, ...]:
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise ValueError("give at least one number, e.g. 0,4K,8K")
    return tuple(parse_size(p) for p in parts)


def _int(issues: list[FormIssue], name: str, text: str, minimum: int, why: str = "") -> int:
    try:
        value = parse_size(text)
    except ValueError as err:
        issues.append(FormIssue(name, str(err)))
        return minimum
    if value < minimum:
        issues.append(FormIssue(name, f"must be at least {minimum}{why}, got {value}"))
    return value


def validate(form: BenchForm, default_target: str | None, api_key: str | None = None,
             max_model_len: int | None = None) -> tuple[BenchSpec | None, list[FormIssue]]:
    """(spec, []) when the form can run; (None, issues) otherwise. `default_target` is the running
    service's URL (None when nothing runs), used when the target field is empty; max_model_len is
    that server's context limit (None: unknown), checked before a request is sent."""
    issues: list[FormIssue] = []
    if form.kind not in KINDS:
        issues.append(FormIssue("kind", f"unknown kind {form.kind!r}; use {', '.join(KINDS)}"))
    target = form.target.strip() or (default_target or "")
    if not target:
        issues.append(FormIssue("target", "no running service: start a preset (s) or enter a URL"))
    elif not target.startswith(("http://", "https://")):
        issues.append(FormIssue("target", f"must start with http:// or https://, got {target!r}"))
    if form.kind == "replay":
        turns = None
        if form.turns.strip():
            turns = _int(issues, "turns", form.turns, 1)
        if not form.trace.strip():
            issues.append(FormIssue("trace", "pick a trace"))
        spec = BenchSpec("replay", target, points=(), repetitions=1, trace=form.trace.strip(),
                         max_turns=turns, api_key=api_key)
        return (None if issues else spec), issues
    pp = _int(issues, "pp", form.pp, 1)
    tg = _int(issues, "tg", form.tg, 2, " (decode speed needs two tokens)")
    repetitions = _int(issues, "repetitions", form.repetitions, 1)
    depth = 0
    if form.kind == "concurrency":
        depth = _int(issues, "depth", form.depth, 0)
    try:
        points = parse_sizes(form.points)
    except ValueError as err:
        issues.append(FormIssue("points", str(err)))
        points = ()
    floor = 1 if form.kind == "concurrency" else 0
    if any(p < floor for p in points):
        what = "concurrency levels" if floor else "depths"
        issues.append(FormIssue("points", f"{what} must be >= {floor}, got {list(points)}"))
    if len(points) > MAX_POINTS:
        issues.append(FormIssue("points", f"{len(points)} points: at most {MAX_POINTS} per sweep"))
    kind: BenchKind = "concurrency" if form.kind == "concurrency" else "depth"
    if max_model_len and not issues:
        _check_context(issues, kind, pp, tg, depth, points, max_model_len)
    spec = BenchSpec(kind, target, pp, tg, points, depth, repetitions, api_key=api_key)
    return (None if issues else spec), issues


def _check_context(issues: list[FormIssue], kind: BenchKind, pp: int, tg: int, depth: int,
                   points: tuple[int, ...], max_model_len: int) -> None:
    """Every request holds depth + pp prompt tokens and tg generated ones; the server refuses
    more than max_model_len with a 400, so say it here, naming the field to shrink."""
    depths = points if kind == "depth" else (depth,)
    worst = max(depths, default=0)
    need = worst + pp + tg
    if need <= max_model_len:
        return
    room = max_model_len - pp - tg
    if kind == "depth" and room >= 0:
        issues.append(FormIssue("points", f"depth {worst} + pp {pp} + tg {tg} = {need} tokens is "
                                          f"over the server's max_model_len {max_model_len}; "
                                          f"use depths up to {room}"))
    elif kind == "concurrency" and room >= 0:
        issues.append(FormIssue("depth", f"depth {worst} + pp {pp} + tg {tg} = {need} tokens is "
                                         f"over the server's max_model_len {max_model_len}; "
                                         f"use a depth up to {room}"))
    else:
        issues.append(FormIssue("pp", f"pp {pp} + tg {tg} is over the server's max_model_len "
                                      f"{max_model_len}; lower pp or tg"))
