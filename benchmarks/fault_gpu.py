"""Real device faults on a GPU, classified as the CPU tests simulate them.

    python3 benchmarks/fault_gpu.py [--device cpu]   # on the CPU: 2 layers, no device assert

On the SmolLM2-135M shape (dummy weights): (1) a real torch.OutOfMemoryError raised during one
big prefill fails that request only, the others finish and every KV page comes back; (2) a
position past the RoPE table is refused on the host (a SequenceFault), the device never sees it;
(3) a real device-side assert (an out-of-bounds index on the GPU) makes the engine dead:
EngineDeadError from step() and add_request(), with the driver's reason. The last one poisons the
CUDA context, so it runs last. Prints one line per check; exit status 1 if any failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from homelab_llm.engine.args import EngineArgs  # noqa: E402
from homelab_llm.engine.core import LLMEngine  # noqa: E402
from homelab_llm.engine.faults import EngineDeadError  # noqa: E402
from homelab_llm.engine.sampling_params import SamplingParams  # noqa: E402

MODEL = REPO / "assets" / "model_configs" / "SmolLM2-135M.json"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, requests: dict[str, list[int]]) -> dict[str, tuple[str, str | None]]:
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, GREEDY)
    ends: dict[str, tuple[str, str | None]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    return ends


def pages_free(engine: LLMEngine) -> bool:
    pool = engine.kv.pool
    if engine.kv.radix is not None:
        engine.kv.radix.evict(pool.num_pages)
    return pool.num_free == pool.num_pages


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{name:48s} {'OK' if ok else 'FAIL'} {detail}", flush=True)
    return ok


def main() -> int:
    cuda = "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] != "cpu"
    engine = LLMEngine(EngineArgs(model=str(MODEL), load_format="dummy",
                                  device="cuda" if cuda else "cpu", max_model_len=4096,
                                  max_num_seqs=8, kv_cache_memory_bytes=256 << 20,
                                  hf_overrides=None if cuda else {"num_hidden_layers": 2}))
    small = {f"ok{i}": [3 + (7 * i + j) % 4000 for j in range(40 + i)] for i in range(3)}
    results = []

    def oom_on_big_prefill(batch) -> None:
        if batch.context.max_query_len >= 1000:
            if not cuda:
                raise torch.OutOfMemoryError("simulated on the CPU")
            torch.empty(1 << 45, dtype=torch.uint8, device="cuda")  # 32 TiB: a real OOM

    engine.runner.fault_hook = oom_on_big_prefill
    ends = run(engine, {**small, "big": [5] * 1500})
    results.append(check("OOM in one prefill fails it alone",
                         ends["big"][0] == "error" and "OutOfMemoryError" in (ends["big"][1] or "")
                         and all(ends[r] == ("length", None) for r in small),
                         str(ends["big"])))
    results.append(check("... and every KV page is free", pages_free(engine)))
    results.append(check("... and the engine is alive", engine.dead_reason is None))

    engine.runner.fault_hook = None
    engine.add_request("past", [5] * 4000, SamplingParams(max_tokens=8, temperature=0.0,
                                                          ignore_eos=True))
    engine._seqs["past"].max_tokens = 10**6  # a bug past admission, on purpose
    engine.outputs.max_model_len = 10**6
    engine.runner.max_positions = 4010  # as if the table ended here
    ends = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    results.append(check("a position past the table is a host-side error",
                         ends.get("past", ("", ""))[0] == "error"
                         and "past the RoPE table" in (ends["past"][1] or ""), str(ends.get("past"))))
    results.append(check("... and the engine is alive", engine.dead_reason is None))

    def device_assert(batch) -> None:
        table = torch.zeros(4, device="cuda")
        table[torch.tensor([1 << 30], device="cuda")] = 1.0  # out of bounds on the device
        torch.cuda.synchronize()

    if not cuda:
        print(f"\nSUMMARY {sum(results)}/{len(results)} checks passed (no device assert on the CPU)")
        return 0 if all(results) else 1
    engine.runner.fault_hook = device_assert
    engine.add_request("doomed", small["ok0"], GREEDY)
    try:
        engine.step()
        dead = False
        reason = "step() returned"
    except EngineDeadError as err:
        dead, reason = True, str(err)
    results.append(check("a device-side assert kills the engine", dead and
                         engine.dead_reason is not None, reason[:120]))
    try:
        engine.add_request("after", [5, 6, 7], GREEDY)
        refused = False
    except EngineDeadError:
        refused = True
    results.append(check("... and it refuses new requests", refused))
    print(f"\nSUMMARY {sum(results)}/{len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
