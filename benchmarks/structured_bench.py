"""Throughput of grammar-constrained decoding against free decoding, in the same engine and run.

    python3 benchmarks/structured_bench.py [--quick] [--model PATH] [--device auto|cpu|cuda]

Three phases on one LLMEngine (offline, no HTTP): 8 free streams, 8 constrained streams (a JSON
schema that cannot finish within max_tokens, so every stream decodes the same number of tokens),
then 8 + 8 mixed in one batch. Prints decode tokens/s per phase and the constrained/free ratio
(target >= 0.80). Default model: the embedded SmolLM2-135M (runs on a CPU); on a GPU pass a real
checkpoint to see the mask cost against a realistic step time and a 150K+ vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "object", "required": ["readings"], "additionalProperties": False,
          "properties": {"readings": {"type": "array", "minItems": 500,
                                      "items": {"type": "object", "required": ["t", "ok"],
                                                "additionalProperties": False, "properties": {
                                                    "t": {"type": "integer"},
                                                    "ok": {"type": "boolean"}}}}}}


def run_phase(engine, prompts: list[list[int]], params: list, tag: str) -> tuple[int, float]:
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}-{i}", ids, p)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens per stream")
    parser.add_argument("--model", default="")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()

    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine
    from homelab_llm.engine.sampling_params import SamplingParams
    from homelab_llm.engine.structured.grammar import GrammarSpec, to_grammar
    from homelab_llm.engine.structured.matcher import compile_grammar

    model = args.model
    if not model:
        from homelab_llm.assets import default_model_path

        model = str(default_model_path())
    engine = LLMEngine(EngineArgs(model=model, device=args.device, max_model_len=2048,
                                  kv_cache_memory_bytes=256 << 20 if args.device == "cpu" else None,
                                  max_num_seqs=4 * args.streams))
    tok = engine.tokenizer
    max_tokens = 16 if args.quick else 128
    t0 = time.perf_counter()
    grammar = to_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    compile_grammar(tok, grammar)
    print(f"grammar compile (incl. tokenizer setup, once per model): {time.perf_counter() - t0:.2f} s")
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Log sensor readings as JSON, series {i}."}]))
        for i in range(args.streams)]

    def params(constrained: bool, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed, ignore_eos=not constrained,
                              grammar=grammar if constrained else None)

    run_phase(engine, prompts[:2], [params(True, 0), params(False, 0)], "warm")
    rows = []
    free = run_phase(engine, prompts, [params(False, i) for i in range(args.streams)], "free")
    rows.append(("free", args.streams, *free))
    cons = run_phase(engine, prompts, [params(True, i) for i in range(args.streams)], "json")
    rows.append(("constrained", args.streams, *cons))
    mixed = run_phase(engine, prompts + prompts,
                      [params(i % 2 == 0, i) for i in range(2 * args.streams)], "mixed")
    rows.append(("mixed", 2 * args.streams, *mixed))
    print(f"{'phase':12s} {'streams':>7s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>8s}")
    for name, n, tokens, secs in rows:
        print(f"{name:12s} {n:7d} {tokens:7d} {secs:8.2f} {tokens / secs:8.1f}")
    ratio = (cons[0] / cons[1]) / (free[0] / free[1])
    print(f"constrained / free throughput: {ratio:.2f} (target >= 0.80)")
    engine.shutdown()


if __name__ == "__main__":
    main()
