"""The deployment our users run, emulated (issue #5): a Qwen3-32B-shape W4A16 model over two GPUs,
int8 KV cache, 128K context, 8 sequences, with the KV cache capped to what a 24 GiB card leaves.

    python benchmarks/tp_deploy.py [--json OUT.json]
    python benchmarks/tp_deploy.py --tiny          # the same path on the CPU (gloo), tiny shapes

Two engine builds. The first (probe) measures, per rank, what the model takes: weights, the
activation peak of the largest step and the decode graphs. The second runs with
kv_cache_memory_bytes = the per-GPU budget

    KV budget = card - max over ranks (weights + activations_peak + graphs) - reserve

(card 24 GiB, reserve 1 GiB for the CUDA/HIP context, NCCL/RCCL buffers and allocator slack:
what `other` measures on a real card). It then prints a vLLM-log-like table: per GPU weights /
activations / graphs / KV, KV token capacity, how many requests of 8K/32K/128K fit at once, and
decode tok/s per stream and in aggregate at 1, 2, 4, 8 concurrent streams (short contexts: the
context used is printed), plus how long each shutdown took. Dummy weights: the speed and memory
are the real model's, the tokens are noise.

Hybrid models (--config assets/model_configs/Qwen3.6-27B.json, issue 14) also hold Gated DeltaNet
states (running sequences + the prefix cache's snapshot pool), allocated before the KV cache: they
count with the weights in the budget, get their own column, and the planned numbers (`plan`'s
KV bytes per token and state bytes) print beside the measured ones.

Qwen3's native window is 32K; 128K is served with YaRN (factor 4), as Qwen's model card says, so
the config used is the shipped shape plus that rope_scaling.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_gpu import cleanup, decode_rate, make_engine  # noqa: E402

from homelab_llm.engine import memory  # noqa: E402
from homelab_llm.engine.model.loader import load_model_config  # noqa: E402

GiB = 1 << 30
YARN_128K = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=8192,
            rope_scaling=None)
TINY_HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)


def write_config(a: argparse.Namespace, folder: Path) -> Path:
    raw = json.loads(Path(a.config).read_text())
    if a.tiny:
        raw.update(TINY)
        if raw.get("layer_types"):
            raw.update(TINY_HYBRID)
    elif a.max_model_len > raw.get("max_position_embeddings", 0) and not raw.get("rope_scaling"):
        raw["rope_scaling"] = YARN_128K
    path = folder / (Path(a.config).stem + ("-tiny" if a.tiny else "-deploy") + ".json")
    path.write_text(json.dumps(raw))
    return path


def build(a: argparse.Namespace, config: Path, kv_bytes: int):
    return make_engine(str(config), device=a.device, dtype="bfloat16", quantization="w4a16",
                       tensor_parallel_size=a.tp, kv_cache_dtype="int8",
                       max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                       max_num_batched_tokens=a.max_num_batched_tokens,
                       kv_cache_memory_bytes=kv_bytes)


def close(engine) -> float:
    start = time.perf_counter()
    engine.shutdown()
    return time.perf_counter() - start


def gib(n: float) -> str:
    return f"{n / GiB:7.2f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "assets/model_configs/Qwen3-32B.json"))
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes on the CPU (gloo): checks the whole path without a GPU")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--card-gib", type=float, default=None, help="emulated card size (24)")
    p.add_argument("--reserve-gib", type=float, default=None, help="fixed reserve (1)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=None, help="prompt length of the tok/s rows (512)")
    p.add_argument("--new-tokens", type=int, default=None, help="decoded tokens per stream (64)")
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    small = a.tiny
    a.device = a.device or ("cpu" if small else "cuda")
    a.card_gib = a.card_gib if a.card_gib is not None else (0.25 if small else 24.0)
    a.reserve_gib = a.reserve_gib if a.reserve_gib is not None else (1 / 64 if small else 1.0)
    a.max_model_len = a.max_model_len or (8192 if small else 131072)
    a.ctx = a.ctx or (16 if small else 512)
    a.new_tokens = a.new_tokens or (4 if small else 64)
    if a.device == "cpu":  # decode_rate syncs the GPU around its timing; nothing to sync here
        torch.cuda.synchronize = lambda *args, **kw: None
    out: dict = {"setup": {k: v for k, v in vars(a).items() if k != "json"}}

    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(a, Path(tmp))
        mc = load_model_config(str(config), "dummy")
        per_token = max(memory.kv_bytes_per_token(mc, "int8", "bfloat16", a.tp, r)
                        for r in range(a.tp))
        # 1. probe: room for exactly one max_model_len sequence (plus a page) on each rank
        t = time.perf_counter()
        probe = build(a, config, (a.max_model_len + 16) * per_token)
        out["probe_build_s"] = time.perf_counter() - t
        measured = probe.status()["devices"]
        out["probe_shutdown_s"] = close(probe)
        del probe
        cleanup()
        card, reserve = int(a.card_gib * GiB), int(a.reserve_gib * GiB)
        used = max(d["weights"] + d["activations_peak"] + d["graphs"] + d.get("state", 0)
                   for d in measured)
        budget = card - used - reserve
        out["budget"] = {"card": card, "reserve": reserve, "max_rank_model_bytes": used,
                         "kv_budget_per_gpu": budget,
                         "formula": "card - max_rank(weights + activations_peak + graphs + state)"
                                    " - reserve"}
        print(f"KV budget per GPU = {a.card_gib:g} GiB card - {used / GiB:.2f} GiB "
              f"(weights + activations + graphs + state, largest rank) - {a.reserve_gib:g} GiB "
              f"reserve = {budget / GiB:.2f} GiB", flush=True)
        if budget < a.max_model_len * per_token:
            print(f"does not fit: {budget / GiB:.2f} GiB holds "
                  f"{max(budget, 0) // per_token} tokens < max_model_len {a.max_model_len}")
            out["fits"] = False
            _write(a, out)
            return 1
        out["fits"] = True
        # 2. the deployment
        t = time.perf_counter()
        engine = build(a, config, budget)
        out["build_s"] = time.perf_counter() - t
        status = engine.status()
        kv = status["kv"]
        cap, page = kv["tokens_capacity"], kv["page_size"]
        out["devices"], out["kv"] = status["devices"], kv
        print(f"\n{mc.name or config.stem}: W4A16 (dummy) TP={a.tp}, KV int8, max_model_len "
              f"{a.max_model_len}, max_num_seqs {a.max_num_seqs}, {a.card_gib:g} GiB card emulated")
        print(f"{'rank':4s} {'device':24s} {'weights':>11s} {'activations':>11s} {'graphs':>11s} "
              f"{'state':>11s} {'KV cache':>11s} {'other':>11s}")
        for r, d in enumerate(status["devices"]):
            print(f"{r:<4d} {str(d['name'])[:24]:24s} {gib(d['weights'])} "
                  f"{gib(d['activations_peak'])} {gib(d['graphs'])} {gib(d.get('state', 0))} "
                  f"{gib(d['kv_cache'])} {gib(d['other'])}")
        print(f"GPU KV cache size: {cap:,} tokens ({kv['bytes_per_token']} B/token/GPU, "
              f"page {page})")
        planned = memory.plan(mc, gpu_memory_bytes=card, tensor_parallel_size=a.tp,
                              kv_cache_dtype="int8", dtype="bfloat16", quantization="w4a16",
                              max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                              max_num_batched_tokens=a.max_num_batched_tokens)
        out["planned"] = {"kv_bytes_per_token": planned.kv_bytes_per_token,
                          "state_bytes": planned.per_device[0].state_bytes,
                          "weights_bytes": [d.weights_bytes for d in planned.per_device]}
        print(f"plan: {planned.kv_bytes_per_token} KV B/token/GPU, weights "
              f"{gib(planned.per_device[0].weights_bytes)} (+ RoPE table "
              f"{gib(planned.per_device[0].buffers_bytes)}), state "
              f"{gib(planned.per_device[0].state_bytes)} per GPU "
              f"({planned.state_bytes_per_sequence:,} B per sequence)")
        conc = {}
        for n in (8192, 32768, 131072):
            if n > a.max_model_len:
                continue
            x = cap / n
            conc[n] = {"ratio": x, "fits_whole": memory.max_concurrency(cap // page, page, n),
                       "with_max_num_seqs": min(a.max_num_seqs,
                                                memory.max_concurrency(cap // page, page, n))}
            print(f"Maximum concurrency for {n:,} tokens per request: {x:.2f}x "
                  f"({conc[n]['with_max_num_seqs']} at once with max_num_seqs {a.max_num_seqs})")
        out["max_concurrency"] = conc
        # 3. decode speed, short contexts
        decode_rate(engine, 1, a.ctx, 4)  # warm up
        rows = {}
        print(f"\ndecode, {a.ctx}-token prompts, {a.new_tokens} new tokens per stream")
        print(f"{'streams':>7s} {'tok/s/stream':>13s} {'aggregate':>10s}")
        for b in (int(s) for s in a.streams.split(",")):
            if b > a.max_num_seqs:
                continue
            agg = decode_rate(engine, b, a.ctx, a.new_tokens)
            rows[b] = {"per_stream_tok_s": agg / b, "aggregate_tok_s": agg}
            print(f"{b:7d} {agg / b:13.1f} {agg:10.1f}", flush=True)
        out["decode"] = {"ctx": a.ctx, "new_tokens": a.new_tokens, "rows": rows}
        out["shutdown_s"] = close(engine)
    print(f"\nbuild {out['build_s']:.1f} s (probe {out['probe_build_s']:.1f} s); shutdown "
          f"{out['shutdown_s']:.2f} s (probe {out['probe_shutdown_s']:.2f} s)")
    _write(a, out)
    return 0


def _write(a: argparse.Namespace, out: dict) -> None:
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    import os

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (as tp_gpu.py)
    raise SystemExit(main())
