"""What the GPU benchmark scripts share: a results table and a runner for named sections, where a
failing section prints its traceback and the others still report; CUDA-event timing of graph
replays; the kernels of eager decode steps from torch.profiler."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Callable

results: dict[str, float] = {}


def report(key: str, value: float, unit: str = "") -> None:
    results[key] = value
    print(f"{key:48s} {value:12.4f} {unit}", flush=True)


def _release_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_sections(sections: dict[str, Callable[[], None]], names: str, json_path: str | None) -> int:
    for name in names.split(","):
        start = time.time()
        try:
            sections[name]()
        except Exception as exc:  # keep the other sections' numbers
            traceback.print_exc()
            print(f"section {name} failed: {exc}", flush=True)
        _release_memory()  # a failed section's engine (often in a reference cycle) must not starve the next
        print(f"-- {name} took {time.time() - start:.1f}s", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    print("\nSUMMARY")
    for key, value in results.items():
        print(f"{key:48s} {value:12.4f}")
    return 0


class ReplayTimer:
    """CUDA events around every `graphs.run` (a DecodeGraphs' replay) until `restore()`: the GPU
    time of the captured step, apart from the host's time around it."""

    def __init__(self, graphs) -> None:
        self.graphs, self.replay, self.events = graphs, graphs.run, []
        graphs.run = self._timed

    def _timed(self, *args, **kwargs):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.replay(*args, **kwargs)
        end.record()
        rows = (args[0] if args else kwargs["input_ids"]).shape[0]
        self.events.append((start, end, rows))
        return out

    def timed(self, rows: int | None = None) -> list[float]:
        """GPU milliseconds of each replay since the last `events.clear()` (synchronize first),
        only those of `rows` rows when given (long prompts prefill in chunks, so requests start
        decoding steps apart and the first and last replays run part of the batch)."""
        return [s.elapsed_time(e) for s, e, n in self.events if rows is None or n == rows]

    def mean_ms(self, rows: int | None = None) -> float:
        """Mean GPU milliseconds a replay (of `rows` rows when given)."""
        times = self.timed(rows)
        return sum(times) / max(1, len(times))

    def restore(self) -> None:
        self.graphs.run = self.replay


def request_ids(base: str, batch: int) -> list[str]:
    """The ids of `batch` benchmark requests named after `base` (base itself for one)."""
    return [base] if batch == 1 else [f"{base}-{i}" for i in range(batch)]


def eager_kernel_totals(engine, prompt: list[int], request_id: str,
                        steps: int = 16, batch: int = 1) -> dict[str, list[float]]:
    """Kernel name -> [GPU us, launches] per step over `steps` decode steps of `batch` requests
    after 8 of warm-up (the engine must run with enforce_eager, so every launch is visible)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from homelab_llm.engine.sampling_params import SamplingParams

    for rid in request_ids(request_id, batch):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8 + 2 * steps + 16, ignore_eos=True))
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return profile_totals(prof, steps)


def profile_totals(prof, per: int, device_time: bool = True) -> dict[str, list[float]]:
    """Name -> [us, calls] per each of `per` repetitions a torch profile covered: kernels and
    their GPU time, or (device_time False, a CPU run) torch ops and their CPU time."""
    totals: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        if device_time:
            t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        else:
            t = evt.self_cpu_time_total
        if t and evt.count:
            totals[evt.key] = [t / per, evt.count / per]
    return totals
