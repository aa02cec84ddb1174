"""The KV split cap on ranks with few KV heads (tuning.kv_split_cap, ArchTiles.kv_split_programs):
at TP 2 the 27B's two KV heads a card make a batch-1 decode call of heads x max_kv_splits = 64
programs, under half of an H100's SMs; the cap can rise so heads x splits reaches the arch's
count. sm_90's and gfx1100's tables set 128 (BENCHMARKS 60.3); KV_SPLIT_PROGRAMS_ENV switches it
for an A/B. Both the eager split choice and the decode graphs' batch-1 count take the cap."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.graph_capture import EagerCapture
from homelab_llm.engine.kernels import tuning
from homelab_llm.engine.kernels.decode_attention import choose_num_splits
from tests.engine.engine_fixtures import tiny_llm

CPU = torch.device("cpu")


@pytest.fixture
def arch(monkeypatch) -> tuning.ArchTiles:
    """This process's table entry with 132 SMs and a cap of 4 (as an H100 with the interpreter's
    cap), switched by each test through kv_split_programs."""
    name = tuning.arch_name(CPU)
    entry = dataclasses.replace(tuning.TABLE[name], num_sms=132, max_kv_splits=4)
    monkeypatch.setitem(tuning.TABLE, name, entry)
    monkeypatch.delenv(tuning.KV_SPLIT_PROGRAMS_ENV, raising=False)
    return entry


def _programs(monkeypatch, arch: tuning.ArchTiles, programs: int) -> None:
    monkeypatch.setitem(tuning.TABLE, tuning.arch_name(CPU), dataclasses.replace(arch, kv_split_programs=programs))


def test_no_count_keeps_the_cap(arch) -> None:
    assert {n for n, t in tuning.TABLE.items() if t.kv_split_programs} == {"sm90", "gfx1100"}
    assert arch.kv_split_programs == 0
    assert [tuning.kv_split_cap(CPU, h) for h in (1, 2, 8)] == [4, 4, 4]
    assert choose_num_splits(1, 2, CPU) == 4


def test_few_heads_raise_the_cap_to_a_power_of_two(arch, monkeypatch) -> None:
    _programs(monkeypatch, arch, 32)
    # 32 programs: 8 heads keep 4 splits; 3 heads 32 // 3 = 10 -> 8; 2 heads 16; 1 head 32
    assert [tuning.kv_split_cap(CPU, h) for h in (8, 4, 3, 2, 1)] == [4, 8, 8, 16, 32]
    # the eager choice wants 2 x 132 programs: 2 heads take the raised cap, 8 heads the old one
    assert choose_num_splits(1, 2, CPU) == 16 and choose_num_splits(1, 8, CPU) == 4
    # a known short length still bounds it: two tiles a split
    assert choose_num_splits(1, 2, CPU, max_seq_len=128) == 128 // (2 * arch.decode.block_n) < 16


def test_the_switch_overrides_the_table(arch, monkeypatch) -> None:
    _programs(monkeypatch, arch, 32)
    monkeypatch.setenv(tuning.KV_SPLIT_PROGRAMS_ENV, "0")
    assert tuning.kv_split_cap(CPU, 2) == 4
    monkeypatch.setenv(tuning.KV_SPLIT_PROGRAMS_ENV, " 128 ")
    assert tuning.kv_split_cap(CPU, 2) == 64
    monkeypatch.setenv(tuning.KV_SPLIT_PROGRAMS_ENV, "lots")
    with pytest.raises(ValueError, match=tuning.KV_SPLIT_PROGRAMS_ENV):
        tuning.kv_split_cap(CPU, 2)


def test_decode_graphs_take_the_cap_of_this_ranks_heads(arch, monkeypatch, tmp_path) -> None:
    """The tiny Llama has 2 KV heads: its batch-1 graphs split 4 ways (the cap) until the count
    raises the cap to 16, which its 512-token context allows (8 pages of 4 tokens a split:
    kv_splits_for)."""
    llm = tiny_llm(tmp_path)
    try:
        runner = llm.engine.runner
        assert runner.graphs is None  # a CPU captures nothing by itself
        runner.install_graphs(llm.engine.max_model_len, EagerCapture())
        assert runner.graphs.num_kv_splits == 4
        _programs(monkeypatch, arch, 32)
        runner.release_graphs()
        runner.install_graphs(llm.engine.max_model_len, EagerCapture())
        assert runner.graphs.num_kv_splits == 16
    finally:
        llm.shutdown()
