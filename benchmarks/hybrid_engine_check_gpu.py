"""GPU correctness checks of the hybrid (Qwen3.5/3.6 Gated DeltaNet) engine path: the Triton GDN
kernels inside the engine, decode CUDA graphs with fixed-size state slots, chunked prefill, and
prefix reuse from state snapshots. CPU tests cover the same logic on the torch references; this
runs it where the kernels and graphs actually run.

    python3 benchmarks/hybrid_engine_check_gpu.py [--quick]

Tiny dummy-weight hybrid (fp32, so results are comparable run to run) on cuda:0. Each row says
whether greedy tokens match the reference run exactly (fp32: they should; a mismatch is a bug in
state handling, not rounding), plus cached-token counts. Finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402

CONFIG = dict(
    model_type="qwen3_5_text", vocab_size=1024, hidden_size=256, intermediate_size=512,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=4096,
    full_attention_interval=4, torch_dtype="float32", eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
rows: list[tuple[str, bool, str]] = []


def engine(path: Path, **kw) -> LLMEngine:
    args = dict(model=str(path), load_format="dummy", device="cuda", dtype="float32", page_size=16,
                max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_memory_bytes=256 << 20)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def generate(e: LLMEngine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and cached prompt tokens of each prompt, all submitted at once."""
    ids = [f"r{len(rows)}-{i}-{os.urandom(4).hex()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        e.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens = {rid: [] for rid in ids}
    cached = dict.fromkeys(ids, 0)
    while e.has_unfinished_requests():
        for out in e.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    return [tokens[r] for r in ids], [cached[r] for r in ids]


def check(name: str, ok: bool, detail: str = "") -> None:
    rows.append((name, ok, detail))
    print(f"{name:52s} {'ok' if ok else 'MISMATCH':9s} {detail}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    n = 8 if parser.parse_args().quick else 24
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 63, 64, 65, 130, 200, 17, 300]
    prompts = [torch.randint(10, 1000, (m,), generator=gen).tolist() for m in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hybrid.json"
        path.write_text(json.dumps(CONFIG))
        eager = engine(path, enforce_eager=True, enable_prefix_caching=False)
        ref, _ = generate(eager, prompts, n)
        alone = [generate(eager, [p], n)[0][0] for p in prompts]
        check("eager: batch of 8 == one at a time", alone == ref)
        del eager
        graphs = engine(path, enable_prefix_caching=False)
        check("decode graphs (padded state slots) == eager", generate(graphs, prompts, n)[0] == ref)
        check("graphs, 3 then 5 sequences == eager",
              generate(graphs, prompts[:3], n)[0] + generate(graphs, prompts[3:], n)[0] == ref)
        del graphs
        chunked = engine(path, max_num_batched_tokens=48, enable_prefix_caching=False)
        check("chunked prefill (48-token steps) == one-shot", generate(chunked, prompts, n)[0] == ref)
        del chunked
        cached = engine(path, max_state_snapshots=16)  # room for every prompt and output end
        generate(cached, prompts, n)
        ext = [p + [7, 8, 9][: 1 + i % 3] for i, p in enumerate(prompts)]
        ext_ref, _ = generate(engine(path, enable_prefix_caching=False, enforce_eager=True), ext, n)
        got, hits = generate(cached, ext, n)
        check("prefix reuse from snapshots == no caching", got == ext_ref)
        check("every earlier prompt token cached", all(h >= len(p) for h, p in zip(hits, prompts)),
              f"cached {hits} of {[len(p) for p in prompts]}")
        status = cached.status()["prefix_cache"]
        check("snapshot counters", status["state_snapshot_hits"] > 0,
              f"hits {status['state_snapshot_hits']} held {status['state_snapshots_held']}")
        del cached
        os.environ["HOMELAB_LLM_KERNELS"] = "ref"
        try:
            torch_ref, _ = generate(engine(path, enforce_eager=True, enable_prefix_caching=False),
                                    prompts, n)
        finally:
            del os.environ["HOMELAB_LLM_KERNELS"]
        same = sum(a == b for a, b in zip(torch_ref, ref))
        check("Triton kernels == torch references (greedy)", same == len(ref), f"{same}/{len(ref)}")
    print("\nSUMMARY")
    for name, ok, detail in rows:
        print(f"{name:52s} {'ok' if ok else 'MISMATCH':9s} {detail}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
