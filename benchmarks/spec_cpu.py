"""N-gram speculative decoding on the CPU: SmolLM2 on a copy-heavy chat, decode tok/s with and
without speculation in the same run (same prompt, greedy, so both produce the same tokens).

    python benchmarks/spec_cpu.py [--quick] [--k 4] [--max-tokens 96] [--dtype float32]

Both engines run the CPU default (4-bit weights on our kernels where they build), or the exact
fp32 path with --dtype float32.

Decode time runs from the first output token to the last; the table shows both runs, the
speed-up, the acceptance rate and the mean accepted length (1 + accepted drafts per verify step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.assets import default_model_path  # noqa: E402
from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402
from homelab_llm.engine.spec.stats import SpecDecodeStats  # noqa: E402

CODE = '''import json
from pathlib import Path


def load_config(path: Path) -> dict:
    """Read a JSON config file and return it as a dict."""
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config needs a name")
    return data


def save_config(path: Path, data: dict) -> None:
    """Write the config back as JSON."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
'''
ASK = "Rename load_config to read_config in this file and print the whole file again, unchanged otherwise:\n\n"


def decode_rate(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(decode tok/s after the first token, the output ids) for one greedy request."""
    engine.add_request("bench", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    first_at, first_n, tokens = 0.0, 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            if not first_n and tokens:
                first_at, first_n = time.perf_counter(), len(tokens)
    elapsed = time.perf_counter() - first_at
    return (len(tokens) - first_n) / elapsed, list(tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default=None, help="float32: the exact path (default: the CPU default)")
    args = ap.parse_args()
    max_tokens = 48 if args.quick else args.max_tokens
    path = str(default_model_path())
    common = dict(model=path, device="cpu", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                  **({"dtype": args.dtype} if args.dtype else {}))
    spec_cfg = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    plain = LLMEngine(EngineArgs(**common))
    tok = plain.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ASK + CODE}],
                                                add_generation_prompt=True))
    spec = LLMEngine(EngineArgs(**common, speculative_config=spec_cfg))
    decode_rate(plain, prompt[:32], 4)  # warm both engines up
    decode_rate(spec, prompt[:32], 4)
    spec.spec_stats = SpecDecodeStats(args.k)  # count the measured request only
    base_tps, base_out = decode_rate(plain, prompt, max_tokens)
    spec_tps, spec_out = decode_rate(spec, prompt, max_tokens)
    stats = spec.status()["spec_decode"]
    print(f"SmolLM2-135M Q4_1 on CPU ({args.dtype or 'default'}), copy-heavy chat: prompt {len(prompt)} tokens, "
          f"{len(base_out)} generated, ngram K={args.k} (lookup 2..4)")
    print(f"{'run':12s} {'decode tok/s':>12s}")
    print(f"{'plain':12s} {base_tps:12.1f}")
    print(f"{'ngram':12s} {spec_tps:12.1f}")
    print(f"speed-up {spec_tps / base_tps:.2f}x  acceptance {stats['acceptance_rate']:.2f}  "
          f"mean accepted length {stats['mean_accepted_length']:.2f}  "
          f"same tokens: {spec_out == base_out}")
    return 0 if spec_out == base_out else 1


if __name__ == "__main__":
    sys.exit(main())
