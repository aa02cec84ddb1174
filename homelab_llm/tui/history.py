"""Recent samples per named series ("gpu/0000:03:00.0/load", "host/cpu", ...) for the charts.

A series starts when its first real value arrives; a None reading (sensor absent) adds nothing,
so a chart never draws a made-up zero."""

from __future__ import annotations

from collections import deque

HISTORY_POINTS = 120  # one minute at 2 Hz, two at 1 Hz


class History:
    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.points = points
        self.series: dict[str, deque[float]] = {}

    def add(self, key: str, value: float | None) -> None:
        if value is None:
            return
        self.series.setdefault(key, deque(maxlen=self.points)).append(float(value))

    def get(self, key: str) -> list[float]:
        return list(self.series.get(key, ()))

    def latest(self, key: str) -> float | None:
        values = self.series.get(key)
        return values[-1] if values else None
