"""Measure the two grammar engines on this CPU: compile time for typical schemas and the per-token
mask cost at a large byte-level vocabulary (the numbers in docs/STRUCTURED_OUTPUTS.md).

    python3 benchmarks/grammar_engines.py [--vocab 200000] [--steps 200]

The vocabulary is synthetic: 256 single bytes plus random 2-12 byte pieces of ASCII letters,
digits, punctuation and spaces (what BPE merges look like), so both engines see the same tokens.
xgrammar is optional (it imports transformers and tvm-ffi); it is skipped when absent.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
            "required": ["name", "role", "tags"]},
        "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
        "ok": {"type": "boolean"}}, "required": ["user", "scores", "ok"]},
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city"]}},
        "required": ["name", "arguments"]},
}
SAMPLE = {"flat": '{"name": "Ada Lovelace", "age": 36}',
          "nested": '{"user": {"name": "bo", "role": "admin", "tags": ["a", "bb"]}, '
                    '"scores": [1, 22, 333], "ok": true}',
          "tool_call": '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'}


def make_vocab(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " " * 8 + '{}[]":,.-_'
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    while len(vocab) < size - 1:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 12))).encode()
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    vocab.append(b"<|eos|>")
    return vocab


def greedy_ids(vocab: list[bytes], text: str) -> list[int]:
    return list(text.encode())  # single-byte tokens: valid for both engines, and the most steps


def bench_llguidance(vocab: list[bytes], steps: int) -> dict[str, float]:
    import llguidance
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    class _Tok:
        eos_token_id, bos_token_id = len(vocab) - 1, None
        tokens = vocab
        special_token_ids = [len(vocab) - 1]

        def __call__(self, s):
            return greedy_ids(vocab, s if isinstance(s, str) else s.decode())

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tok()))
    out = {"tokenizer_s": time.perf_counter() - t0}
    mask = allocate_token_bitmask(1, len(vocab))
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(tok, grammar)
        out[f"compile_{name}_ms"] = (time.perf_counter() - t0) * 1e3
        times = []
        for token in greedy_ids(vocab, SAMPLE[name])[:steps]:
            t0 = time.perf_counter()
            fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - t0)
            assert matcher.consume_token(token), matcher.get_error()
        out[f"mask_{name}_us"] = statistics.median(times) * 1e6
    return out


def bench_xgrammar(vocab: list[bytes], steps: int) -> dict[str, float] | None:
    try:
        t0 = time.perf_counter()
        import xgrammar as xgr
    except ImportError:
        return None
    out = {"import_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[len(vocab) - 1])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out["tokenizer_s"] = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, len(vocab))
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        matcher = xgr.GrammarMatcher(compiled)
        out[f"compile_{name}_ms"] = (time.perf_counter() - t0) * 1e3
        times = []
        for token in greedy_ids(vocab, SAMPLE[name])[:steps]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(token)
        out[f"mask_{name}_us"] = statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    vocab = make_vocab(args.vocab)
    rows = {"llguidance": bench_llguidance(vocab, args.steps),
            "xgrammar": bench_xgrammar(vocab, args.steps)}
    keys = sorted({k for r in rows.values() if r for k in r})
    print(f"vocab {len(vocab)}   " + "   ".join(f"{n:>12}" for n in rows))
    for key in keys:
        cells = [f"{r[key]:12.2f}" if r and key in r else f"{'-':>12}" for r in rows.values()]
        print(f"{key:22} " + "   ".join(cells))


if __name__ == "__main__":
    main()
