"""Just enough of the Prometheus text format to read vLLM, SGLang, llama.cpp and our /metrics:
samples with labels, sums over label sets, and quantiles from histogram buckets."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class Metrics:
    """Parsed exposition text, indexed by sample name."""

    def __init__(self, samples: list[Sample]) -> None:
        self.by_name: dict[str, list[Sample]] = defaultdict(list)
        for sample in samples:
            self.by_name[sample.name].append(sample)

    def has(self, name: str) -> bool:
        return name in self.by_name

    def names(self) -> list[str]:
        return list(self.by_name)

    def total(self, *names: str) -> float | None:
        """Sum over every label set of the first name present (several models or engines add up)."""
        for name in names:
            samples = self.by_name.get(name)
            if samples:
                return sum(s.value for s in samples)
        return None

    def first(self, name: str) -> Sample | None:
        samples = self.by_name.get(name)
        return samples[0] if samples else None

    def histogram_quantile(self, base: str, q: float) -> float | None:
        """Quantile from `<base>_bucket` like PromQL's histogram_quantile: linear inside the bucket.

        Label sets other than `le` are merged, so two engines' histograms count as one.
        """
        cumulative: dict[float, float] = defaultdict(float)
        for sample in self.by_name.get(base + "_bucket", []):
            le = sample.labels.get("le")
            if le is None:
                continue
            cumulative[math.inf if le in ("+Inf", "Inf") else float(le)] += sample.value
        if not cumulative:
            return None
        edges = sorted(cumulative)
        total = cumulative[edges[-1]]
        if total <= 0:
            return None
        rank = q * total
        lower_edge, lower_count = 0.0, 0.0
        for edge in edges:
            count = cumulative[edge]
            if count >= rank:
                if math.isinf(edge):  # in the open bucket: the best bound is the last finite edge
                    return lower_edge
                if count == lower_count:
                    return edge
                return lower_edge + (edge - lower_edge) * (rank - lower_count) / (count - lower_count)
            lower_edge, lower_count = edge, count
        return lower_edge


def parse_prometheus(text: str) -> Metrics:
    samples: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if not match:
            continue  # one odd line must not blank the whole dashboard
        name, _, label_text, value_text, _ = match.groups()
        try:
            value = float(value_text)
        except ValueError:
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") if "\\" in v else v
                  for k, v in _LABEL_RE.findall(label_text or "")}
        samples.append(Sample(name, labels, value))
    return Metrics(samples)
