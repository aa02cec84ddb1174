"""CLI texts a new user reads: whole help texts, the example build file, plan's units and its
suggestions, and the README's commands table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from homelab_llm.cli import build_parser, main
from homelab_llm.hwcheck.build_file import example_toml
from homelab_llm.hwcheck.catalog import load_build
from homelab_llm.hwcheck.plan_command import Memory, parse_memory

ROOT = Path(__file__).parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_top_level_help_is_whole_sentences(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "benchmarks." in out and "already running." in out
    assert "imported" not in out  # the old text stopped mid-sentence there


def test_every_serve_flag_explains_itself() -> None:
    parser = build_parser(["serve"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    missing = [a.option_strings[0] for a in serve._actions
               if a.option_strings and a.dest != "help" and not a.help]
    assert missing == []
    assert serve.description.endswith(".") and "flags on the command line override" in \
        serve.description  # the whole docstring, not its first line cut mid-sentence


def test_hwcheck_build_example_is_a_valid_build(tmp_path: Path, capsys) -> None:
    target = tmp_path / "my-pc.toml"
    rc, out, _ = run(capsys, "hwcheck", "build", "--example", str(target))
    assert rc == 0 and "wrote" in out
    assert target.read_text() == example_toml() and target.read_text().startswith("# ")
    build = load_build(target)
    assert [p.slot for p in build.placements] == ["PCIEX16_1", "PCIEX16_2"]
    rc, out, _ = run(capsys, "hwcheck", "build", str(target))
    assert "overall: pass" in out
    rc, _, err = run(capsys, "hwcheck", "build", "--example", str(target))
    assert rc == 2 and "exists already" in err  # never overwrites
    rc, _, err = run(capsys, "hwcheck", "build")
    assert rc == 2 and "--example" in err


def test_plan_needs_a_unit_and_answers_in_it(capsys) -> None:
    assert parse_memory("24GiB") == Memory(24 << 30, "GiB")
    assert parse_memory("24 gb") == Memory(24 * 10**9, "GB")
    assert parse_memory("25753026560") == Memory(25753026560, "GB")  # an exact byte count
    for bad in ("24", "lots", "-1GiB", "GiB"):
        with pytest.raises(argparse.ArgumentTypeError, match="needs a unit"):
            parse_memory(bad)
    with pytest.raises(SystemExit):
        main(["plan", "Qwen3-8B", "--gpu-memory", "24"])
    assert "needs a unit" in capsys.readouterr().err
    _, out, _ = run(capsys, "plan", "Qwen3-8B", "--gpu-memory", "24GiB")
    assert "of 24.00 GiB per device" in out and "(GiB)" in out
    _, out, _ = run(capsys, "plan", "Qwen3-8B", "--gpu-memory", "24GB")
    assert "of 24.00 GB per device" in out and "(GB)" in out


def test_plan_suggests_what_would_fit(capsys) -> None:
    _, out, _ = run(capsys, "plan", "Qwen3-32B", "--gpu-memory", "24GiB")
    match = re.search(r"--quantization w4a16 stores the weights in about ([\d.]+) GiB per device "
                      r"instead of ([\d.]+) GiB, leaving ([\d,]+) tokens", out)
    assert match and float(match[1]) < 24 < float(match[2])
    assert "-tp 2" in out
    _, out, _ = run(capsys, "plan", "Qwen3-8B", "--gpu-memory", "24GB", "--max-model-len", "131072")
    assert re.search(r"suggestion: --max-model-len \d+ \(what the KV cache holds\).*int8", out)
    # 4-bit weights, the KV short of one sequence: the 4-bit LM head's bytes go to the KV cache
    args = ("plan", "Qwen3-32B", "--gpu-memory", "24GiB", "--max-model-len", "131072", "--quantization",
            "w4a16", "--kv-cache-dtype", "int8", "--max-num-seqs", "8")
    _, out, _ = run(capsys, *args)
    held = int(re.search(r"the KV cache holds (\d+) tokens", out)[1])
    match = re.search(r"suggestion: --quantize-lm-head keeps the LM head in 4 bits, ([\d.]+) GiB less per "
                      r"device: ([\d,]+) tokens", out)
    assert match and 0.9 < float(match[1]) < 1.2 and int(match[2].replace(",", "")) > held
    _, out, _ = run(capsys, *args, "--quantize-lm-head")
    assert "--quantize-lm-head" not in out and f"holds {match[2].replace(',', '')} tokens" in out


def test_readme_commands_table_has_no_bare_pipe_in_code() -> None:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `homelab-llm")]
    assert rows
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row.strip().strip("|"))
        assert len(cells) == 2, row  # a | inside a code span must be written \|
