"""`bench replay`: replay a multi-turn agent session and time every turn.

A trace (assets/traces/*.jsonl) stores turn *specs*, not text: line 1 is the session header
{"type": "session", "name", "description", "seed", "system_words"}, then one line per turn
{"type": "turn", "user_words", "assistant_words", "max_tokens"}. The text is regenerated
deterministically from the seed (prompts.synth_text), so a 120K-token session ships as a few
hundred bytes and is byte-identical on every engine. The history grows like an agent's: each turn
appends a user message (tool output, instructions) and, after the request, the trace's own
assistant message (not the model's reply), so every engine sees the same prefixes and the prefix
cache is what is being measured.

Per turn: prompt tokens, cached tokens (usage.prompt_tokens_details.cached_tokens), new tokens,
TTFT, TG tok/s. Summary: mean, median, CV and worst turn of TTFT and TG tok/s.

API: `await run_replay(client, load_trace("agent-120k"), report=report, on_progress=cb)`;
`report.turns` holds the finished turns if the task is cancelled.
"""

from __future__ import annotations

import datetime as _dt
import json
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from homelab_llm.assets import assets_dir
from homelab_llm.bench.client import BenchClient, BenchError, Message
from homelab_llm.bench.metrics import Stat, cv, median
from homelab_llm.bench.prompts import synth_text
from homelab_llm.bench.sweep import ProgressCallback, ProgressEvent


@dataclass(frozen=True)
class TurnSpec:
    user_words: int
    assistant_words: int
    max_tokens: int


@dataclass(frozen=True)
class Trace:
    name: str
    description: str
    seed: int
    system_words: int
    turns: tuple[TurnSpec, ...]

    def system_text(self, salt: str = "") -> str:
        # The salt leads the system prompt so a second replay does not hit the first one's cache.
        head = f"Session {salt}. " if salt else ""
        return head + synth_text(self.system_words, self.seed)

    def user_text(self, turn: int) -> str:
        return synth_text(self.turns[turn].user_words, self.seed * 1000 + 2 * turn + 1)

    def assistant_text(self, turn: int) -> str:
        return synth_text(self.turns[turn].assistant_words, self.seed * 1000 + 2 * turn + 2)

    def messages(self, turn: int, salt: str = "") -> list[Message]:
        """The request of turn `turn` (0-based): the whole history, then the new user message."""
        msgs = [{"role": "system", "content": self.system_text(salt)}]
        for j in range(turn):
            msgs += [{"role": "user", "content": self.user_text(j)},
                     {"role": "assistant", "content": self.assistant_text(j)}]
        msgs.append({"role": "user", "content": self.user_text(turn)})
        return msgs

    def dumps(self) -> str:
        head = {"type": "session", "name": self.name, "description": self.description,
                "seed": self.seed, "system_words": self.system_words}
        lines = [json.dumps(head)] + [json.dumps({"type": "turn", **asdict(t)}) for t in self.turns]
        return "\n".join(lines) + "\n"

    @classmethod
    def loads(cls, text: str, origin: str = "trace") -> "Trace":
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            head, turns = rows[0], rows[1:]
            if head.get("type") != "session" or not turns:
                raise ValueError("the first line must be a session header, then turn lines")
            return cls(name=head["name"], description=head.get("description", ""),
                       seed=int(head["seed"]), system_words=int(head["system_words"]),
                       turns=tuple(TurnSpec(int(t["user_words"]), int(t["assistant_words"]),
                                            int(t["max_tokens"])) for t in turns))
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise BenchError(f"{origin} is not a valid trace: {err}") from err


def traces_dir() -> Path:
    return assets_dir() / "traces"


def list_traces() -> list[str]:
    return sorted(p.stem for p in traces_dir().glob("*.jsonl"))


def load_trace(name_or_path: str) -> Trace:
    """A shipped trace by name ("agent-120k", "agent-cpu") or a .jsonl path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = traces_dir() / f"{name_or_path}.jsonl"
    if not path.is_file():
        raise BenchError(f"no trace {name_or_path!r}: give a .jsonl path or one of "
                         f"{', '.join(list_traces()) or '(none shipped)'}")
    return Trace.loads(path.read_text(), str(path))


@dataclass
class TurnResult:
    turn: int  # 1-based, as users count
    prompt_tokens: int | None
    cached_tokens: int | None
    new_tokens: int | None
    output_tokens: int
    ttft_s: float | None
    tg_tps: float | None
    e2el_s: float | None
    error: str | None = None


@dataclass
class ReplayReport:
    trace: str
    model: str
    target: str
    salt: str = ""
    turns: list[TurnResult] = field(default_factory=list)
    interrupted: bool = False
    date: str = field(default_factory=lambda: _dt.datetime.now().isoformat(timespec="seconds"))

    def summary(self) -> dict[str, object]:
        ok = [t for t in self.turns if t.error is None]
        out: dict[str, object] = {"turns": len(self.turns), "failed": len(self.turns) - len(ok)}
        for name, worst in (("ttft_s", max), ("tg_tps", min)):
            vals = [(getattr(t, name), t.turn) for t in ok if getattr(t, name) is not None]
            xs = [v for v, _ in vals]
            out[name] = {"mean": Stat.of(list(xs)).mean, "median": median(xs), "cv": cv(xs),
                         "worst": worst(vals)[0] if vals else None,
                         "worst_turn": worst(vals)[1] if vals else None}
        return out

    def to_json(self) -> dict[str, object]:
        return {"kind": "replay", "trace": self.trace, "model": self.model, "target": self.target,
                "date": self.date, "salt": self.salt, "interrupted": self.interrupted,
                "summary": self.summary(), "results": [asdict(t) for t in self.turns]}


async def run_replay(client: BenchClient, trace: Trace, *, report: ReplayReport | None = None,
                     salt: str | None = None, ignore_eos: bool = True, max_turns: int | None = None,
                     on_progress: ProgressCallback | None = None) -> ReplayReport:
    """Send the turns one after another (an agent waits for each reply), timing each."""
    model = await client.resolve_model()
    salt = secrets.token_hex(4) if salt is None else salt
    report = report or ReplayReport(trace.name, model, client.root)
    report.model, report.salt = model, salt
    n = len(trace.turns) if max_turns is None else min(max_turns, len(trace.turns))
    for i in range(n):
        if on_progress:
            on_progress(ProgressEvent(i, n, f"{trace.name} turn {i + 1}/{n}"))
        t = await client.stream_chat(trace.messages(i, salt), trace.turns[i].max_tokens,
                                     ignore_eos=ignore_eos)
        new = (t.prompt_tokens - t.cached_tokens
               if t.prompt_tokens is not None and t.cached_tokens is not None else None)
        report.turns.append(TurnResult(
            turn=i + 1, prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
            new_tokens=new, output_tokens=t.output_tokens, ttft_s=t.ttft, tg_tps=t.tg_tps,
            e2el_s=t.e2el, error=None if t.ok else (t.error or "no tokens")))
    if on_progress:
        on_progress(ProgressEvent(n, n, "done"))
    return report
