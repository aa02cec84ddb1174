"""Per-layer-type page groups on one GPU (issue 16): mixed full/sliding models run their sliding
layers on their own page pool; this checks the GPU paths the CPU tests cannot reach.

    python3 benchmarks/sliding_pages_gpu.py [--quick] [--json out.json]

For a Gemma 3 shape (12 layers: 2 global, 10 sliding, window 1024, head_dim 256) and a gpt-oss-20b
shape cut to 6 layers (window 128, sinks), dummy bf16 weights, prefix caching on, CUDA graphs on:
  graph_vs_eager   every decode step runs twice, eagerly and through the captured graph (whose
                   static sliding slot mapping / page table buffers the sliding layers read); max
                   abs logit difference and argmax agreement (expect 0 and 1.0: the eager
                   path's KV split count is pinned to the graph's)
  held_pages       the most sliding-group pages one sequence holds while three sequences
                   (6000, 3000 and 500-token prompts) decode: expect <= ceil(W / 16) + 2
  turn2_cached     prompt tokens a second turn (first prompt + its output + 3) reuses: expect
                   prompt + output - 1, since the window at the end of the output is held
  leaked_pages     pages of either group not free after every request ends and the prefix cache
                   is evicted: expect 0
  capacity_gain    tokens the KV budget holds vs the same bytes with every layer on one pool
Needs only torch and triton; < 2 min on an H200.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_harness import report, run_sections  # noqa: E402
from sliding_gpu import GPT_OSS_20B  # noqa: E402

GEMMA3_SHAPE = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
    "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 12,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
    "max_position_embeddings": 131072, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16", "eos_token_id": [1, 106],
}
DEVICE = "cuda"
SHAPES = {"gemma3": GEMMA3_SHAPE, "gpt_oss": {**GPT_OSS_20B, "num_hidden_layers": 6}}


def compare_paths(engine, diffs: list[tuple[float, float]]) -> None:
    """Run every graph-eligible step eagerly too (the K/V it writes are the same values). The
    eager path picks its own KV split count (a sliding layer's from its window) where a graph has
    a fixed one; it is pinned to the graph's here, so the two must agree bit for bit (different
    counts differ only by summation order, which random dummy weights amplify to ~0.1-1.5 logits:
    measured on an H200)."""
    from homelab_llm.engine.cuda_graphs import kv_splits_at
    from homelab_llm.engine.kernels import decode_attention

    runner = engine.runner
    forward = runner.forward
    if runner.graphs is not None:
        fixed = runner.graphs.num_kv_splits
        decode_attention.choose_num_splits = lambda batch, *a, **k: kv_splits_at(fixed, batch)

    def both(batch):
        graphs = runner.graphs
        if graphs is None or not graphs.fits(batch.context, batch.num_tokens):
            return forward(batch)
        runner.graphs = None
        try:
            eager = forward(batch).clone()
        finally:
            runner.graphs = graphs
        out = forward(batch)
        agree = (out.argmax(-1) == eager.argmax(-1)).float().mean().item()
        diffs.append(((out - eager).abs().max().item(), agree))
        return out

    runner.forward = both


def run_shape(name: str, config: dict, quick: bool) -> None:
    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine
    from homelab_llm.engine.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.json"
        path.write_text(json.dumps(config))
        engine = LLMEngine(EngineArgs(model=str(path), load_format="dummy", device=DEVICE,
                                      dtype="bfloat16", max_model_len=16384, max_num_seqs=4,
                                      max_num_batched_tokens=2048, gpu_memory_utilization=0.5))
    kv = engine.kv
    assert kv.sliding is not None, "no sliding page group: is the model mixed?"
    diffs: list[tuple[float, float]] = []
    compare_paths(engine, diffs)
    rng = random.Random(0)
    new = 24 if quick else 64
    top = min(30000, config["vocab_size"] - 10)
    prompts = [[rng.randrange(10, top) for _ in range(n)] for n in (6000, 3000, 500)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {}
    held = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        for seq in engine.scheduler.running:
            if seq.is_decoding:
                held = max(held, len(seq.sliding_table) - seq.sliding_released)
    turn2 = prompts[0] + outputs["r0"] + [7, 8, 9]
    engine.add_request("turn2", turn2, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seq = engine._seqs["turn2"]
    while engine.has_unfinished_requests():
        engine.step()
    status = engine.status()["kv"]
    kv.radix.evict(kv.pool.num_pages)
    leaked = (kv.pool.num_pages - kv.pool.num_free) + (kv.sliding.pool.num_pages - kv.sliding.pool.num_free)
    report(f"{name}.graph_vs_eager_max_abs_logit_diff", max((d for d, _ in diffs), default=float("nan")))
    report(f"{name}.graph_vs_eager_argmax_agree", min((a for _, a in diffs), default=float("nan")))
    report(f"{name}.graph_steps_compared", len(diffs))
    report(f"{name}.held_pages_max", held, f"(expect <= {-(-kv.sliding.window // 16) + 2})")
    report(f"{name}.turn2_cached_tokens", seq.num_cached_tokens,
           f"(expect {len(prompts[0]) + new - 1})")
    report(f"{name}.leaked_pages", leaked, "(expect 0)")
    all_layers = status["bytes_per_token"] + status["sliding_bytes_per_token"]
    kv_bytes = engine.status()["devices"][0]["kv_cache"]
    report(f"{name}.capacity_gain", status["tokens_capacity"] / (kv_bytes / all_layers), "x")
    engine.shutdown()
    del engine
    torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sections", default="gemma3,gpt_oss")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    sections = {name: (lambda n=name: run_shape(n, SHAPES[n], a.quick)) for name in SHAPES}
    return run_sections(sections, a.sections, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
