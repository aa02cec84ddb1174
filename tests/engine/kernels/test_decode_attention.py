"""Split-KV paged decode attention against paged_attention_ref."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.ref import paged_attention_ref

KV_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def _shapes(full: bool) -> list[tuple[list[int], int, int, int, int]]:
    # (seq_lens, q_heads, kv_heads, head_dim, page_size)
    if full:
        return [([512], 32, 8, 128, 16), ([1, 17, 4096, 16384, 300], 32, 8, 128, 16),
                ([2048] * 32, 32, 8, 128, 64), ([33, 1000], 28, 4, 128, 1)]
    # head_dim 48: int8 rows stored unrotated (ref.kv_rotation is None)
    return [([1, 7, 40], 4, 2, 32, 4), ([70], 6, 2, 32, 16), ([5, 33], 3, 3, 32, 8), ([9, 3], 2, 1, 48, 4)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_matches_reference(kv_dtype: torch.dtype, device: torch.device, full_shapes: bool,
                                  paged_kv) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    q_dtype = torch.float32 if kv_dtype == torch.float32 else torch.bfloat16
    if kv_dtype == torch.float16:
        q_dtype = torch.float16
    for seq_lens, hq, hkv, d, page_size in _shapes(full_shapes):
        k_cache, v_cache, ks, vs, page_table = paged_kv(seq_lens, hkv, d, page_size, kv_dtype, device, gen)
        batch = len(seq_lens)
        q = torch.randn(batch, hq, d, generator=gen).to(device, q_dtype)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        scale = d ** -0.5
        want = paged_attention_ref(q.float(), k_cache if kv_dtype == torch.int8 else k_cache.float(),
                                   v_cache if kv_dtype == torch.int8 else v_cache.float(),
                                   page_table, qsl, sl, scale, ks, vs)
        for splits in (None, 1, 4):
            got = paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, scale, ks, vs,
                                         num_splits=splits)
            # bf16 inputs/outputs: 2e-2 absolute on unit-variance values; fp32 (tf32 dot on GPU): 5e-3.
            tol = 5e-3 if q_dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol,
                                       msg=lambda m: f"{seq_lens=} {hq=} {hkv=} {splits=}: {m}")


@pytest.mark.parametrize("splits", [1, 2])
def test_empty_padded_sequence_gives_zeros(splits: int, device: torch.device, paged_kv) -> None:
    """A CUDA-graph padding row (seq_len 0) must come out as zeros, not NaN."""
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, _, _, page_table = paged_kv([9, 1], 2, 32, 4, torch.float32, device, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(device)
    qsl = torch.arange(3, dtype=torch.int32, device=device)
    sl = torch.tensor([9, 0], dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2, num_splits=splits)
    assert torch.isfinite(out).all()
    assert out[1].abs().max().item() == 0.0


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_in_the_merge(splits: int, dtype: torch.dtype, device: torch.device, paged_kv) -> None:
    """gate (gated attention, a strided view of the q projection): the output times
    sigmoid(gate) == the ungated kernel then ref.sigmoid_mul_ref; in the merge kernel with
    splits, by elementwise.sigmoid_mul without. Bound: fp32 1e-5 (same math); bf16 2 roundings
    of the output (the reference rounds the ungated output first), 2 x 2^-7 relative."""
    from homelab_llm.engine.kernels import ref
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 4, 2, 32
    k_cache, v_cache, _, _, page_table = paged_kv([9, 5, 14], hkv, d, 4, dtype, device, gen)
    q = torch.randn(3, hq, d, generator=gen).to(device, dtype)
    proj = (torch.randn(3, hq * 2 * d, generator=gen) * 3).to(device, dtype)
    gate = proj.view(3, hq, 2 * d)[..., d:]
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    sl = torch.tensor([9, 5, 14], dtype=torch.int32, device=device)
    plain = paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2, num_splits=splits)
    got = paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2, num_splits=splits,
                                 gate=gate)
    want = ref.sigmoid_mul_ref(plain.reshape(3, -1).float(), gate.float()).view(got.shape)
    tol = 1e-5 if dtype == torch.float32 else 2 * 2 ** -7
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="gate"):
        paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2, gate=gate[:2])


def test_int8_without_scales_is_rejected(device: torch.device, paged_kv) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, _, _, page_table = paged_kv([4], 1, 32, 4, torch.int8, device, gen)
    q = torch.randn(1, 1, 32, generator=gen).to(device)
    qsl = torch.arange(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, k_cache, v_cache, page_table, qsl, qsl[1:], 0.2)


def test_short_context_uses_one_split_long_context_many(device: torch.device) -> None:
    """Batch 1 at 40 tokens: one split (one kernel, no merge); at 32K: enough splits to fill the GPU."""
    from homelab_llm.engine.kernels.decode_attention import choose_num_splits
    from homelab_llm.engine.kernels.tuning import tiles_for

    assert choose_num_splits(1, 8, device, max_seq_len=40) == 1
    assert choose_num_splits(1, 1, device, max_seq_len=32768) == tiles_for(device).max_kv_splits


def test_graph_splits_shrink_with_the_batch() -> None:
    """Decode graphs: the batch-1 split count (capped by the arch table and by the model length),
    shared out over the batch, never below 8 (or the batch-1 count), always a power of two."""
    from homelab_llm.engine.cuda_graphs import kv_splits_at, kv_splits_for

    assert kv_splits_for(32768, 16, 64) == 64 and kv_splits_for(2048, 16, 64) == 16
    assert [kv_splits_at(64, bs) for bs in (1, 2, 3, 4, 8, 16, 256)] == [64, 32, 16, 16, 8, 8, 8]
    assert kv_splits_at(4, 1) == 4 and kv_splits_at(4, 64) == 4 and kv_splits_at(1, 8) == 1


def test_graph_splits_by_programs_per_sm(monkeypatch) -> None:
    """Where the arch table sets kv_programs_per_sm (sm_90: 2), batches past 1 take about that
    many programs an SM: 8 KV heads on 132 SMs want 33 programs a row, so batch 8 runs 4 splits,
    batch 32 one (BENCHMARKS 18.3); batch 1 keeps its count; 4 KV heads get twice the splits."""
    import dataclasses

    from homelab_llm.engine.cuda_graphs import kv_row_programs, kv_splits_at
    from homelab_llm.engine.kernels import tuning

    assert [kv_splits_at(32, bs, 33) for bs in (1, 2, 4, 8, 16, 32, 64)] == [32, 16, 8, 4, 2, 1, 1]
    assert [kv_splits_at(32, bs, 66) for bs in (1, 2, 4, 8, 16, 32)] == [32, 32, 16, 8, 4, 2]
    assert kv_splits_at(4, 2, 33) == 4  # never above the batch-1 count
    cpu = torch.device("cpu")
    assert kv_row_programs(cpu, 8) == 0  # the interpreter's table sets none: the share rule
    arch = tuning.arch_name(cpu)
    monkeypatch.setitem(tuning.TABLE, arch, dataclasses.replace(tuning.TABLE[arch],
                                                                kv_programs_per_sm=2))
    assert kv_row_programs(cpu, 8) == 2 * tuning.device_sms(cpu) // 8
    assert tuning.TABLE["sm90"].kv_programs_per_sm == 2


def test_many_splits_on_a_short_context(device: torch.device, paged_kv) -> None:
    """A graph's fixed split count far above what a short context needs: the empty splits only
    write a -inf lse, and the merge must skip their (never written) partial rows."""
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(3)
    for kv_dtype in (torch.bfloat16, torch.int8):
        k_cache, v_cache, ks, vs, page_table = paged_kv([3, 40], 2, 32, 4, kv_dtype, device, gen)
        q = torch.randn(2, 4, 32, generator=gen).to(device, torch.bfloat16)
        qsl = torch.arange(3, dtype=torch.int32, device=device)
        sl = torch.tensor([3, 40], dtype=torch.int32, device=device)
        kc = k_cache if kv_dtype == torch.int8 else k_cache.float()
        vc = v_cache if kv_dtype == torch.int8 else v_cache.float()
        want = paged_attention_ref(q.float(), kc, vc, page_table, qsl, sl, 0.2, ks, vs)
        got = paged_decode_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.2, ks, vs, num_splits=16)
        # bf16 q/out on unit-variance values: 2e-2 absolute, as in test_decode_matches_reference.
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
