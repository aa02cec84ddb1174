"""What the GPU benchmark scripts share: a results table and a runner for named sections, where a
failing section prints its traceback and the others still report."""

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
        self.events.append((start, end))
        return out

    def mean_ms(self) -> float:
        """Mean GPU milliseconds a replay since the last `events.clear()` (synchronize first)."""
        return sum(s.elapsed_time(e) for s, e in self.events) / max(1, len(self.events))

    def restore(self) -> None:
        self.graphs.run = self.replay
