"""q re-derived in every KV tile (AttentionTiles / PrefillTiles tile_q_from, the kernels' TILE_Q,
common.per_tile): gfx1100 at head_dim 256, where q held in WMMA's operand layout through the loop
spilled the decode kernel (bf16 65-67 VGPRs a lane, int8 44-47) and the bf16 prefill (83);
BENCHMARKS 63. The select per_tile adds must keep q in every tile, so the kernels with it on meet
the reference as without it (bound 2e-2 for bf16 q and outputs, as test_decode_attention /
test_prefill_attention); a select that dropped q in any tile fails them. The interpreter's
table is switched to take it at head_dim 32, and a spy checks the launches did."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from homelab_llm.engine.kernels import tuning


def test_gfx1100_takes_it_at_head_dim_256_only() -> None:
    rdna = tuning.TABLE["gfx1100"]
    for tiles in (rdna.decode, rdna.decode_int8, rdna.prefill_wide):
        assert tiles is not None and tiles.tile_q_from == 256
        assert tuning.q_each_tile(tiles, 256, False) and not tuning.q_each_tile(tiles, 128, False)
    assert tuning.q_each_tile(rdna.decode_int8, 256, True)
    # the prefill for bf16 KV only (int8's spilled more with it); head_dim 128's tiles never
    assert not tuning.q_each_tile(rdna.prefill_wide, 256, True)
    assert not tuning.q_each_tile(rdna.prefill, 256, False)
    # the NVIDIA entries were timed without it; none of them spilled for want of it
    for name, t in tuning.TABLE.items():
        if name != "gfx1100":
            entries = (t.decode, t.decode_int8, t.prefill, t.prefill_wide,
                       t.decode_int8_wide.tiles if t.decode_int8_wide else None)
            assert all(e is None or e.tile_q_from == 0 for e in entries), name


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_kernels_with_q_each_tile_match_the_reference(kv_dtype, monkeypatch, device: torch.device,
                                                      attention_case) -> None:
    from homelab_llm.engine.kernels import decode_attention, prefill_attention

    d = 32
    table = tuning.tiles_for(device)
    decode = dataclasses.replace(table.decode, tile_q_from=d)
    monkeypatch.setitem(tuning.TABLE, table.name, dataclasses.replace(
        table, decode=decode, decode_int8=dataclasses.replace(decode, int8_dot=True),
        prefill=dataclasses.replace(table.prefill, tile_q_from=d), prefill_wide=None))
    asked = []  # (head_dim, int8 KV, the answer) a launch, by spies on the kernels' own lookups

    def spy(tiles, head_dim, int8_kv):
        asked.append((head_dim, int8_kv, tuning.q_each_tile(tiles, head_dim, int8_kv)))
        return asked[-1][2]

    monkeypatch.setattr(decode_attention, "q_each_tile", spy)
    monkeypatch.setattr(prefill_attention, "q_each_tile", spy)
    case = attention_case([45, 70], [6, 21], 4, 2, d, 8, kv_dtype, device, torch.Generator().manual_seed(29))
    int8_dots = (False, True) if kv_dtype == torch.int8 else (False,)
    for int8_dot in int8_dots:  # int8 KV's q as int8 halves (INT8_DOT) and as fp16
        monkeypatch.setenv(tuning.DECODE_TILES_ENV, f"int8_dot={int(int8_dot)}")
        for splits in (1, 4):
            case.check(case.decode(num_splits=splits), case.want1, f"{int8_dot=} {splits=}")
    # a verify group: two rows of the second sequence over its page table, seeing 69 and 70 keys
    group_pages, group_lens = case.pages[1:].repeat(2, 1), case.seq_lens.new_tensor([69, 70])
    qg, qslg = case.q1[:2].clone(), torch.arange(3, dtype=torch.int32, device=device)
    gotg = paged_group(case, qg, qslg, group_pages, group_lens)
    case.check(gotg, case.reference(qg, qslg, group_pages, group_lens), "verify group")
    case.check(case.prefill(), case.wantp, "prefill")
    # every decode launch took it, and the prefill for bf16 KV only
    int8 = kv_dtype == torch.int8
    assert asked == [(d, int8, True)] * (2 * len(int8_dots) + 1) + [(d, int8, not int8)]


def paged_group(case, q, query_start_loc, pages, seq_lens) -> torch.Tensor:
    """The decode kernel on one verify group of q's rows (rows_per_seq = its row count)."""
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    return paged_decode_attention(q, case.k_cache, case.v_cache, pages, query_start_loc, seq_lens, case.scale,
                                  case.k_scale, case.v_scale, num_splits=2, rows_per_seq=q.shape[0])
