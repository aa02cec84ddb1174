"""How the attention kernels read int8 K/V on each arch. First, how they turn it into fp16
(common.kv_for_dots, KV_CVT): the integer form on NVIDIA (the int-to-float unit is quarter rate
there), PTX for a dim-major V tile, and the hardware conversion where ArchTiles.int8_convert_hw
says so (gfx1100, where the integer form's 16-bit adds spilled the int8 prefill: BENCHMARKS
62.2). Every form is exact for all 256 codes, so the kernels' results under the hardware form
meet the same bound as the table's (2e-2 against paged_attention_ref for bf16 q and outputs, as
test_prefill_attention / test_decode_attention). The interpreter's dots take fp32 operands
(common.dot_in_fp32), where no form converts: there the third test checks what the launches are
given, and on a GPU (kernels_selftest.py -k int8_convert) also the kernels that convert. Then
the prefill's K scales read unmasked (PrefillTiles.unmasked_key_scales, gfx1100: 62.3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels import common, tuning
from homelab_llm.engine.kernels.ref import paged_attention_ref


@triton.jit
def _convert_kernel(x_ptr, out_ptr, HW: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, common.int8_to_fp16(tl.load(x_ptr + offs), HW))


@pytest.mark.parametrize("hw", [False, True])
def test_both_conversions_are_exact(hw: bool, device: torch.device) -> None:
    codes = torch.arange(-128, 128, dtype=torch.int8, device=device)
    out = torch.empty(256, dtype=torch.float16, device=device)
    _convert_kernel[(1,)](codes, out, HW=hw)
    assert torch.equal(out, codes.to(torch.float16))


def _args(int8: bool, dim_major: bool) -> common.KVCacheArgs:
    v_dim_stride = 16 if dim_major else 1  # strides[6]: V's dim stride
    strides = (0,) * 6 + (v_dim_stride,) + (0,) * 3
    return common.KVCacheArgs(int8, int8, 7, torch.empty(0), torch.empty(0), strides)


def test_the_arch_table_picks_the_conversion(monkeypatch) -> None:
    for arch, dim_major, want in (("sm90", True, common.CVT_V_PTX), ("sm90", False, common.CVT_INT),
                                  ("sm80", True, common.CVT_V_PTX), ("gfx1100", True, common.CVT_HW),
                                  ("gfx1100", False, common.CVT_HW), ("interpret", True, common.CVT_INT)):
        monkeypatch.setattr(common, "tiles_for", lambda device=None, a=arch: tuning.TABLE[a])
        monkeypatch.setattr(common, "uses_ptx", lambda device=None, a=arch: a.startswith("sm"))
        assert _args(True, dim_major).int8_convert(None) == want.value, (arch, dim_major)
        assert _args(False, dim_major).int8_convert(None) == common.CVT_INT.value  # bf16 KV: unused
    assert tuning.TABLE["gfx1100"].int8_convert_hw
    assert not any(t.int8_convert_hw for name, t in tuning.TABLE.items() if name != "gfx1100")
    rdna = tuning.TABLE["gfx1100"]  # and its prefill reads K's scales unmasked (sm_90 spilled more)
    assert rdna.prefill.unmasked_key_scales and rdna.prefill_wide.unmasked_key_scales
    assert not any(t.prefill.unmasked_key_scales for name, t in tuning.TABLE.items() if name != "gfx1100")


def test_the_hardware_conversion_reaches_the_kernels(monkeypatch, device: torch.device, attention_case) -> None:
    table = tuning.tiles_for(device)
    monkeypatch.setitem(tuning.TABLE, table.name, dataclasses.replace(table, int8_convert_hw=True))
    asked = []
    form = common.KVCacheArgs.int8_convert
    monkeypatch.setattr(common.KVCacheArgs, "int8_convert",
                        lambda self, dev: asked.append(form(self, dev)) or asked[-1])
    case = attention_case([41, 66], [7, 18], 4, 2, 32, 8, torch.int8, device, torch.Generator().manual_seed(23))
    got1, gotp = case.decode(num_splits=2), case.prefill()
    assert asked and set(asked) == {common.CVT_HW.value}
    case.check(got1, case.want1, "decode")
    case.check(gotp, case.wantp, "prefill")


@pytest.mark.parametrize("unmasked", [False, True])
def test_unmasked_key_scales_never_reach_the_output(unmasked: bool, monkeypatch, device: torch.device,
                                                    paged_kv) -> None:
    """PrefillTiles.unmasked_key_scales (gfx1100: BENCHMARKS 62.3) reads int8 K's scales for
    every key of a tile, past the sequence too: with NaN in every scale no live key owns, the
    prefill (with a sliding window as well) still matches paged_attention_ref on the clean scales
    within 2e-2. The scores past the keys are dropped by a select, never multiplied away."""
    from homelab_llm.engine.kernels import prefill_attention

    tiles = dataclasses.replace(tuning.prefill_tiles(device), unmasked_key_scales=unmasked)
    monkeypatch.setattr(prefill_attention, "prefill_tiles", lambda dev, head_dim=128: tiles)
    gen = torch.Generator().manual_seed(29)
    seq_lens, q_lens, hq, hkv, d, page = [21, 45], [9, 20], 4, 2, 32, 8
    k_cache, v_cache, ks, vs, pages = paged_kv(seq_lens, hkv, d, page, torch.int8, device, gen)
    live = torch.zeros(ks.shape[:2], dtype=torch.bool, device=device)
    for b, n in enumerate(seq_lens):
        for t in range(n):
            live[pages[b, t // page], t % page] = True
    poisoned = torch.where(live[:, :, None], ks, torch.full_like(ks, float("nan")))
    assert poisoned.isnan().any()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    qp = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, torch.bfloat16)
    qsl = torch.tensor([0, 9, 29], dtype=torch.int32, device=device)
    for window in (0, 12):
        got = prefill_attention.paged_prefill_attention(qp, k_cache, v_cache, pages, qsl, sl, d ** -0.5,
                                                        poisoned, vs, window=window)
        want = paged_attention_ref(qp.float(), k_cache, v_cache, pages, qsl, sl, d ** -0.5, ks, vs,
                                   window=window)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{window=}: {m}")
