"""Read one server's state: our /v1/status when it has one, else Prometheus /metrics in the
vLLM, SGLang, llama.cpp or homelab_llm dialect. One poll -> one ServerSnapshot.

Rates (tok/s) from Prometheus come from counter deltas between two polls, so the probe keeps
the previous counters; the first poll after connecting shows no rate rather than a wrong one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from homelab_llm.tui.prometheus import Metrics, parse_prometheus
from homelab_llm.tui.snapshot import DeviceMemory, ServerSnapshot

# dialect -> field -> metric names, first present wins. vLLM's v0 names follow the v1 ones.
DIALECTS: dict[str, dict[str, tuple[str, ...]]] = {
    "homelab_llm": {
        "running": ("homelab_llm:num_requests_running",),
        "waiting": ("homelab_llm:num_requests_waiting",),
        "kv_usage": ("homelab_llm:kv_cache_usage_perc",),
        "prefix_queries": ("homelab_llm:prefix_cache_queries_total", "homelab_llm:prefix_cache_queries"),
        "prefix_hits": ("homelab_llm:prefix_cache_hits_total", "homelab_llm:prefix_cache_hits"),
        "prompt_tokens": ("homelab_llm:prompt_tokens_total", "homelab_llm:prompt_tokens"),
        "generation_tokens": ("homelab_llm:generation_tokens_total", "homelab_llm:generation_tokens"),
        "preemptions": ("homelab_llm:num_preemptions_total", "homelab_llm:num_preemptions"),
        "ttft": ("homelab_llm:time_to_first_token_seconds",),
        "tpot": ("homelab_llm:time_per_output_token_seconds",),
    },
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "generation_tokens": ("vllm:generation_tokens_total",),
        "preemptions": ("vllm:num_preemptions_total",),
        "ttft": ("vllm:time_to_first_token_seconds",),
        "tpot": ("vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        "kv_used": ("sglang:num_used_tokens",),
        "kv_capacity": ("sglang:max_total_num_tokens",),
        "hit_rate": ("sglang:cache_hit_rate",),
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "generation_tokens": ("sglang:generation_tokens_total",),
        "generation_tps": ("sglang:gen_throughput",),
        "ttft": ("sglang:time_to_first_token_seconds",),
        "tpot": ("sglang:time_per_output_token_seconds", "sglang:inter_token_latency_seconds"),
    },
    "llama.cpp": {
        "running": ("llamacpp:requests_processing",),
        "waiting": ("llamacpp:requests_deferred",),
        "kv_usage": ("llamacpp:kv_cache_usage_ratio",),
        "kv_used": ("llamacpp:kv_cache_tokens",),
        "prompt_tokens": ("llamacpp:prompt_tokens_total",),
        "generation_tokens": ("llamacpp:tokens_predicted_total",),
        "prompt_tps": ("llamacpp:prompt_tokens_seconds",),
        "generation_tps": ("llamacpp:predicted_tokens_seconds",),
    },
}
_PREFIXES = {"homelab_llm:": "homelab_llm", "vllm:": "vllm", "sglang:": "sglang",
             "llamacpp:": "llama.cpp"}


def detect_dialect(metrics: Metrics) -> str | None:
    for name in metrics.names():
        for prefix, dialect in _PREFIXES.items():
            if name.startswith(prefix):
                return dialect
    return None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    number = _num(value)
    return int(number) if number is not None else None


def snapshot_from_status(data: Mapping[str, Any]) -> ServerSnapshot:
    """Our /v1/status JSON (DESIGN.md) -> snapshot. Missing sections become None, not errors."""
    def section(name: str) -> Mapping[str, Any]:
        value = data.get(name)
        return value if isinstance(value, Mapping) else {}

    kv, requests, prefix = section("kv"), section("requests"), section("prefix_cache")
    throughput, latency, spec = section("throughput"), section("latency"), section("spec_decode")
    config = dict(section("config") or section("engine"))
    devices = []
    for dev in data.get("devices") or []:
        if isinstance(dev, Mapping):
            devices.append(DeviceMemory(
                name=str(dev.get("name", "?")), total=_int(dev.get("total")) or 0,
                weights=_int(dev.get("weights")) or 0,
                activations=_int(dev.get("activations_peak", dev.get("activations"))) or 0,
                graphs=_int(dev.get("graphs")) or 0, kv_cache=_int(dev.get("kv_cache")) or 0,
                state=_int(dev.get("state")) or 0,  # absent before hybrid support: none
                other=_int(dev.get("other")) or 0, free=_int(dev.get("free")) or 0))
    used, capacity = _int(kv.get("tokens_used")), _int(kv.get("tokens_capacity"))
    queries, hits = _num(prefix.get("query_tokens")), _num(prefix.get("hit_tokens"))
    model = data.get("model") or config.get("served_model_name") or config.get("model") or ""
    return ServerSnapshot(
        source="status", ok=True, model=str(model), devices=tuple(devices),
        kv_dtype=str(kv.get("dtype", "")), kv_tokens_used=used, kv_tokens_capacity=capacity,
        kv_usage=(used / capacity) if used is not None and capacity else None,
        running=_int(requests.get("running")), waiting=_int(requests.get("waiting")),
        prefix_hit_rate=(hits / queries) if hits is not None and queries else None,
        prompt_tps=_num(throughput.get("prompt_tps")),
        generation_tps=_num(throughput.get("generation_tps")),
        ttft_p50=_num(latency.get("ttft_p50")), ttft_p95=_num(latency.get("ttft_p95")),
        tpot_p50=_num(latency.get("tpot_p50")), tpot_p95=_num(latency.get("tpot_p95")), uptime_s=_num(data.get("uptime")), config=config,
        spec_acceptance_rate=_num(spec.get("acceptance_rate")),
        spec_mean_accepted_length=_num(spec.get("mean_accepted_length")))


class CounterRates:
    """tok/s from monotonically increasing counters sampled at two moments."""

    def __init__(self) -> None:
        self._previous: dict[str, tuple[float, float]] = {}

    def rate(self, key: str, value: float | None, now: float) -> float | None:
        if value is None:
            return None
        previous = self._previous.get(key)
        self._previous[key] = (now, value)
        if previous is None or now <= previous[0] or value < previous[1]:  # first poll or a restart
            return None
        return (value - previous[1]) / (now - previous[0])


def snapshot_from_metrics(metrics: Metrics, rates: CounterRates, now: float) -> ServerSnapshot:
    dialect = detect_dialect(metrics)
    if dialect is None:
        return ServerSnapshot(source="none", error="/metrics has no vLLM, SGLang, llama.cpp or "
                                                   "homelab_llm metrics")
    names = DIALECTS[dialect]

    def get(key: str) -> float | None:
        return metrics.total(*names.get(key, ()))

    def quantile(key: str, q: float) -> float | None:
        for base in names.get(key, ()):
            value = metrics.histogram_quantile(base, q)
            if value is not None:
                return value
        return None

    kv_usage, kv_used, kv_capacity = get("kv_usage"), get("kv_used"), get("kv_capacity")
    if kv_capacity is None and dialect == "vllm":
        info = metrics.first("vllm:cache_config_info")  # capacity lives in this gauge's labels
        if info is not None:
            try:
                kv_capacity = float(info.labels["num_gpu_blocks"]) * float(info.labels["block_size"])
            except (KeyError, ValueError):
                kv_capacity = None
    if kv_capacity is None and kv_used is not None and kv_usage:
        kv_capacity = kv_used / kv_usage
    if kv_used is None and kv_usage is not None and kv_capacity is not None:
        kv_used = kv_usage * kv_capacity
    queries, hits, hit_rate = get("prefix_queries"), get("prefix_hits"), get("hit_rate")
    if hit_rate is None and queries:
        hit_rate = (hits or 0.0) / queries
    prompt_tps = rates.rate("prompt", get("prompt_tokens"), now)
    generation_tps = rates.rate("generation", get("generation_tokens"), now)
    model = ""
    for samples in metrics.by_name.values():
        labels = samples[0].labels
        model = labels.get("model_name") or labels.get("name") or ""
        if model:
            break
    preemptions = get("preemptions")
    return ServerSnapshot(
        source=dialect, ok=True, model=model,
        kv_tokens_used=int(kv_used) if kv_used is not None else None,
        kv_tokens_capacity=int(kv_capacity) if kv_capacity is not None else None,
        kv_usage=kv_usage, running=_int(get("running")), waiting=_int(get("waiting")),
        prefix_hit_rate=hit_rate,
        prompt_tps=prompt_tps if prompt_tps is not None else get("prompt_tps"),
        generation_tps=generation_tps if generation_tps is not None else get("generation_tps"),
        ttft_p50=quantile("ttft", 0.5), ttft_p95=quantile("ttft", 0.95),
        tpot_p50=quantile("tpot", 0.5),
        preemptions=int(preemptions) if preemptions is not None else None)


class Probe:
    """Polls one base URL. Blocking on purpose: the app calls it from a thread worker, so a slow
    or hung server never stalls the UI; each call is bounded by timeout_s."""

    def __init__(self, base_url: str, *, timeout_s: float = 2.0, api_key: str | None = None,
                 transport: httpx.BaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers,
                                    transport=transport)
        self._clock = clock
        self._rates = CounterRates()
        self._has_status: bool | None = None  # learnt on the first answer; vLLM has no /v1/status

    def poll(self) -> ServerSnapshot:
        try:
            if self._has_status is not False:
                response = self._client.get("/v1/status")
                if response.status_code == 200:
                    self._has_status = True
                    return snapshot_from_status(response.json())
                if response.status_code in (404, 405):
                    self._has_status = False
            response = self._client.get("/metrics")
            response.raise_for_status()
            return snapshot_from_metrics(parse_prometheus(response.text), self._rates, self._clock())
        except (httpx.HTTPError, ValueError) as err:
            return ServerSnapshot(source="none", ok=False, error=_describe(err, self.base_url))

    def close(self) -> None:
        self._client.close()


def _describe(err: Exception, url: str) -> str:
    if isinstance(err, httpx.ConnectError):
        return f"no server at {url}"
    if isinstance(err, httpx.TimeoutException):
        return f"{url} did not answer in time"
    if isinstance(err, httpx.HTTPStatusError):
        return f"{url}{err.request.url.path} answered HTTP {err.response.status_code}"
    return f"{url}: {err}"
