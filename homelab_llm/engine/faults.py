"""What a failure in a step means: the engine is dead, one request must go, or neither is known.

A device fault (illegal address, device-side assert, ECC, a lost device, a dead tensor-parallel
rank) leaves the device or the process group unusable: the engine is dead and says so at once
(every later call raises EngineDeadError; the server answers 503 and exits non-zero). An
out-of-memory error is recoverable when one request's prefill caused it (that request fails, its
pages are freed). Anything else is taken to be one request's fault and isolated (engine/core.py
re-runs the step without it). Importing this module does not import torch.
"""

from __future__ import annotations

import enum
import sys

from homelab_llm.errors import HomelabError


class FaultKind(enum.Enum):
    FATAL = "fatal"  # the device or a rank is gone: nothing can run any more
    OOM = "oom"  # out of device memory: recoverable if one request caused it
    OTHER = "other"  # a Python-level error: isolate the request(s) that raise it


class EngineDeadError(HomelabError, RuntimeError):
    """The engine met a fatal fault and cannot serve; the message says which."""


class FatalEngineError(HomelabError, RuntimeError):
    """Raised by engine parts that know their failure is fatal (a tensor-parallel rank died)."""


class SequenceFault(HomelabError, RuntimeError):
    """One sequence cannot run this step (a host-side check failed); it fails alone."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id


# Driver/runtime messages that mean the context or the device is lost (CUDA, HIP, NCCL/RCCL).
_FATAL_MARKERS = (
    "illegal memory access", "illegal address", "misaligned address", "illegal instruction",
    "device-side assert", "unspecified launch failure", "uncorrectable ecc", "ecc error",
    "device lost", "gpu is lost", "fallen off the bus", "hardware stack error",
    "cuda error", "hip error", "cudaerror", "hiperror", "nccl error", "ncclunhandled",
    "ncclsystemerror", "ncclremoteerror", "launch timeout", "context is destroyed",
)


def classify(exc: BaseException) -> FaultKind:
    """Classify by exception type first (torch.AcceleratorError, torch.OutOfMemoryError), then
    by the driver's message; torch is only consulted if something already imported it."""
    if isinstance(exc, (FatalEngineError, EngineDeadError)):
        return FaultKind.FATAL
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(exc, torch.OutOfMemoryError):
            return FaultKind.OOM
        accelerator_error = getattr(torch, "AcceleratorError", None)
        if accelerator_error is not None and isinstance(exc, accelerator_error):
            return FaultKind.FATAL
    message = str(exc).lower()
    if isinstance(exc, RuntimeError) and "out of memory" in message:
        return FaultKind.OOM  # an allocator's message without torch's OutOfMemoryError type
    if isinstance(exc, (RuntimeError, OSError)) and any(m in message for m in _FATAL_MARKERS):
        return FaultKind.FATAL
    return FaultKind.OTHER


def describe(exc: BaseException) -> str:
    """One line for logs, error events and /health: the type and the first line of the message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
