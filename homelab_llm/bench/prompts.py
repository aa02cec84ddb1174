"""Deterministic synthetic text of a wanted token length, and how we count its tokens.

Text is plain English words drawn by a seeded RNG, so a given seed gives the same prompt on every
engine (fair comparisons, reproducible traces), and different seeds share no prefix (cold runs
stay cold). Most of these words are one token in Llama/Qwen/Gemma vocabularies, which makes
sizing converge in a step or two.

Token counting, best first (the report says which was used):
- "server /tokenize": exact, the served tokenizer (vLLM, SGLang, llama.cpp, ours)
- "local tokenizer": `--tokenizer PATH` through our engine's tokenizer loader
- "estimate (1 token/word)": neither available; the server's usage.prompt_tokens still reports
  the true prompt size after each request, and tables use that when present.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

from homelab_llm.bench.client import BenchClient, BenchError

_WORDS = (
    "the of and to in is was that for on with as by at from this be are or an which have not had "
    "one were all their there been has when who will more no if out so said what up its about into "
    "than them can only other new some time could these two may then first any like now my such "
    "make over our even most after also made many before must through back years where much your "
    "way well down should because each just those people how too little state good very world "
    "still own see men work long here get both between life being under never day same another "
    "know while last might great old year off come since against go came right used take three "
    "small large house water place found around every show part number system city point river "
    "light order music table paper group market story field power letter model engine cache "
    "token layer value graph stream batch queue page tree node shard kernel memory bridge signal "
    "north south east west green blue red black white morning evening garden window station "
).split()

TokenCount = Callable[[str], Awaitable[int]]


def synth_text(n_words: int, seed: int) -> str:
    words = random.Random(seed).choices(_WORDS, k=max(0, n_words))
    # Sentences keep tokenizers in their normal regime (no 100K-token run-on line). Their
    # lengths come from a second stream, so more words from one seed extend the same text.
    breaks = random.Random(f"breaks/{seed}")
    out, start = [], 0
    while start < len(words):
        end = start + breaks.randint(8, 20)
        sentence = " ".join(words[start:end])
        out.append(sentence[:1].upper() + sentence[1:] + ".")
        start = end
    return " ".join(out)


class TokenCounter:
    """Counts text tokens with the best source available; `source` names it for the report."""

    def __init__(self, source: str, count: TokenCount) -> None:
        self.source = source
        self._count = count

    async def count(self, text: str) -> int:
        return await self._count(text)

    @classmethod
    def estimate(cls) -> "TokenCounter":
        async def words(text: str) -> int:
            return len(text.split())
        return cls("estimate (1 token/word)", words)

    @classmethod
    def local(cls, tokenizer_path: str) -> "TokenCounter":
        try:
            from homelab_llm.engine.tokenizer import load_tokenizer
        except ImportError as err:
            raise BenchError("--tokenizer needs homelab_llm.engine.tokenizer, which is not "
                             f"available here ({err})") from err
        try:
            tok = load_tokenizer(tokenizer_path, "auto")
        except (OSError, ValueError) as err:
            raise BenchError(f"cannot load a tokenizer from {tokenizer_path}: {err}") from err

        async def encode(text: str) -> int:
            return len(tok.encode(text, add_special_tokens=False))
        return cls("local tokenizer", encode)

    @classmethod
    async def pick(cls, client: BenchClient | None, tokenizer_path: str | None) -> "TokenCounter":
        if client is not None and await client.tokenize("hello world") is not None:
            return cls("server /tokenize", _server_count(client))
        if tokenizer_path:
            return cls.local(tokenizer_path)
        return cls.estimate()


def _server_count(client: BenchClient) -> TokenCount:
    async def count(text: str) -> int:
        n = await client.tokenize(text)
        if n is None:
            raise BenchError(f"{client.root}/tokenize stopped answering")
        return n
    return count


async def text_of_tokens(counter: TokenCounter, n_tokens: int, seed: int,
                         max_rounds: int = 6) -> tuple[str, int]:
    """Text of (as close as possible to) n_tokens tokens, and its counted size.

    Sizes by word count, measures, corrects by the measured tokens-per-word; returns the closest
    try. Exactness is not needed for the rates (those use the measured count), only for labels.
    """
    if n_tokens <= 0:
        return "", 0
    words = n_tokens
    best: tuple[int, str, int] | None = None
    for _ in range(max_rounds):
        text = synth_text(words, seed)
        got = await counter.count(text)
        if best is None or abs(got - n_tokens) < best[0]:
            best = (abs(got - n_tokens), text, got)
        if got == n_tokens:
            break
        step = round((n_tokens - got) * words / max(got, 1))
        words = max(1, words + (step if step else (1 if got < n_tokens else -1)))
    assert best is not None
    return best[1], best[2]
