"""HOMELAB_LLM_DECODE_TILES / HOMELAB_LLM_PREFILL_TILES: A/B runs of the attention kernels' tiles
without a patched tree (gfx1100's were chosen by register counts alone, BENCHMARKS 57.1, so an
RDNA3 owner times them against the old ones this way). The switch must reach the launches: the
kernels run with the changed tiles and still match paged_attention_ref (bounds as in
test_decode_attention / test_prefill_attention: 2e-2 for bf16 inputs and outputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels import tuning
from homelab_llm.engine.kernels.ref import paged_attention_ref


def test_switches_change_this_devices_tiles(monkeypatch) -> None:
    cpu = torch.device("cpu")
    table = tuning.tiles_for(cpu)
    monkeypatch.setenv(tuning.DECODE_TILES_ENV, "block_n=32, num_warps=2, int8_dot=1")
    for int8 in (False, True):
        base = table.decode_int8 if int8 and table.decode_int8 is not None else table.decode
        assert tuning.decode_tiles(cpu, int8) == dataclasses.replace(base, block_n=32, num_warps=2, int8_dot=True)
    assert tuning.prefill_tiles(cpu) == table.prefill
    monkeypatch.setenv(tuning.PREFILL_TILES_ENV, "block_m=32,num_warps=2")
    assert tuning.prefill_tiles(cpu) == dataclasses.replace(table.prefill, block_m=32, num_warps=2)
    for env, bad, named in ((tuning.DECODE_TILES_ENV, "block=32", "block_n"),
                            (tuning.PREFILL_TILES_ENV, "block_m=big", "block_m")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=named):
            tuning.decode_tiles(cpu, False) if env == tuning.DECODE_TILES_ENV else tuning.prefill_tiles(cpu)


def test_gfx1100_attention_tiles() -> None:
    """The RDNA3 entries BENCHMARKS 57.1 chose: 16-token tiles on 8 waves, int8 score dots for
    int8 KV, the Gated DeltaNet prep on 16 waves (the compile check builds every scenario with
    them; `gpu_compile --targets gfx1100 --regs --all` reports their spills)."""
    t = tuning.TABLE["gfx1100"]
    assert (t.decode.block_n, t.decode.num_warps) == (16, 8)
    assert t.decode_int8 is not None and t.decode_int8.int8_dot and t.decode_int8.num_warps == 8
    assert (t.prefill.block_n, t.prefill.num_warps) == (16, 8)
    assert tuning.GDN_TABLE["gfx1100"].chunk_warps == 16
    assert tuning.GDN_TABLE["gfx1100"].state_warps == 8  # the state walk's spill-free waves (BENCHMARKS 63.5)


def test_wide_heads_take_the_wide_prefill_tiles(monkeypatch) -> None:
    """Heads past 128 (the 27B's 256) take ArchTiles.prefill_wide where an arch has it (gfx1100,
    BENCHMARKS 57.2; sm_80's one stage), the switch applying over it; else `prefill` (sm_90:
    57.6). Every entry's shared memory at head_dim 256 is the compile check's to verify."""
    rdna = tuning.TABLE["gfx1100"]
    monkeypatch.setattr(tuning, "tiles_for", lambda device=None: rdna)
    assert tuning.prefill_tiles(None, 128) == rdna.prefill
    assert tuning.prefill_tiles(None, 256) == rdna.prefill_wide != rdna.prefill
    monkeypatch.setenv(tuning.PREFILL_TILES_ENV, "block_m=64")
    assert tuning.prefill_tiles(None, 256) == dataclasses.replace(rdna.prefill_wide, block_m=64)
    monkeypatch.setattr(tuning, "tiles_for", lambda device=None: tuning.TABLE["sm90"])
    monkeypatch.delenv(tuning.PREFILL_TILES_ENV)
    assert tuning.prefill_tiles(None, 256) == tuning.TABLE["sm90"].prefill  # none: timed slower there


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_switched_tiles_reach_the_kernels(kv_dtype, monkeypatch, device: torch.device, attention_case) -> None:
    from homelab_llm.engine.kernels import decode_attention, prefill_attention

    case = attention_case([37, 70], [5, 19], 4, 2, 32, 8, kv_dtype, device, torch.Generator().manual_seed(11))
    seen = []  # the tiles each launch took, through spies on the kernels' own lookups

    def spy(lookup):
        return lambda *args: seen.append(lookup(*args)) or seen[-1]

    # (module, name) form: kernels_selftest's stand-in for the fixture takes only that one
    monkeypatch.setattr(decode_attention, "decode_tiles", spy(tuning.decode_tiles))
    monkeypatch.setattr(prefill_attention, "prefill_tiles", spy(tuning.prefill_tiles))
    for spec in ("", "block_n=32,num_warps=2,int8_dot=1"):
        monkeypatch.setenv(tuning.DECODE_TILES_ENV, spec)
        monkeypatch.setenv(tuning.PREFILL_TILES_ENV, spec.replace(",int8_dot=1", ""))
        case.check(case.decode(num_splits=2), case.want1, f"{spec=}")
        case.check(case.prefill(), case.wantp, f"{spec=}")
    decode, prefill = seen[-2:]
    assert (decode.block_n, decode.num_warps, decode.int8_dot) == (32, 2, True)
    assert (prefill.block_n, prefill.num_warps) == (32, 2)


def test_wide_int8_heads_take_the_wide_decode_tiles_from_two_sequences(monkeypatch) -> None:
    """sm_90's wide-head int8 decode tiles (BENCHMARKS 58.3): head_dim 256 from 2 sequences a
    call; one sequence, head_dim 128 and bf16 KV keep their tiles; the switch applies over them;
    an arch without them (gfx1100) keeps its tiles everywhere."""
    sm90 = tuning.TABLE["sm90"]
    monkeypatch.setattr(tuning, "tiles_for", lambda device=None: sm90)
    int8 = sm90.decode_int8_wide
    assert int8 is not None and int8.min_sequences == 2 and int8.tiles.block_n * 256 == sm90.decode_int8.block_n * 128
    assert tuning.decode_tiles(None, True, 256, 2) == int8.tiles
    assert tuning.decode_tiles(None, True, 256, 1) == sm90.decode_int8
    assert tuning.decode_tiles(None, True, 128, 8) == sm90.decode_int8
    assert tuning.decode_tiles(None, False, 256, 8) == sm90.decode
    monkeypatch.setenv(tuning.DECODE_TILES_ENV, "num_stages=3")
    assert tuning.decode_tiles(None, True, 256, 8) == dataclasses.replace(int8.tiles, num_stages=3)
    monkeypatch.delenv(tuning.DECODE_TILES_ENV)
    rdna = tuning.TABLE["gfx1100"]
    monkeypatch.setattr(tuning, "tiles_for", lambda device=None: rdna)
    assert tuning.decode_tiles(None, True, 256, 8) == rdna.decode_int8
    assert tuning.decode_tiles(None, False, 256, 8) == rdna.decode


def test_the_decode_kernel_asks_by_head_size_and_sequences(monkeypatch, device: torch.device, paged_kv) -> None:
    """paged_decode_attention looks its tiles up with the call's head size and sequence count,
    and the wide tiles' output matches the reference (int8 KV, head_dim 256; bound 2e-2 as
    above)."""
    from homelab_llm.engine.kernels import decode_attention
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(12)
    seq_lens, hq, hkv, d, page = [21, 9], 2, 1, 256, 8
    k_cache, v_cache, ks, vs, table = paged_kv(seq_lens, hkv, d, page, torch.int8, device, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(2, hq, d, generator=gen).to(device, torch.bfloat16)
    qsl = torch.arange(3, dtype=torch.int32, device=device)
    want = paged_attention_ref(q.float(), k_cache, v_cache, table, qsl, sl, d ** -0.5, ks, vs)
    asked = []
    wide = tuning.AttentionTiles(block_n=16, num_warps=1, num_stages=1, int8_dot=True)

    def lookup(dev, int8, head_dim=128, sequences=1):
        asked.append((int8, head_dim, sequences))
        return wide if int8 and head_dim > 128 and sequences > 1 else tuning.decode_tiles(dev, int8)

    monkeypatch.setattr(decode_attention, "decode_tiles", lookup)
    got = paged_decode_attention(q, k_cache, v_cache, table, qsl, sl, d ** -0.5, ks, vs, num_splits=2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    one = paged_decode_attention(q[:1], k_cache, v_cache, table, qsl[:2], sl[:1], d ** -0.5, ks, vs, num_splits=2)
    torch.testing.assert_close(one.float(), want[:1], atol=2e-2, rtol=2e-2)
    # a verify group (2 rows of one sequence sharing its pages) asks as one sequence: the wide
    # tiles were timed on one-token rows only
    group_table, group_lens = table[:1].repeat(2, 1), sl.new_tensor([20, 21])
    rows2 = paged_decode_attention(q, k_cache, v_cache, group_table, qsl, group_lens, d ** -0.5, ks, vs,
                                   num_splits=2, rows_per_seq=2)
    want2 = paged_attention_ref(q.float(), k_cache, v_cache, group_table, qsl, group_lens, d ** -0.5, ks, vs)
    torch.testing.assert_close(rows2.float(), want2, atol=2e-2, rtol=2e-2)
    assert asked == [(True, 256, 2), (True, 256, 1), (True, 256, 1)]
