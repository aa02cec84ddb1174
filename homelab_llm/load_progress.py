"""How far `serve` is in loading its model, for the log and for `/health` while loading.

Phases, in order, with the share of the bar each one fills:
  starting (config, tokenizer) 0-2% · loading weights 2-85% (bytes read of the checkpoint's
  total, per shard) · sizing KV cache 85-90% · capturing graphs 90-100% (graphs captured of N).
The loader, the engine and the graph capture report here; `/health` answers 503
{"status": "loading", "progress": 0.0-1.0, "phase": ...} from `LOAD.snapshot()`, and each step
is logged (throttled to one line per 10% of the weights, plus every shard boundary), so
`serve` is never silent while it works.

One object per process (`LOAD`), like a logger: a server loads one model, and the loader sits
several calls below anything that could carry a reporter.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("homelab_llm.load")

# phase -> (start, end) of the overall fraction
SPANS: dict[str, tuple[float, float]] = {
    "starting": (0.0, 0.02), "loading weights": (0.02, 0.85), "sizing KV cache": (0.85, 0.9),
    "capturing graphs": (0.9, 1.0), "ready": (1.0, 1.0),
}
LOG_EVERY = 0.1  # of the weights


class LoadProgress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.phase = "starting"
            self.fraction = 0.0
            self._logged = -1.0

    def begin(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self.fraction = max(self.fraction, SPANS[phase][0])
        if phase != "ready":
            log.info("load: %s", phase)

    def _within(self, part: float) -> None:
        start, end = SPANS[self.phase]
        self.fraction = max(self.fraction, start + (end - start) * min(max(part, 0.0), 1.0))

    def weights(self, done: int, total: int, shard: int, shards: int, name: str,
                shard_done: bool = False) -> None:
        """`done` of `total` checkpoint bytes read; shard is 1-based."""
        with self._lock:
            if self.phase != "loading weights":
                self.phase = "loading weights"
            part = done / total if total > 0 else 0.0
            self._within(part)
            due = shard_done or part - self._logged >= LOG_EVERY
            if due:
                self._logged = part
        if due:
            log.info("load: weights %.2f/%.2f GiB (%.0f%%), shard %d/%d %s", done / 2**30,
                     total / 2**30, part * 100, shard, shards, name)

    def step(self, done: int, total: int, what: str) -> None:
        """`done` of `total` steps of the current phase (graphs captured, ...)."""
        with self._lock:
            self._within(done / total if total > 0 else 1.0)
            phase = self.phase
        log.info("load: %s %d/%d %s", phase, done, total, what)

    def mirror(self, snapshot: dict[str, object]) -> None:
        """Take another process's snapshot as ours (the engine loads in its own process; the
        server's /health reads this one)."""
        with self._lock:
            self.phase = str(snapshot["phase"])
            self.fraction = float(snapshot["progress"])  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"progress": round(self.fraction, 4), "phase": self.phase}


LOAD = LoadProgress()
