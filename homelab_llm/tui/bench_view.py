"""Bench results as the Bench screen shows them: table columns and rows, and chart series, per
kind of sweep. Pure functions of a report, so the screen stays thin and the snapshot data is
easy to build."""

from __future__ import annotations

from rich.text import Text

from homelab_llm.bench.metrics import Stat
from homelab_llm.bench.replay import ReplayReport
from homelab_llm.bench.sweep import BenchRow, SweepReport
from homelab_llm.tui.widgets.bar_chart import BarGroup
from homelab_llm.tui.widgets.format import NA, rate, seconds

Report = SweepReport | ReplayReport
ROW_ERROR_CHARS = 70  # the table scrolls sideways; the full text is in the summary line


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def point_label(row: BenchRow, kind: str) -> str:
    if kind == "concurrency":
        label = f"c{row.concurrency}" + (f" @ d{row.depth}" if row.depth else "")
    else:
        label = f"d{row.depth}"
    return label + (" cached" if row.mode == "cached" else "")


def _stat_rate(stat: Stat) -> str:
    if stat.mean is None:
        return NA
    spread = f" ±{rate(stat.std)}" if stat.n > 1 and stat.std else ""
    return rate(stat.mean) + spread


def columns(kind: str) -> tuple[str, ...]:
    if kind == "replay":
        return ("turn", "prompt", "cached", "new", "TTFT", "gen t/s", "e2e")
    if kind == "concurrency":
        return ("point", "pp t/s (total)", "gen t/s (total)", "gen t/s/stream", "TTFT", "runs")
    return ("point", "prompt t/s", "gen t/s", "TTFT", "runs")


def table_rows(report: Report) -> list[tuple[str | Text, ...]]:
    if isinstance(report, ReplayReport):
        out: list[tuple[str | Text, ...]] = []
        for t in report.turns:
            if t.error is not None:
                out.append((str(t.turn), Text(f"failed: {t.error}", style="red"), "", "", "", "", ""))
                continue
            out.append((str(t.turn), _count(t.prompt_tokens), _count(t.cached_tokens),
                        _count(t.new_tokens), seconds(t.ttft_s), rate(t.tg_tps), seconds(t.e2el_s)))
        return out
    rows: list[tuple[str | Text, ...]] = []
    for r in report.rows:
        runs: str | Text = str(r.runs)
        if r.failed:  # the server's reason in the row itself (a 400 over max_model_len...)
            reason = r.errors[0] if r.errors else "no reason given"
            runs = Text(f"{r.runs} ({r.failed} failed: {clip(reason, ROW_ERROR_CHARS)})", style="red")
        if report.kind == "concurrency":
            rows.append((point_label(r, "concurrency"), _stat_rate(r.pp_tps), _stat_rate(r.tg_tps),
                         _stat_rate(r.tg_tps_stream), seconds(r.ttft_s.mean), runs))
        else:
            rows.append((point_label(r, "depth"), _stat_rate(r.pp_tps), _stat_rate(r.tg_tps),
                         seconds(r.ttft_s.mean), runs))
    return rows


def results_title(report: Report) -> str:
    """The table's title carries what every row shares, so the columns hold only what varies."""
    if isinstance(report, ReplayReport):
        return f"Results · {report.trace}" if report.turns else "Results"
    if not report.rows:
        return "Results"
    first = report.rows[0]
    return f"Results · pp{first.pp} tg{first.tg}"


def _count(n: int | None) -> str:
    return NA if n is None else f"{n:,}"


def chart_groups(report: Report) -> list[BarGroup]:
    if isinstance(report, ReplayReport):
        ok = [t for t in report.turns if t.error is None]
        return [
            BarGroup("time to first token per turn", tuple(
                (f"turn {t.turn}", None if t.ttft_s is None else t.ttft_s * 1e3) for t in ok),
                unit="ms", style="yellow", digits=0),
            BarGroup("generation per turn", tuple((f"turn {t.turn}", t.tg_tps) for t in ok),
                     unit="tok/s", style="green"),
        ]
    kind = report.kind
    labels = [point_label(r, kind) for r in report.rows]
    pp = tuple(zip(labels, (r.pp_tps.mean for r in report.rows)))
    tg = tuple(zip(labels, (r.tg_tps.mean for r in report.rows)))
    if kind == "concurrency":
        stream = tuple(zip(labels, (r.tg_tps_stream.mean for r in report.rows)))
        return [BarGroup("generation, all streams", tg, unit="tok/s", style="green"),
                BarGroup("generation, per stream", stream, unit="tok/s", style="cyan"),
                BarGroup("prompt processing, all streams", pp, unit="tok/s", style="magenta")]
    return [BarGroup("prompt processing by context depth", pp, unit="tok/s", style="magenta"),
            BarGroup("generation by context depth", tg, unit="tok/s", style="green")]


def summary_line(report: Report) -> str:
    """Where the numbers came from, in one line (the CLI table's footer, shortened)."""
    if isinstance(report, ReplayReport):
        failed = sum(1 for t in report.turns if t.error is not None)
        parts = [f"trace {report.trace}", f"model {report.model or '?'}", report.target]
        if failed:
            parts.append(f"{failed} turn(s) failed")
    else:
        failed = sum(r.failed for r in report.rows)
        parts = [f"model {report.model or '?'}", report.target,
                 f"prompt tokens: {report.token_source or 'n/a'}",
                 f"latency {report.latency_s * 1e3:.1f} ms"]
        if failed:
            parts.append(f"{failed} request(s) failed")
    if report.interrupted:
        parts.append("partial results")
    return " · ".join(parts)


def first_error(report: Report) -> str | None:
    if isinstance(report, ReplayReport):
        return next((t.error for t in report.turns if t.error), None)
    return next((r.errors[0] for r in report.rows if r.errors), None)
