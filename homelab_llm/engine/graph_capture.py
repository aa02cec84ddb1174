"""How a graph runner records one static-shape forward: a CUDA/HIP graph on a GPU, or, for tests
on a CPU, an eager stand-in that re-runs the same function over the same static buffers.

A capturer takes `fn`, a function of no arguments that reads only static input buffers (its
forward context included: fn sets it itself, since nothing outside a graph is replayed) and
returns a tuple of output tensors. It gives back a Replayable and those outputs: after each
replay() the outputs hold the result for the inputs then in the buffers. Graph runners
(cuda_graphs.py, spec/mtp_graphs.py) are written against this, so everything except the capture
itself (static buffers, padding, which rows come back) runs in CPU tests through EagerReplay.

Invariants: every capture of one capturer shares one memory pool (graphs replay one at a time on
one stream, so their scratch may overlap; their outputs stay allocated while referenced); a
captured graph's outputs are overwritten by its next replay only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

Outputs = tuple[torch.Tensor, ...]


class Replayable(Protocol):
    def replay(self) -> None: ...

    def reset(self) -> None: ...


class Capturer(Protocol):
    def __call__(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]: ...

    def allocated(self) -> int: ...


class CudaCapture:
    """CUDA/HIP graphs in one shared private pool; two eager warm-up runs before each capture
    (Triton compiles and autotunes outside the capture)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def __call__(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        for _ in range(2):
            fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, outputs

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)


class EagerReplay:
    """The CPU stand-in: replay() runs fn again and copies its results into the outputs of the
    first run, so callers see exactly the static-output behaviour of a graph."""

    def __init__(self, fn: Callable[[], Outputs]) -> None:
        self.fn = fn
        self.outputs = fn()

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn(), strict=True):
            out.copy_(new)

    def reset(self) -> None:
        self.fn = None  # type: ignore[assignment]


class EagerCapture:
    """Capturer of EagerReplay stand-ins (tests, CPU)."""

    def __call__(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        replay = EagerReplay(fn)
        return replay, replay.outputs

    def allocated(self) -> int:
        return 0
