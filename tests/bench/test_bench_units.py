"""The small pieces: prompt sizing, traces, flag parsing, table layout, lazy imports."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from homelab_llm.bench.client import BenchError, normalize_base_url
from homelab_llm.bench.command import _int_list
from homelab_llm.bench.metrics import Stat
from homelab_llm.bench.prompts import TokenCounter, synth_text, text_of_tokens
from homelab_llm.bench.replay import Trace, TurnSpec, list_traces, load_trace
from homelab_llm.bench.report import render_table, sweep_table
from homelab_llm.bench.sweep import BenchRow, SweepReport

ROOT = Path(__file__).resolve().parents[2]


def test_synth_text_is_deterministic_and_prefix_stable():
    assert synth_text(50, 3) == synth_text(50, 3)
    assert synth_text(50, 3) != synth_text(50, 4)
    # More words from the same seed extend the text (only the cut sentence differs: it is
    # at most 20 words long), so sizing corrections do not reshuffle the prompt.
    assert synth_text(40, 3).split()[:20] == synth_text(80, 3).split()[:20]
    assert synth_text(40, 3)[:-1] in synth_text(80, 3) or synth_text(80, 3).startswith(
        synth_text(40, 3).rsplit(". ", 1)[0])


async def test_text_of_tokens_converges_on_a_two_tokens_per_word_counter():
    async def count(text: str) -> int:
        return 2 * len(text.split()) + 3  # a template-ish constant, too

    text, n = await text_of_tokens(TokenCounter("test", count), 201, seed=1)
    assert abs(n - 201) <= 1 and n == 2 * len(text.split()) + 3


async def test_estimate_counter_counts_words():
    counter = TokenCounter.estimate()
    assert counter.source.startswith("estimate")
    assert await counter.count("one two  three") == 3
    text, n = await text_of_tokens(counter, 100, seed=0)
    assert n == 100


def test_shipped_traces_match_the_generator_and_reach_their_sizes():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_traces.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {"agent-120k", "agent-cpu"} <= set(list_traces())
    big = load_trace("agent-120k")
    assert len(big.turns) == 16
    words = len(" ".join(m["content"] for m in big.messages(15, salt="")).split())
    # ~1.08 tokens/word on Llama-family tokenizers (SmolLM2 measured 119,948 with template).
    assert 105_000 <= words <= 115_000
    small = load_trace("agent-cpu")
    assert len(" ".join(m["content"] for m in small.messages(5)).split()) < 1_500


def test_trace_roundtrip_history_and_bad_files(tmp_path):
    trace = Trace("t", "d", 5, 10, (TurnSpec(4, 3, 8), TurnSpec(6, 2, 8)))
    assert Trace.loads(trace.dumps()) == trace
    msgs = trace.messages(1, salt="abc")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Session abc. ")
    assert msgs[:3] == trace.messages(1, salt="abc")[:3]  # same history every time
    (tmp_path / "bad.jsonl").write_text('{"type": "turn"}\n')
    with pytest.raises(BenchError, match="not a valid trace"):
        load_trace(str(tmp_path / "bad.jsonl"))


def test_flag_parsing():
    assert _int_list("0,4096, 8K,16k") == (0, 4096, 8192, 16384)
    with pytest.raises(argparse.ArgumentTypeError):
        _int_list("0,four")
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    with pytest.raises(BenchError):
        normalize_base_url("h:8000")


def test_tables_align_and_markdown_has_one_cell_per_column():
    t = render_table(["a", "num"], [["x", "1.5"], ["longer", "10.25"]])
    lines = t.splitlines()
    assert lines[2].index("1.5") + 3 == lines[3].index("10.25") + 5  # right-aligned numbers
    md = render_table(["a", "num"], [["x", "1.5"]], markdown=True).splitlines()
    assert md == ["| a | num |", "|:--|----:|", "| x | 1.5 |"]

    stat = Stat.of([10.0, 12.0])
    row = BenchRow("cold", 4096, 2048, 128, 1, 2, 0, stat, stat, stat, stat, stat, stat,
                   2048.0, None, 128.0)
    report = SweepReport("depth", "m", "http://x", token_source="server /tokenize", rows=[row])
    table = sweep_table(report, markdown=True)
    cells = [c.strip() for c in table.splitlines()[2].split("|")[1:-1]]
    assert cells == ["m", "pp2048 @ d4096", "11.00 ± 1.00", "11000.00 ± 1000.00",
                     "11000.00 ± 1000.00", "11000.00 ± 1000.00"]  # times in ms
    assert "prompt tokens: server /tokenize" in table


def test_command_module_does_not_import_torch():
    code = ("import sys; import homelab_llm.bench.command as c, homelab_llm.bench.offline, "
            "homelab_llm.bench.report, homelab_llm.bench.plots; "
            "print('torch' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


@pytest.mark.skipif(importlib.util.find_spec("rich") is None, reason="rich not installed")
def test_progress_is_silent_off_a_terminal(capsys):
    from homelab_llm.bench.progress import TerminalProgress
    from homelab_llm.bench.sweep import ProgressEvent

    with TerminalProgress("t") as progress:  # pytest's stderr is not a tty
        progress(ProgressEvent(1, 2, "x"))
    assert capsys.readouterr().err == ""
