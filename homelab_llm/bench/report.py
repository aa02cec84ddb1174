"""Bench results as text: aligned terminal tables, markdown (llama-benchy's column layout, so our
rows paste next to theirs), and JSON files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from homelab_llm.bench.client import BenchError
from homelab_llm.bench.metrics import Stat

if TYPE_CHECKING:
    from homelab_llm.bench.replay import ReplayReport
    from homelab_llm.bench.serve import ServeReport
    from homelab_llm.bench.sweep import BenchRow, SweepReport


def render_table(headers: list[str], rows: list[list[str]], markdown: bool = False,
                 left: int = 1) -> str:
    """The first `left` columns align left, the rest (numbers) right."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        parts = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(parts) + " |" if markdown else "  ".join(parts).rstrip()

    rule = ("|" + "|".join((":" + "-" * (w + 1)) if i < left else ("-" * (w + 1) + ":")
                           for i, w in enumerate(widths)) + "|") if markdown else \
        "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(r) for r in rows])


def fmt_stat(stat: Stat, scale: float = 1.0) -> str:
    if stat.mean is None:
        return ""
    return f"{stat.mean * scale:.2f} ± {(stat.std or 0.0) * scale:.2f}"


def fmt(x: float | int | None, digits: int = 2, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return str(x) if isinstance(x, int) and scale == 1.0 else f"{x * scale:.{digits}f}"


def sweep_table(report: "SweepReport", markdown: bool = False) -> str:
    """llama-benchy's layout: a ppN row and a tgN row per point; `c` and per-stream columns
    appear only when some point ran more than one stream."""
    multi = any(r.concurrency > 1 for r in report.rows)
    headers = ["model", "test"] + (["c"] if multi else []) + [
        "t/s (total)" if multi else "t/s"] + (["t/s per stream"] if multi else []) + [
        "ttfr (ms)", "est_ppt (ms)", "e2e_ttft (ms)"]
    rows = []
    for r in report.rows:
        suffix = (f" @ d{r.depth}" if r.depth else "") + (" (cached)" if r.mode == "cached" else "")
        c = [str(r.concurrency)] if multi else []
        rows.append([report.model, f"pp{r.pp}{suffix}", *c, fmt_stat(r.pp_tps),
                     *([""] if multi else []), fmt_stat(r.ttfr_s, 1e3), fmt_stat(r.est_ppt_s, 1e3),
                     fmt_stat(r.ttft_s, 1e3)])
        rows.append([report.model, f"tg{r.tg}{suffix}", *c, fmt_stat(r.tg_tps),
                     *([fmt_stat(r.tg_tps_stream)] if multi else []), "", "", ""])
    return render_table(headers, rows, markdown, left=2) + "\n\n" + _footer(report)


def _footer(report: "SweepReport") -> str:
    failed = sum(r.failed for r in report.rows)
    parts = [f"homelab-llm bench {report.kind}", f"date: {report.date}", f"target: {report.target}",
             f"prompt tokens: {report.token_source or 'n/a'}",
             f"output tokens: {report.output_token_source or 'n/a'}",
             f"latency: {report.latency_s * 1e3:.2f} ms"]
    if failed:
        parts.append(f"failed requests: {failed}")
    if report.interrupted:
        parts.append("INTERRUPTED: partial results")
    # The server's own words for each failing point, so a 400 is never just a count.
    errors = [f"error at {_point(r)}: {r.errors[0]}" for r in report.rows if r.errors]
    return "\n".join([" | ".join(parts), *errors])


def _point(row: "BenchRow") -> str:
    return (f"pp{row.pp} tg{row.tg} @ d{row.depth}" + (f" c{row.concurrency}" if row.concurrency > 1
                                                       else ""))


def replay_table(report: "ReplayReport", markdown: bool = False) -> str:
    headers = ["turn", "prompt", "cached", "new", "out", "ttft (ms)", "tg t/s", "e2el (s)"]
    rows = [[str(t.turn), fmt(t.prompt_tokens), fmt(t.cached_tokens), fmt(t.new_tokens),
             fmt(t.output_tokens), fmt(t.ttft_s, 1, 1e3), fmt(t.tg_tps), fmt(t.e2el_s, 3)]
            if t.error is None else [str(t.turn), "", "", "", "", "failed", "", ""]
            for t in report.turns]
    s = report.summary()
    lines = [render_table(headers, rows, markdown), ""]
    lines += [f"turn {t.turn} failed: {t.error}" for t in report.turns if t.error is not None]
    for name, label, scale in (("ttft_s", "TTFT (ms)", 1e3), ("tg_tps", "TG t/s", 1.0)):
        m = s[name]
        assert isinstance(m, dict)
        worst = (f"worst {fmt(m['worst'], 1, scale)} (turn {m['worst_turn']})"
                 if m["worst"] is not None else "")
        lines.append(f"{label}: mean {fmt(m['mean'], 1, scale)}, median {fmt(m['median'], 1, scale)}, "
                     f"CV {fmt(m['cv'], 3)}, {worst}")
    tail = ["homelab-llm bench replay", f"trace: {report.trace}", f"model: {report.model}",
            f"date: {report.date}", f"target: {report.target}"]
    if s["failed"]:
        tail.append(f"failed turns: {s['failed']}")
    if report.interrupted:
        tail.append("INTERRUPTED: partial results")
    return "\n".join(lines + ["", " | ".join(tail)])


def serve_table(report: "ServeReport", markdown: bool = False) -> str:
    m = report.metrics()
    headers = ["metric (ms)", "mean", "p50", "p90", "p99"]
    rows = []
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2el_s", "E2EL")):
        st = m[key]
        assert isinstance(st, dict)
        rows.append([label] + [fmt(st[q], 2, 1e3) for q in ("mean", "p50", "p90", "p99")])
    cfg = report.config
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    summary = [
        ["successful requests", fmt(m["completed"])], ["failed requests", fmt(m["failed"])],
        ["duration (s)", fmt(m["duration_s"])],
        ["request throughput (req/s)", fmt(m["request_throughput"])],
        ["output token throughput (tok/s)", fmt(m["output_throughput"])],
        ["total token throughput (tok/s)", fmt(m["total_token_throughput"])],
        ["input / output tokens", f"{m['input_tokens']} / {m['output_tokens']}"],
    ]
    head = (f"homelab-llm bench serve | model: {report.model} | target: {report.target} | "
            f"rate: {rate} req/s | max concurrency: {cfg.max_concurrency or 'unlimited'} | "
            f"in/out: {cfg.input_len}/{cfg.output_len} | date: {report.date}")
    if report.interrupted:
        head += " | INTERRUPTED: partial results"
    errors = m["errors"]
    tail = ("\nerrors: " + "; ".join(errors)) if errors else ""  # type: ignore[arg-type]
    return "\n\n".join([render_table(["", "value"], summary, markdown),
                        render_table(headers, rows, markdown), head]) + tail


def write_json(path: str | Path, data: dict[str, object]) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as err:
        raise BenchError(f"cannot write {path}: {err.strerror or err}") from err
