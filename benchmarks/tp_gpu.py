"""Tensor parallelism on a GPU pair, in one run:

    python benchmarks/tp_gpu.py [--json OUT.json]

  equality   TP=2 vs TP=1 logits (fp32, random-weight Qwen3-0.6B shape saved as safetensors)
             and greedy tokens
  decode     Llama-3.1-8B shape bf16 (dummy weights), batch-1 decode, TP=1 and TP=2
  allreduce  NCCL all-reduce latency 8 KB..1 MB, eager and inside a CUDA graph (2 ranks)
"""

from __future__ import annotations

import argparse
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
    (l1, t1, _), (l2, t2, dev2) = out[1], out[2]
    report("tp2_vs_tp1_max_abs_over_max", float((l1 - l2).abs().max() / l1.abs().max()))
    report("tp2_vs_tp1_greedy_identical", float(t1 == t2))
    print("tp2 devices:", json.dumps(dev2), flush=True)


def decode() -> None:
    from engine_gpu import decode_rate, make_engine

    rates = {}
    for tp in (1, 2):
        engine = make_engine("Llama-3.1-8B.json", max_model_len=4096, tensor_parallel_size=tp,
                             max_num_seqs=8)
        decode_rate(engine, 1, 32, 16)
        rates[tp] = decode_rate(engine, 1, 32, 256)
        report(f"llama8b_bf16_b1_tp{tp}_tok_s", rates[tp], "tok/s")
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    report("tp2_over_tp1", rates[2] / rates[1])


def _allreduce_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for size in (8 << 10, 64 << 10, 256 << 10, 1 << 20):
        x = torch.randn(size // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        n = 200
        t = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t) / n * 1e6
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                for _ in range(50):
                    dist.all_reduce(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(4):
            g.replay()
        torch.cuda.synchronize()
        graphed = (time.perf_counter() - t) / 200 * 1e6
        rows.append((size, eager, graphed))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def allreduce() -> None:
    import torch.multiprocessing as mp

    from homelab_llm.engine.parallel_workers import _free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=300)
    for p in procs:
        p.join()
    for size, eager, graphed in rows:
        report(f"nccl_allreduce_{size // 1024}KB_eager_us", eager, "us")
        report(f"nccl_allreduce_{size // 1024}KB_graph_us", graphed, "us")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--sections", default="equality,decode,allreduce")
    a = p.parse_args()
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", flush=True)
    return run_sections({"equality": equality, "decode": decode, "allreduce": allreduce},
                        a.sections, a.json)

if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    raise SystemExit(main())
