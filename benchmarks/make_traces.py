"""Regenerate assets/traces/*.jsonl: the synthetic agent sessions `homelab-llm bench replay` plays.

    python benchmarks/make_traces.py           # write the files
    python benchmarks/make_traces.py --check   # exit 1 if a shipped file differs

A trace stores turn sizes in words; the text comes from a seeded generator at replay time
(homelab_llm.bench.replay). Our word list runs ~1.08 tokens per word on Llama/SmolLM2/Qwen
tokenizers, so word targets are token targets / 1.08.

agent-120k: a coding agent's session. A ~6K-token system prompt (instructions and tool schemas),
then 16 turns; each turn's user message is tool output (file reads, grep hits, test logs: big and
uneven) and each reply is a short plan or edit, so the context grows to ~120K tokens, the size our
users run at. agent-cpu: the same shape at ~1.5K tokens, for CPU runs and CI.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from homelab_llm.bench.replay import Trace, TurnSpec  # noqa: E402

TOKENS_PER_WORD = 1.08


def agent_session(name: str, description: str, seed: int, total_tokens: int, system_tokens: int,
                  turns: int, reply_words: tuple[int, int], max_tokens: int) -> Trace:
    rng = random.Random(seed)
    replies = [rng.randint(*reply_words) for _ in range(turns)]
    # Tool outputs: uneven (a log is 5x a grep), drawn as weights, then scaled to the target.
    weights = [rng.choice((1, 1, 2, 3, 5)) * rng.uniform(0.6, 1.4) for _ in range(turns)]
    system_words = round(system_tokens / TOKENS_PER_WORD)
    # The last turn's request holds every user message and every reply except the last.
    budget = round(total_tokens / TOKENS_PER_WORD) - system_words - sum(replies[:-1])
    users = [max(1, round(budget * w / sum(weights))) for w in weights]
    specs = tuple(TurnSpec(u, a, max_tokens) for u, a in zip(users, replies))
    return Trace(name, description, seed, system_words, specs)


TRACES = [
    agent_session("agent-120k", "Synthetic coding-agent session: ~6K-token system prompt, 16 turns "
                  "of tool output and short replies, growing to ~120K tokens.",
                  seed=120, total_tokens=120_000, system_tokens=6_000, turns=16,
                  reply_words=(120, 600), max_tokens=256),
    agent_session("agent-cpu", "Small synthetic agent session for CPU runs: 6 turns growing to "
                  "~1.5K tokens.", seed=15, total_tokens=1_500, system_tokens=300, turns=6,
                  reply_words=(20, 60), max_tokens=16),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "traces")
    args = parser.parse_args(argv)
    stale = []
    for trace in TRACES:
        path = args.out / f"{trace.name}.jsonl"
        text = trace.dumps()
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path} ({len(trace.turns)} turns)")
    if stale:
        print(f"stale: {', '.join(stale)}; run python benchmarks/make_traces.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
