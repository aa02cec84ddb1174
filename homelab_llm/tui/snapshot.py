"""What the dashboard shows about one server at one moment, whichever server it is.

Every field that a server may not expose is Optional: vLLM has no per-device memory split,
llama.cpp has no prefix-cache counters; the dashboard shows "n/a" rather than a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory split in bytes, as the server measured it (/v1/status)."""

    name: str
    total: int
    weights: int = 0
    activations: int = 0
    graphs: int = 0
    kv_cache: int = 0
    state: int = 0  # hybrid models' recurrent states and their snapshots; 0 elsewhere
    other: int = 0
    free: int = 0

    def segments(self, kv_used_fraction: float | None) -> list[tuple[str, int]]:
        """(label, bytes) in bar order; the KV pool splits into used and free by token usage."""
        fraction = min(max(kv_used_fraction or 0.0, 0.0), 1.0)
        kv_used = int(self.kv_cache * fraction)
        return [("weights", self.weights), ("activations", self.activations), ("graphs", self.graphs),
                ("KV used", kv_used), ("KV free", self.kv_cache - kv_used), ("state", self.state),
                ("other", self.other), ("free", self.free)]


@dataclass(frozen=True)
class ServerSnapshot:
    source: str = "none"  # "status" (our /v1/status), "homelab_llm", "vllm", "sglang", "llama.cpp"
    ok: bool = False
    error: str = ""
    model: str = ""
    devices: tuple[DeviceMemory, ...] = ()
    kv_dtype: str = ""
    kv_tokens_used: int | None = None
    kv_tokens_capacity: int | None = None
    kv_usage: float | None = None  # 0..1
    running: int | None = None
    waiting: int | None = None
    prefix_hit_rate: float | None = None  # 0..1, since the server started
    prompt_tps: float | None = None
    generation_tps: float | None = None
    ttft_p50: float | None = None  # seconds
    ttft_p95: float | None = None
    tpot_p50: float | None = None
    tpot_p95: float | None = None
    preemptions: int | None = None
    spec_acceptance_rate: float | None = None  # 0..1; None when the server does not speculate
    spec_mean_accepted_length: float | None = None  # tokens per verify step and sequence
    uptime_s: float | None = None
    config: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuTelemetry:
    """Live sensor readings for one GPU, where the driver exposes them."""

    pci_address: str
    name: str = ""
    load_pct: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    power_cap_w: float | None = None
    vram_used_bytes: int | None = None


@dataclass(frozen=True)
class PcieLink:
    current_gen: int | None = None
    current_width: int | None = None
    max_gen: int | None = None
    max_width: int | None = None

    def describe(self) -> str:
        def one(gen: int | None, width: int | None) -> str:
            return f"Gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"

        now = one(self.current_gen, self.current_width)
        if (self.current_gen, self.current_width) == (self.max_gen, self.max_width):
            return now
        return f"{now} of {one(self.max_gen, self.max_width)}"

    @property
    def degraded(self) -> bool:
        return (None not in (self.current_width, self.max_width)
                and self.current_width < self.max_width)  # type: ignore[operator]


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the hardware check found it (the hwcheck JSON contract)."""

    pci_address: str
    vendor: str
    name: str
    vram_bytes: int | None = None
    integrated: bool = False
    link: PcieLink = field(default_factory=PcieLink)
    attached_to: str = ""  # "cpu" or "chipset"
    numa_node: int | None = None


@dataclass(frozen=True)
class HardwareReport:
    gpus: tuple[GpuInfo, ...] = ()
    topology: str = ""  # the matrix and its legend, as `hwcheck` prints them
    tree: str = ""  # root ports -> switches -> GPUs with the link of every hop
    warnings: tuple[str, ...] = ()
    error: str = ""  # why the probe could not run; the screen shows it instead of a traceback
