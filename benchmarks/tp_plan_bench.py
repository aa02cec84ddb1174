"""What one step's plan costs to cross from rank 0 to a worker: gloo broadcast vs the shared-memory
ring, on the CPU (no GPU needed).

    python benchmarks/tp_plan_bench.py [--iters 2000] [--json OUT.json]

Two processes ping-pong: rank 0 sends a plan (header + payload) through the engine's own channel
classes, the worker reads it whole and answers with one word over the same kind of transport.
Latency = round trip / 2. Plans: a batch-1 decode (short context), a batch-8 decode at 128K
context (page table 8 x 8192 pages), a 2048-token prefill.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from homelab_llm.engine.parallel.channel import PlanChannel, ShmPlanChannel  # noqa: E402
from homelab_llm.engine.parallel.launch import free_port  # noqa: E402
from homelab_llm.engine.parallel.ring import ShmRing  # noqa: E402
from homelab_llm.engine.step_plan import CMD_STEP, HEADER_LEN, PlanHeader  # noqa: E402

PLANS = {  # name: (tokens, batch, pages per sequence)
    "decode_b1_ctx32": (1, 1, 2),
    "decode_b8_ctx128k": (8, 8, 8192),
    "prefill_2048": (2048, 1, 128),
}


def _plan(t: int, b: int, pages: int) -> tuple[PlanHeader, torch.Tensor]:
    n = 3 * t + (b + 1) + b + b * pages + b
    return PlanHeader(CMD_STEP, t, b, pages, b, t == b, 1, 16 * pages, n), torch.arange(n)


def _group(rank: int, port: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    return dist.group.WORLD


def _worker(port: int, ring_to: str, ring_back: str, iters: int) -> None:
    group = _group(1, port)
    gloo = PlanChannel(group)
    shm = ShmPlanChannel(group, ShmRing.attach(ring_to, 0))
    back_w = ShmRing.attach(ring_back, None)  # the answers go back through a second ring
    one = torch.zeros(1, dtype=torch.long)
    for _name in PLANS:
        for _ in range(iters):  # gloo
            gloo.recv()
            dist.broadcast(one, src=1, group=group)
        for _ in range(iters):  # shm
            shm.recv()
            back_w.write(one)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    port = free_port()
    ring_to = ShmRing.create(readers=1)
    ring_back = ShmRing.create(readers=1, slots=2, slot_words=8)
    back = ShmRing.attach(ring_back.path, 0)  # rank 0 reads the answers as reader 0
    proc = mp.get_context("spawn").Process(
        target=_worker, args=(port, ring_to.path, ring_back.path, a.iters))
    proc.start()
    group = _group(0, port)
    gloo, shm = PlanChannel(group), ShmPlanChannel(group, ring_to, lambda: proc.exitcode is None)
    one = torch.zeros(1, dtype=torch.long)
    results: dict[str, float] = {}
    for name, shape in PLANS.items():
        header, payload = _plan(*shape)
        for transport in ("gloo", "shm"):
            times = []
            for _ in range(a.iters):
                t0 = time.perf_counter()
                if transport == "gloo":
                    gloo.send(header, payload)
                    dist.broadcast(one, src=1, group=group)
                else:
                    shm.send(header, payload)
                    back.read()
                times.append(time.perf_counter() - t0)
            steady = sorted(times[a.iters // 10:])
            us = statistics.median(steady) / 2 * 1e6
            p90 = steady[int(len(steady) * 0.9)] / 2 * 1e6
            results[f"{name}_{transport}_us"] = us
            print(f"{name:20s} {transport:5s} {payload.numel() + HEADER_LEN:7d} words  "
                  f"one-way median {us:8.1f} us  p90 {p90:8.1f} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    proc.join(30)
    for r in (ring_to, ring_back):
        r.unlink()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
