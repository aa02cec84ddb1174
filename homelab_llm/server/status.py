"""/v1/status: the engine's own report (config, devices, kv, requests, prefix_cache) plus what only
the server sees (throughput over a sliding window, latency percentiles, uptime). The keys are the
DESIGN.md contract the TUI reads; latencies and uptime are in seconds, memory in bytes."""

from __future__ import annotations

from typing import Any

from homelab_llm.server.stats import ServerStats

ENGINE_SECTIONS: dict[str, Any] = {
    "config": {}, "devices": [], "kv": {"page_size": 0, "dtype": "", "tokens_capacity": 0,
                                        "tokens_used": 0},
    "requests": {"running": 0, "waiting": 0},
    "prefix_cache": {"query_tokens": 0, "hit_tokens": 0},
}


def build_status(engine_status: dict[str, Any], stats: ServerStats) -> dict[str, Any]:
    status: dict[str, Any] = {key: engine_status.get(key, default)
                              for key, default in ENGINE_SECTIONS.items()}
    if "spec_decode" in engine_status:  # only while speculation is on (DESIGN.md)
        status["spec_decode"] = engine_status["spec_decode"]
    status["throughput"] = stats.throughput()
    status["latency"] = stats.latency()
    status["uptime"] = stats.uptime()
    return status


def kv_usage(engine_status: dict[str, Any]) -> float:
    kv = engine_status.get("kv", {})
    capacity = kv.get("tokens_capacity") or 0
    return kv.get("tokens_used", 0) / capacity if capacity else 0.0


def num_preemptions(engine_status: dict[str, Any]) -> int:
    # Not part of the /v1/status contract: the engine reports it under "counters".
    return int(engine_status.get("counters", {}).get("num_preemptions", 0))
