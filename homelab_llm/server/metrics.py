"""/metrics in the Prometheus text format (0.0.4), hand-written to avoid a dependency. Names are
`homelab_llm:*` with the meaning of vLLM's `vllm:*`, so existing dashboards port by renaming."""

from __future__ import annotations

from typing import Any

from homelab_llm.server.stats import Histogram, ServerStats
from homelab_llm.server.status import kv_usage, num_preemptions

PREFIX = "homelab_llm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Writer:
    def __init__(self, model_name: str) -> None:
        self.lines: list[str] = []
        self.base = f'model_name="{_escape(model_name)}"'

    def _head(self, name: str, kind: str, help_text: str) -> str:
        full = PREFIX + name
        self.lines.append(f"# HELP {full} {help_text}")
        self.lines.append(f"# TYPE {full} {kind}")
        return full

    def _labels(self, extra: str = "") -> str:
        return "{" + self.base + (("," + extra) if extra else "") + "}"

    def scalar(self, name: str, kind: str, help_text: str, value: float) -> None:
        full = self._head(name, kind, help_text)
        self.lines.append(f"{full}{self._labels()} {_num(value)}")

    def labelled(self, name: str, help_text: str, label: str, values: dict[str, float]) -> None:
        full = self._head(name, "counter", help_text)
        for key, value in sorted(values.items()):
            labels = self._labels(f'{label}="{_escape(key)}"')
            self.lines.append(f"{full}{labels} {_num(value)}")

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        full = self._head(name, "histogram", help_text)
        for le, count in hist.cumulative():
            labels = self._labels(f'le="{le}"')
            self.lines.append(f"{full}_bucket{labels} {count}")
        self.lines.append(f"{full}_sum{self._labels()} {_num(hist.total)}")
        self.lines.append(f"{full}_count{self._labels()} {hist.count}")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _spec_decode(w: _Writer, spec: dict[str, Any]) -> None:
    """vLLM's spec_decode counters (present only while speculation is on)."""
    w.scalar("spec_decode_num_drafts_total", "counter", "Draft proposals verified (one per sequence "
             "per step).", spec.get("drafts", 0))
    w.scalar("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
             spec.get("draft_tokens", 0))
    w.scalar("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
             spec.get("accepted_tokens", 0))
    per_pos = spec.get("accepted_per_position", [])
    w.labelled("spec_decode_num_accepted_tokens_per_pos_total", "Draft tokens accepted, by position "
               "in the draft.", "position", {str(i): v for i, v in enumerate(per_pos)})


def render_metrics(engine_status: dict[str, Any], stats: ServerStats, model_name: str) -> str:
    w = _Writer(model_name)
    requests = engine_status.get("requests", {})
    prefix = engine_status.get("prefix_cache", {})
    w.scalar("num_requests_running", "gauge", "Requests in the running batch.",
             requests.get("running", 0))
    w.scalar("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
             requests.get("waiting", 0))
    w.scalar("kv_cache_usage_perc", "gauge", "KV cache usage; 1 means 100 percent.",
             kv_usage(engine_status))
    w.scalar("prefix_cache_queries_total", "counter",
             "Prompt tokens looked up in the prefix cache.", prefix.get("query_tokens", 0))
    w.scalar("prefix_cache_hits_total", "counter",
             "Prompt tokens served from the prefix cache.", prefix.get("hit_tokens", 0))
    w.scalar("prefix_cache_state_snapshot_hits_total", "counter",
             "Hybrid models: prefix matches resumed from a recurrent-state snapshot.",
             prefix.get("state_snapshot_hits", 0))
    w.scalar("prefix_cache_state_snapshots", "gauge",
             "Hybrid models: recurrent-state snapshots held by the prefix cache.",
             prefix.get("state_snapshots_held", 0))
    w.scalar("num_preemptions_total", "counter", "Preemptions of running requests.",
             num_preemptions(engine_status))
    w.scalar("prompt_tokens_total", "counter", "Prompt tokens processed.", stats.prompt_tokens_total)
    w.scalar("generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens_total)
    spec = engine_status.get("spec_decode")
    if spec is not None:
        _spec_decode(w, spec)
    w.labelled("request_success_total", "Finished requests by finish reason.", "finished_reason",
               dict(stats.finished))
    w.histogram("time_to_first_token_seconds", "Time to first token.", stats.ttft)
    w.histogram("time_per_output_token_seconds", "Time per output token after the first.", stats.tpot)
    w.histogram("e2e_request_latency_seconds", "End-to-end request latency.", stats.e2e)
    return "\n".join(w.lines) + "\n"
