"""The engine's numbers: KV tokens, requests, prefix-cache hit rate, latency percentiles, and the
host's CPU/RAM with the service's own share (what a CPU run is limited by), the model's
parameters (total and active per token: they differ for mixture-of-experts models), and the
speculative-decoding acceptance when the server speculates."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from homelab_llm.tui.snapshot import ServerSnapshot
from homelab_llm.tui.host import HostReading
from homelab_llm.tui.widgets.format import NA, billions, gib, percent, seconds, tokens


def stats_table(snap: ServerSnapshot, host: HostReading | None = None) -> Table:
    grid = Table.grid(padding=(0, 2), expand=True)
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(ratio=1)
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(ratio=1)
    kv = Text(f"{tokens(snap.kv_tokens_used)}/{tokens(snap.kv_tokens_capacity)}")
    if snap.kv_usage is not None:
        kv.append(f" {percent(snap.kv_usage)}", style="green" if snap.kv_usage < 0.9 else "red")
    if snap.kv_dtype:
        kv.append(f" {snap.kv_dtype}", style="dim")
    running = NA if snap.running is None else str(snap.running)
    waiting = NA if snap.waiting is None else str(snap.waiting)
    requests = Text(f"{running} running · {waiting} waiting")
    if snap.preemptions:
        requests.append(f" · {snap.preemptions} preempted", style="yellow")
    grid.add_row("KV tokens", kv, "Requests", requests)
    grid.add_row("Prefix hit", percent(snap.prefix_hit_rate), "TTFT",
                 f"p50 {seconds(snap.ttft_p50)} · p95 {seconds(snap.ttft_p95)}")
    grid.add_row("Source", _source(snap), "TPOT",
                 f"p50 {seconds(snap.tpot_p50)} · p95 {seconds(snap.tpot_p95)}")
    if snap.spec_acceptance_rate is not None:
        length = snap.spec_mean_accepted_length
        grid.add_row("Spec accept", percent(snap.spec_acceptance_rate), "Accepted len",
                     NA if length is None else f"{length:.2f} tok/step")
    if host is not None and host.cpu_pct is not None:
        service = (NA if host.child_cpu_pct is None
                   else f"CPU {host.child_cpu_pct:.0f}% · RSS {gib(host.child_rss)}")
        grid.add_row("Host", f"CPU {host.cpu_pct:.0f}% · RAM {gib(host.ram_used)}/"
                             f"{gib(host.ram_total)}", "Service", service)
    params = _parameters(snap)
    if params:  # our /v1/status only
        grid.add_row("Params", params, "", "")
    return grid


def _parameters(snap: ServerSnapshot) -> str:
    total, active = snap.config.get("parameters"), snap.config.get("active_parameters")
    if not isinstance(total, int | float):
        return ""
    if isinstance(active, int | float) and active < total:
        return f"{billions(total)} · {billions(active)} active per token"
    return billions(total)


def _source(snap: ServerSnapshot) -> str:
    return {"status": "/v1/status", "homelab_llm": "/metrics (homelab)", "vllm": "/metrics (vLLM)",
            "sglang": "/metrics (SGLang)", "llama.cpp": "/metrics (llama.cpp)"}.get(snap.source, NA)


class EngineStats(Static):
    def show(self, snap: ServerSnapshot, host: HostReading | None = None) -> None:
        self.update(stats_table(snap, host))
