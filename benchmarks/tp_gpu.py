"""Tensor parallelism on a GPU pair, in one run:

    python benchmarks/tp_gpu.py [--json OUT.json]

  equality   TP=2 vs TP=1 logits (fp32, random-weight Qwen3-0.6B shape saved as safetensors)
             and greedy tokens
  decode     Llama-3.1-8B shape bf16 (dummy weights), batch-1 decode, TP=1 and TP=2 with each
             all-reduce choice (HOMELAB_ALLREDUCE=nccl, auto, and none = no communication, wrong
             tokens, only to time the step without it) -> the all-reduce share of a decode step
  allreduce  one-shot peer-buffer kernel vs NCCL, 8 KB..1 MB: same result?, latency eager and
             inside a CUDA graph (50 calls per graph), and the sizes auto mode would hand the kernel

  --decode-modes tp1,nccl,auto,none   picks the decode runs (each builds one engine)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_harness import report, run_sections  # noqa: E402


def equality() -> None:
    import transformers

    from homelab_llm.engine.llm import LLM
    from homelab_llm.engine.sampling_params import SamplingParams

    c = json.loads((REPO / "assets/model_configs/Qwen3-0.6B.json").read_text())
    folder = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**{**c, "initializer_range": 0.1})
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    prompts = [[(i * 7919 + j * 104729) % 150000 + 10 for j in range(n)] for i, n in enumerate((5, 37, 300))]
    out = {}
    for tp in (1, 2):
        llm = LLM(str(folder), device="cuda", dtype="float32", tensor_parallel_size=tp,
                  tokenizer=str(folder / "config.json"), max_model_len=1024, max_num_seqs=8,
                  gpu_memory_utilization=0.3)
        e = llm.engine
        for i, p in enumerate(prompts):
            e.add_request(f"probe{i}", p, SamplingParams(max_tokens=1))
        plan = e.scheduler.schedule()
        logits = e.runner.forward(e.runner.prepare(plan.scheduled)).float().cpu()
        for i in range(len(prompts)):
            e.abort_request(f"probe{i}")
        e.step()
        toks = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
        out[tp] = (logits, toks, e.status()["devices"])
        llm.shutdown()
        del e, llm  # the engine (its KV cache) goes before the next one is built
        gc.collect()
        torch.cuda.empty_cache()
    (l1, t1, _), (l2, t2, dev2) = out[1], out[2]
    report("tp2_vs_tp1_max_abs_over_max", float((l1 - l2).abs().max() / l1.abs().max()))
    report("tp2_vs_tp1_greedy_identical", float(t1 == t2))
    print("tp2 devices:", json.dumps(dev2), flush=True)


DECODE_MODES = "tp1,nccl,auto,none"


def decode(modes: str = DECODE_MODES) -> None:
    from engine_gpu import decode_rate, make_engine

    rates = {}
    for mode in modes.split(","):
        tp = 1 if mode == "tp1" else 2
        os.environ["HOMELAB_ALLREDUCE"] = "auto" if mode == "tp1" else mode  # workers inherit it
        engine = make_engine("Llama-3.1-8B.json", max_model_len=4096, tensor_parallel_size=tp,
                             max_num_seqs=8)
        decode_rate(engine, 1, 32, 16)
        rates[mode] = decode_rate(engine, 1, 32, 256)
        name = "tp1" if mode == "tp1" else f"tp2_{mode}"
        report(f"llama8b_bf16_b1_{name}_tok_s", rates[mode], "tok/s")
        engine.shutdown()
        del engine
        # What the shut-down engine left on GPU 0 (rank 0 lives here), before and after the cycle
        # collector: both should be ~0 (the engine frees by reference counting alone).
        report(f"{name}_left_gpu0_mib_no_gc", torch.cuda.memory_allocated(0) / 2**20, "MiB")
        gc.collect()  # all the same: a future cycle must not OOM the next engine
        torch.cuda.empty_cache()
        report(f"{name}_left_gpu0_mib", torch.cuda.memory_allocated(0) / 2**20, "MiB")
    os.environ.pop("HOMELAB_ALLREDUCE", None)
    if "tp1" in rates and "auto" in rates:
        report("tp2_over_tp1", rates["auto"] / rates["tp1"])
    if "none" in rates:  # step time without communication vs with it
        for mode in ("nccl", "auto"):
            if mode in rates:
                share = 1.0 - rates[mode] / rates["none"]
                report(f"allreduce_share_of_decode_step_{mode}", share)


AR_SIZES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20)


def _time_us(fn, eager_calls: int = 200, graph_calls: int = 50) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(eager_calls):
        fn()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t) / eager_calls * 1e6
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(graph_calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(4):
        g.replay()
    torch.cuda.synchronize()
    return eager, (time.perf_counter() - t) / (4 * graph_calls) * 1e6


def _allreduce_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from homelab_llm.engine.parallel.comm import PeerAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")
    peer = PeerAllReduce(gloo, mode="custom")
    rows = {"reason": peer.reason}
    if not peer.reason:
        peer.decide()  # the self-check (custom mode: no timing)
        rows["self_check"] = float(any(peer.table.use_custom))
        rows["reason"] = peer.reason  # set when the self-check failed
    if not rows["reason"]:
        custom_us, nccl_us = peer.measure(AR_SIZES)  # what auto mode would measure
        rows["auto"] = [(s, c, n) for s, c, n in zip(AR_SIZES, custom_us, nccl_us)]
    gen = torch.Generator(device="cuda").manual_seed(rank)
    for size in AR_SIZES:
        x = torch.randn(size // 2, dtype=torch.bfloat16, device="cuda", generator=gen)
        if not rows["reason"]:
            want, got = x.clone(), x.clone()
            dist.all_reduce(want)
            peer.all_reduce(got)
            rows[f"match_{size}"] = float(torch.equal(want, got))
            rows[f"custom_{size}"] = _time_us(lambda: peer.all_reduce(x))
        rows[f"nccl_{size}"] = _time_us(lambda: dist.all_reduce(x))
    if rank == 0:
        q.put(rows)
    torch.cuda.synchronize()
    peer.close()
    dist.destroy_process_group()


def allreduce() -> None:
    import torch.multiprocessing as mp

    from homelab_llm.engine.parallel.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rows = q.get(timeout=90)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if "self_check" in rows:
        report("custom_allreduce_self_check_ok", rows["self_check"])
    if rows["reason"]:
        print(f"custom all-reduce unavailable: {rows['reason']}", flush=True)
    for size in AR_SIZES:
        kb = size // 1024
        eager, graphed = rows[f"nccl_{size}"]
        report(f"nccl_allreduce_{kb}KB_eager_us", eager, "us")
        report(f"nccl_allreduce_{kb}KB_graph_us", graphed, "us")
        if f"custom_{size}" in rows:
            eager, graphed = rows[f"custom_{size}"]
            report(f"custom_allreduce_{kb}KB_eager_us", eager, "us")
            report(f"custom_allreduce_{kb}KB_graph_us", graphed, "us")
            report(f"custom_allreduce_{kb}KB_equals_nccl", rows[f"match_{size}"])
    for size, custom_us, nccl_us in rows.get("auto", []):
        print(f"auto probe {size // 1024:5d} KB: custom {custom_us:7.1f} us, nccl {nccl_us:7.1f} us "
              f"-> {'custom' if custom_us < nccl_us else 'nccl'}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--sections", default="equality,decode,allreduce")
    p.add_argument("--decode-modes", default=DECODE_MODES)
    a = p.parse_args()
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", flush=True)
    return run_sections({"equality": equality, "decode": lambda: decode(a.decode_modes),
                         "allreduce": allreduce}, a.sections, a.json)

if __name__ == "__main__":
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, value)
    raise SystemExit(main())
