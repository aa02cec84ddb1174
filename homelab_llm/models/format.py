"""How the model list reads, in the CLI table and the TUI alike: parameters as model cards write
them, sizes, context lengths, and a one-cell fit verdict."""

from __future__ import annotations

from homelab_llm.models.describe import LocalModel
from homelab_llm.models.fit import Fit


def format_params(n: int | None) -> str:
    """1.2B, 135M, 30.5B."""
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.1f}{unit}".replace(".0" + unit, unit)
    return str(n)


def params_text(model: LocalModel) -> str:
    text = format_params(model.params_total)
    if model.params_active is not None and model.params_active != model.params_total:
        text += f" ({format_params(model.params_active)} active)"
    return text


def format_size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def format_context(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def verdict_text(model: LocalModel, fit: Fit | None) -> str:
    if not model.supported:
        return "unsupported"
    if fit is None:
        return "-"
    if not fit.fits:
        return "does not fit"
    return f"{format_context(fit.max_context)} ctx, {fit.concurrency_32k}x32K"


def why_not(model: LocalModel, fit: Fit | None) -> str:
    """The reason behind an "unsupported" or "does not fit" verdict ("" otherwise)."""
    if not model.supported:
        return model.reason
    return fit.reason if fit is not None and not fit.fits else ""
