"""Numbers as a person reads them on a dashboard: fixed widths, units, 'n/a' for unknown."""

from __future__ import annotations

NA = "n/a"


def gib(n: int | float | None) -> str:
    if n is None:
        return NA
    value = n / (1 << 30)
    if value >= 100:
        return f"{value:.0f}G"
    return f"{value:.1f}G" if value >= 0.95 else f"{n / (1 << 20):.0f}M"


def tokens(n: int | float | None) -> str:
    return NA if n is None else f"{int(n):,}"


def billions(n: int | float | None) -> str:
    """A parameter count: 30532122624 -> '30.5B', 596049920 -> '0.6B'."""
    return NA if n is None else f"{n / 1e9:.1f}B"


def rate(n: float | None) -> str:
    if n is None:
        return NA
    return f"{n:,.0f}" if n >= 100 else f"{n:.1f}"


def seconds(s: float | None) -> str:
    if s is None:
        return NA
    if s < 1:
        return f"{s * 1000:.0f} ms"
    return f"{s:.2f} s" if s < 60 else f"{s / 60:.1f} min"


def percent(fraction: float | None) -> str:
    return NA if fraction is None else f"{fraction * 100:.1f}%"


def duration(s: float | None) -> str:
    if s is None:
        return NA
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
