"""PNG charts of bench results (matplotlib, Agg backend: no display needed). matplotlib is
imported only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from homelab_llm.bench.client import BenchError

if TYPE_CHECKING:
    from homelab_llm.bench.replay import ReplayReport
    from homelab_llm.bench.serve import ServeReport
    from homelab_llm.bench.sweep import SweepReport


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _outdir(directory: str | Path) -> Path:
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BenchError(f"cannot create plot folder {out}: {err.strerror or err}") from err
    return out


def plot_sweep(report: "SweepReport", directory: str | Path) -> list[Path]:
    """tok/s vs depth (one line per cache mode and concurrency), or vs concurrency."""
    plt = _pyplot()
    out = _outdir(directory)
    by_concurrency = report.kind == "concurrency"
    x_name = "concurrency" if by_concurrency else "depth"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list] = {}
    for r in report.rows:
        key = r.mode if by_concurrency else f"{r.mode}" + (f", c{r.concurrency}" if r.concurrency > 1 else "")
        series.setdefault(key, []).append(r)
    for key, rows in series.items():
        xs = [getattr(r, x_name) for r in rows]
        for ax, metric in zip(axes, ("pp_tps", "tg_tps")):
            ys = [getattr(r, metric).mean for r in rows]
            errs = [getattr(r, metric).std or 0.0 for r in rows]
            pts = [(x, y, e) for x, y, e in zip(xs, ys, errs) if y is not None]
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                            marker="o", capsize=3, label=key)
        if by_concurrency:
            pts = [(r.concurrency, r.tg_tps_stream.mean) for r in rows if r.tg_tps_stream.mean]
            if pts:
                axes[1].plot(*zip(*pts), marker="s", linestyle="--", label=f"{key}, per stream")
    for ax, title in zip(axes, (f"prompt processing (pp{_first(report, 'pp')})",
                                f"token generation (tg{_first(report, 'tg')})")):
        ax.set_xlabel("concurrent streams" if by_concurrency else "context depth (tokens)")
        ax.set_ylabel("tok/s" + (" (total)" if by_concurrency else ""))
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"{report.model} — {report.target}")
    fig.tight_layout()
    path = out / f"tps_vs_{x_name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def _first(report: "SweepReport", name: str) -> str:
    return str(getattr(report.rows[0], name)) if report.rows else "?"


def plot_replay(report: "ReplayReport", directory: str | Path) -> list[Path]:
    """Per-turn TTFT bars, with the new (uncached) tokens of each turn on a second axis."""
    plt = _pyplot()
    out = _outdir(directory)
    ok = [t for t in report.turns if t.error is None and t.ttft_s is not None]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([t.turn for t in ok], [t.ttft_s * 1e3 for t in ok], color="tab:blue", label="TTFT")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    new = [(t.turn, t.new_tokens) for t in ok if t.new_tokens is not None]
    if new:
        ax2 = ax.twinx()
        ax2.plot(*zip(*new), color="tab:orange", marker="o", label="new tokens")
        ax2.set_ylabel("new (uncached) prompt tokens")
        ax2.set_ylim(bottom=0)
    ax.set_title(f"{report.trace}: per-turn TTFT — {report.model}")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "replay_ttft_per_turn.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_serve(report: "ServeReport", directory: str | Path) -> list[Path]:
    """Distributions (CDFs) of TTFT and E2EL over the requests."""
    plt = _pyplot()
    out = _outdir(directory)
    ok = report.completed
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, values in ((axes[0], "TTFT", [t.ttft for t in ok if t.ttft is not None]),
                             (axes[1], "E2EL", [t.e2el for t in ok if t.e2el is not None])):
        xs = sorted(v * 1e3 for v in values)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"bench serve — {report.model}")
    fig.tight_layout()
    path = out / "serve_latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
