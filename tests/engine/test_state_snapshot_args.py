"""--max-state-snapshots / --state-snapshot-memory-bytes: parsing and validation (engine/args.py)."""

from __future__ import annotations

import argparse

import pytest

from homelab_llm.engine.args import EngineArgs, EngineArgsError


def _parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli(parser.parse_args(list(argv)))


def test_defaults_leave_the_pool_size_to_the_model() -> None:
    args = _parse()
    assert args.max_state_snapshots is None and args.state_snapshot_memory_bytes is None


def test_flags_parse_a_count_and_a_byte_budget() -> None:
    assert _parse("--max-state-snapshots", "0").max_state_snapshots == 0
    assert _parse("--max-state-snapshots", "32").max_state_snapshots == 32
    assert _parse("--state-snapshot-memory-bytes", "2GiB").state_snapshot_memory_bytes == 2 << 30


@pytest.mark.parametrize("argv, needle", [
    (("--max-state-snapshots", "-1"), "--max-state-snapshots must be >= 0"),
    (("--state-snapshot-memory-bytes", "-5"), "--state-snapshot-memory-bytes must be >= 0"),
    (("--max-state-snapshots", "4", "--state-snapshot-memory-bytes", "1GiB"), "give only one"),
])
def test_bad_values_name_the_flag(argv: tuple[str, ...], needle: str) -> None:
    with pytest.raises(EngineArgsError, match=needle):
        _parse(*argv)
