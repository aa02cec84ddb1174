"""The engine on one GPU, side by side with its ceilings and with transformers, in one run.

    python benchmarks/engine_gpu.py [--quick] [--json OUT.json]

Sections (each prints a line, a table comes last):
  ceilings   device copy bandwidth (bytes read + written) and bf16 matmul TFLOP/s, measured here
  check      engine logits vs transformers for a random-weight Qwen3-8B shape on the same GPU
  decode     Llama-3.1-8B shape bf16 (dummy weights): batch 1, batch 32 at 512-token contexts
  prefill    one 2048-token prompt, as a fraction of the measured matmul rate
  long       decode at 16K context with int8 KV vs the same engine at short context
  hf         transformers generate, same shape, batch 1
  w4a16      Llama-3.1-8B shape with W4A16 weights (group 128, dummy), batch-1 decode vs its roofline
  hostprof   batch-1 decode with graphs: step wall time vs graph GPU time, and cProfile of the host
  profile    where one eager batch-1 decode step of the bf16 Llama-3.1-8B shape spends GPU time
Needs only torch, triton and transformers (no server packages).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.assets import assets_dir  # noqa: E402
from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_harness import ReplayTimer, eager_kernel_totals, report, results, run_sections  # noqa: E402

CONFIGS = assets_dir() / "model_configs"


def cleanup() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def ceilings() -> None:
    from triton.testing import do_bench

    n = 1 << 30  # 2 GiB of bf16 each way
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    report("copy_bandwidth_GBps", 2 * n * 2 / ms / 1e6, "GB/s")
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    report("bf16_matmul_TFLOPs", 2 * 8192**3 / ms / 1e9, "TFLOP/s")
    cleanup()


def make_engine(config: str, **kw) -> LLMEngine:
    args = dict(model=str(CONFIGS / config), load_format="dummy", device="cuda", dtype="bfloat16",
                max_num_seqs=32, max_num_batched_tokens=2048, gpu_memory_utilization=0.85)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def random_prompt(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def decode_rate(engine: LLMEngine, batch: int, ctx: int, new_tokens: int) -> float:
    """Aggregate decode tok/s: time from every request's first token to the last token."""
    rng = random.Random(batch * 1000 + ctx)
    vocab = engine.model_config.vocab_size
    ids = []
    for i in range(batch):
        rid = f"d{batch}-{ctx}-{i}-{time.monotonic_ns()}"
        engine.add_request(rid, random_prompt(ctx, vocab, rng),
                           SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        ids.append(rid)
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < 1:  # prefill everything first
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    torch.cuda.synchronize()
    start, before = time.perf_counter(), sum(produced.values())
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    torch.cuda.synchronize()
    return (sum(produced.values()) - before) / (time.perf_counter() - start)


def prefill_seconds(engine: LLMEngine, n: int) -> float:
    rng = random.Random(n)
    vocab = engine.model_config.vocab_size
    best = float("inf")
    for rep in range(3):
        engine.add_request(f"p{n}-{rep}", random_prompt(n, vocab, rng), SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def param_count(config_json: str) -> tuple[int, int]:
    """(all parameters, parameters in matmuls per token) for FLOP counting."""
    c = json.loads((CONFIGS / config_json).read_text())
    h, inter, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    matmul = layers * per_layer + v * h
    total = matmul + (0 if c.get("tie_word_embeddings") else v * h)
    return total, matmul


def async_matches_sync(engine: LLMEngine) -> float:
    """Greedy and seeded tokens of a mixed batch with async scheduling on vs off (same engine)."""
    rng = random.Random(7)
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(rng.randrange(5, 300), vocab, rng) for _ in range(6)]
    runs = []
    for mode in (False, True):
        engine._async = mode
        # Start cold: a prefix hit from the first run would compute the second run's prompts
        # through another kernel path (cached prefix + extend), whose rounding differs.
        engine.kv.radix.evict(engine.kv.pool.num_pages)
        toks: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=12 + 5 * i, temperature=0.0 if i % 2 else 0.8, seed=i,
                                    ignore_eos=True)
            engine.add_request(f"am{mode}{i}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                toks.setdefault(out.request_id[len(f"am{mode}"):], []).extend(out.new_token_ids)
        runs.append(toks)
    engine._async = True
    return float(runs[0] == runs[1])


def section_decode(quick: bool) -> None:
    engine = make_engine("Llama-3.1-8B.json", max_model_len=4096)
    report("async_scheduling_tokens_equal_sync", async_matches_sync(engine))
    weights = engine.status()["devices"][0]["weights"]
    report("llama8b_weight_bytes_GB", weights / 1e9, "GB")
    decode_rate(engine, 1, 32, 16)  # warm up
    r1 = decode_rate(engine, 1, 32, 128 if quick else 256)
    report("llama8b_bf16_b1_decode_tok_s", r1, "tok/s")
    report("llama8b_bf16_b1_roofline_tok_s", results["copy_bandwidth_GBps"] * 1e9 / weights, "tok/s")
    report("llama8b_bf16_b32_ctx512_decode_tok_s", decode_rate(engine, 32, 512, 128), "tok/s")
    engine._async = False
    report("llama8b_bf16_b1_decode_sync_sched_tok_s", decode_rate(engine, 1, 32, 128), "tok/s")
    engine._async = True
    secs = prefill_seconds(engine, 2048)
    _, matmul_params = param_count("Llama-3.1-8B.json")
    c = json.loads((CONFIGS / "Llama-3.1-8B.json").read_text())
    attn_flops = 2 * 2 * c["num_hidden_layers"] * c["num_attention_heads"] * 128 * 2048 * 2048 / 2
    flops = 2 * matmul_params * 2048 + attn_flops
    report("llama8b_prefill2048_ms", secs * 1e3, "ms")
    report("llama8b_prefill2048_TFLOPs", flops / secs / 1e12, "TFLOP/s")
    report("llama8b_prefill2048_frac_of_matmul", flops / secs / 1e12 / results["bf16_matmul_TFLOPs"])
    del engine
    cleanup()


def bytes_ceiling(engine: LLMEngine, ctx: int) -> float:
    """The ratio a decode step at ctx tokens of context can keep of its short-context speed if
    every byte streams at the same rate: weight bytes a step reads (all resident weights but the
    input embedding, of which one row is read) over those plus ctx tokens of KV."""
    cfg = engine.model_config
    weights = engine.status()["devices"][0]["weights"]
    if not cfg.tie_word_embeddings:
        weights -= cfg.vocab_size * cfg.hidden_size * engine.dtype.itemsize
    kv = ctx * engine.runner.kv_layout().bytes_per_token()
    return weights / (weights + kv)


def section_long(quick: bool) -> None:
    """int8 KV decode at 16K against 64 tokens of context, on the 8B (every layer attends: its
    16K of KV is 7% of its bf16 weights' bytes) and on the reference deployment's 27B hybrid in
    W4A16 (one layer in four attends, 4 KV heads), each beside its bytes ceiling."""
    for name, config, kw in (("llama8b", "Llama-3.1-8B.json", {}),
                             ("qwen36_27b_w4a16", "Qwen3.6-27B.json", {"quantization": "w4a16"})):
        if quick and name != "llama8b":
            continue
        engine = make_engine(config, max_model_len=17408, kv_cache_dtype="int8", max_num_seqs=4, **kw)
        decode_rate(engine, 1, 32, 16)
        short = decode_rate(engine, 1, 64, 128)
        long = decode_rate(engine, 1, 16384, 128)
        report(f"{name}_int8kv_ctx64_tok_s", short, "tok/s")
        report(f"{name}_int8kv_ctx16k_tok_s", long, "tok/s")
        report(f"{name}_int8kv_16k_over_short", long / short)
        report(f"{name}_int8kv_16k_bytes_ceiling", bytes_ceiling(engine, 16384),
               "weights / (weights + 16K of KV): the most any kernel can keep")
        del engine
        cleanup()


def section_w4a16(quick: bool) -> None:
    engine = make_engine("Llama-3.1-8B.json", max_model_len=4096, quantization="w4a16", max_num_seqs=8)
    weights = engine.status()["devices"][0]["weights"]
    report("llama8b_w4a16_weight_bytes_GB", weights / 1e9, "GB")
    decode_rate(engine, 1, 32, 16)
    report("llama8b_w4a16_b1_decode_tok_s", decode_rate(engine, 1, 32, 128 if quick else 256), "tok/s")
    if "copy_bandwidth_GBps" in results:
        report("llama8b_w4a16_b1_roofline_tok_s", results["copy_bandwidth_GBps"] * 1e9 / weights, "tok/s")
    b8 = decode_rate(engine, 8, 512, 64)
    report("llama8b_w4a16_b8_ctx512_decode_tok_s", b8, "tok/s")
    # issue 19's batch-8 ratio at equal contexts (the b1 line above runs 32-token prompts)
    b1 = decode_rate(engine, 1, 512, 64)
    report("llama8b_w4a16_b1_ctx512_decode_tok_s", b1, f"b8 / b1 at 512: {b8 / b1:.2f}x")
    b8_short, b1_short = decode_rate(engine, 8, 32, 64), decode_rate(engine, 1, 32, 64)
    report("llama8b_w4a16_b8_ctx32_decode_tok_s", b8_short,
           f"b8 / b1 at 32: {b8_short / b1_short:.2f}x (b1 {b1_short:.1f})")
    del engine
    cleanup()
    # gpt-fast's int4 quantizes its output layer too: the like-for-like form (--quantize-lm-head)
    engine = make_engine("Llama-3.1-8B.json", max_model_len=4096, quantization="w4a16", max_num_seqs=8,
                         quantize_lm_head=True)
    decode_rate(engine, 1, 32, 16)
    report("llama8b_w4a16_qhead_b1_decode_tok_s", decode_rate(engine, 1, 32, 128 if quick else 256), "tok/s")
    report("llama8b_w4a16_qhead_b8_ctx32_decode_tok_s", decode_rate(engine, 8, 32, 64), "tok/s")
    del engine
    cleanup()


def kernel_totals(engine: LLMEngine, prompt: list[int], label: str,
                  steps: int = 16) -> dict[str, list[float]]:
    """Kernel name -> [GPU us, launches] per step over `steps` eager decode steps of one request
    (the engine must run with enforce_eager, so every launch is visible)."""
    return eager_kernel_totals(engine, prompt, f"prof-{label}", steps)


def profile_decode_steps(engine: LLMEngine, prompt: list[int], label: str, steps: int = 16,
                         top: int = 25) -> float:
    """GPU time per kernel name over `steps` eager decode steps of one request (kernel_totals);
    prints the top kernels, returns the step's total kernel time in microseconds."""
    totals = kernel_totals(engine, prompt, label, steps)
    whole = sum(v[0] for v in totals.values())
    print(f"{label}: GPU kernel time per eager decode step: {whole:.0f} us, "
          f"{sum(v[1] for v in totals.values()):.0f} launches", flush=True)
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us:8.1f} us  {count:6.1f}/step  {name[:100]}", flush=True)
    return whole


def section_profile(quick: bool) -> None:
    """GPU time per kernel name over eager decode steps (graphs off, so every launch is visible)."""
    engine = make_engine("Llama-3.1-8B.json", max_model_len=4096, enforce_eager=True, max_num_seqs=8)
    whole = profile_decode_steps(engine, list(range(100, 132)), "llama8b")
    report("llama8b_eager_step_gpu_kernel_us", whole, "us")
    del engine
    cleanup()


def host_vs_graph(engine: LLMEngine, prompt: list[int], label: str, steps: int = 200,
                  top: int = 22) -> tuple[float, float]:
    """Batch-1 decode with graphs: wall time per step vs the graph replay's GPU time, and the
    host functions (cProfile) that fill the difference. Returns (wall_ms, gpu_ms) per step."""
    import cProfile
    import pstats

    timer = ReplayTimer(engine.runner.graphs)
    engine.add_request(f"hp-{label}", prompt,
                       SamplingParams(max_tokens=steps + 40, ignore_eos=True))
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    timer.events.clear()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps * 1e3
    gpu = timer.mean_ms()
    report(f"{label}_b1_step_wall_ms_cprofiled", wall, "ms")
    report(f"{label}_b1_graph_gpu_ms", gpu, "ms")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    timer.restore()
    engine.abort_request(f"hp-{label}")
    return wall, gpu


def section_hostprof(quick: bool) -> None:
    """Batch-1 decode with graphs on the Llama-8B shape: host time vs graph GPU time."""
    engine = make_engine("Llama-3.1-8B.json", max_model_len=4096, max_num_seqs=8)
    host_vs_graph(engine, list(range(100, 132)), "llama8b")
    del engine
    cleanup()


def section_hf(quick: bool) -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model(**json.loads((CONFIGS / "Llama-3.1-8B.json").read_text()))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(10, 1000, (1, 32), device="cuda")
    new = 64 if quick else 128
    model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    report("llama8b_transformers_b1_tok_s", new / (time.perf_counter() - t), "tok/s")
    del model
    cleanup()


def section_check() -> None:
    """Our engine vs transformers, same random Qwen3-8B-shaped weights, same GPU, bf16."""
    import transformers

    from homelab_llm.engine.model.loader import load_weights

    c = json.loads((CONFIGS / "Qwen3-8B.json").read_text())
    cfg = transformers.AutoConfig.for_model(**c)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    engine = make_engine("Qwen3-8B.json", max_model_len=1024, enforce_eager=True, max_num_seqs=4)
    load_weights(engine.runner.model, ((n, t, None) for n, t in hf.state_dict().items()), "hf")
    rng = random.Random(1)
    prompt = random_prompt(200, c["vocab_size"], rng)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    engine.add_request("check", prompt, SamplingParams(max_tokens=1))
    plan = engine.scheduler.schedule()
    ours = engine.runner.forward(engine.runner.prepare(plan.scheduled))[0].float()
    engine.abort_request("check")
    rel = ((ours - ref).norm() / ref.norm()).item()
    report("qwen3_8b_logits_rel_err_vs_transformers", rel)
    report("qwen3_8b_top1_match", float(int(ours.argmax()) == int(ref.argmax())))
    top = torch.topk(ref, 10).indices
    report("qwen3_8b_top10_overlap", len(set(top.tolist()) & set(torch.topk(ours, 10).indices.tolist())) / 10)
    del engine, hf
    cleanup()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--sections", default="ceilings,check,decode,long,hf")
    a = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    sections = {"ceilings": ceilings, "check": section_check,
                "decode": lambda: section_decode(a.quick), "long": lambda: section_long(a.quick),
                "hf": lambda: section_hf(a.quick), "w4a16": lambda: section_w4a16(a.quick),
                "profile": lambda: section_profile(a.quick), "hostprof": lambda: section_hostprof(a.quick)}
    names = a.sections.split(",")
    if "ceilings" not in names and {"decode", "w4a16"} & set(names):
        names.insert(0, "ceilings")  # their rooflines and matmul fractions use its rates
    return run_sections(sections, ",".join(names), a.json)

if __name__ == "__main__":
    raise SystemExit(main())
