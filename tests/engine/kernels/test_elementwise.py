"""RMSNorm (+ residual), q/k norm, SiLU-and-mul, the sigmoid gate and RoPE kernels against their
torch references."""

from __future__ import annotations

import math

import pytest
import torch

from homelab_llm.engine.kernels import ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _tol(dtype: torch.dtype) -> float:
    # One rounding of the output in the activation dtype (bf16 8 bits, fp16 11 bits).
    return {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype, device: torch.device, full_shapes: bool) -> None:
    from homelab_llm.engine.kernels.elementwise import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(0)
    rows, hidden = (64, 4096) if full_shapes else (5, 96)  # 96: not a power of two
    x = (torch.randn(rows, hidden, generator=gen) * 4).to(device, dtype)
    res = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref.rms_norm_ref(x, w, 1e-6), atol=_tol(dtype), rtol=_tol(dtype))
    got_out, got_sum = add_rms_norm(x, res, w, 1e-5)
    want_out, want_sum = ref.add_rms_norm_ref(x, res, w, 1e-5)
    if device.type == "cuda":
        assert torch.equal(got_sum, want_sum)  # one fp32 add, one rounding: exact
    else:  # the interpreter truncates fp32 -> bf16 instead of rounding to nearest: 1 ulp
        torch.testing.assert_close(got_sum, want_sum, atol=0.0, rtol=2 ** -7)
    torch.testing.assert_close(got_out, want_out, atol=_tol(dtype), rtol=_tol(dtype))
    # Leading dims are kept.
    assert rms_norm(x.view(1, rows, hidden), w, 1e-6).shape == (1, rows, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype, device: torch.device, full_shapes: bool) -> None:
    from homelab_llm.engine.kernels.elementwise import silu_and_mul

    gen = torch.Generator().manual_seed(1)
    rows, d = (32, 14336) if full_shapes else (3, 1100)  # 1100: more than one block, ragged
    gate_up = (torch.randn(rows, 2 * d, generator=gen) * 3).to(device, dtype)
    want = ref.silu_and_mul_ref(gate_up.float()).to(dtype)
    torch.testing.assert_close(silu_and_mul(gate_up), want, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope(scaling: dict | None, dtype: torch.dtype, device: torch.device, full_shapes: bool) -> None:
    from homelab_llm.engine.kernels.elementwise import apply_rope

    gen = torch.Generator().manual_seed(2)
    tokens, hq, hkv, d, rot = (512, 32, 8, 128, 128) if full_shapes else (7, 3, 1, 64, 64)
    cache = ref.rope_cos_sin_cache(ref.rope_inv_freq(rot, 500000.0, scaling), 131072, device)
    positions = torch.randint(0, 131072, (tokens,), generator=gen).to(device)
    q = torch.randn(tokens, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(tokens, hkv, d, generator=gen).to(device, dtype)
    q_ref, k_ref = q.clone(), k.clone()
    ref.apply_rope_ref(q_ref, k_ref, positions, cache)
    apply_rope(q, k, positions, cache)
    torch.testing.assert_close(q, q_ref, atol=_tol(dtype), rtol=_tol(dtype))
    torch.testing.assert_close(k, k_ref, atol=_tol(dtype), rtol=_tol(dtype))


def test_partial_rotary_leaves_tail_alone(device: torch.device) -> None:
    from homelab_llm.engine.kernels.elementwise import apply_rope

    gen = torch.Generator().manual_seed(3)
    cache = ref.rope_cos_sin_cache(ref.rope_inv_freq(32, 10000.0), 64, device)
    q = torch.randn(4, 2, 64, generator=gen).to(device)
    k = torch.randn(4, 2, 64, generator=gen).to(device)
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([0, 1, 17, 63], device=device)
    apply_rope(q, k, positions, cache)
    assert torch.equal(q[..., 32:], q0[..., 32:]) and torch.equal(k[..., 32:], k0[..., 32:])
    assert torch.equal(q[0], q0[0])  # position 0 is the identity rotation
    ref.apply_rope_ref(q0, k0, positions, cache)
    torch.testing.assert_close(q, q0, atol=1e-5, rtol=1e-5)


def test_llama3_inv_freq_bands() -> None:
    """High frequencies untouched, low ones divided by factor, middle band in between."""
    base = ref.rope_inv_freq(128, 500000.0)
    scaled = ref.rope_inv_freq(128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    wavelen = 2 * math.pi / base
    assert torch.equal(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], base[wavelen > 8192] / 8)
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and bool(((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all())


def test_unknown_rope_scaling_is_a_clear_error() -> None:
    from homelab_llm.errors import HomelabError

    with pytest.raises(HomelabError, match="yarn"):
        ref.rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm(dtype: torch.dtype, gated: bool, device: torch.device, full_shapes: bool) -> None:
    """One launch == the two per-head norms and the concatenation, on a projection that also
    carries v columns (which must be left out) and a head_dim that is not a power of two.
    gated: each q head is followed by its output gate (Qwen3.5: q_step = 2 * head_dim), which
    must be skipped, and the weights are float32 (the stored 1 + w)."""
    from homelab_llm.engine.kernels.elementwise import qk_norm

    gen = torch.Generator().manual_seed(1)
    tokens, hq, hk, d = (16, 32, 4, 128) if full_shapes else (3, 4, 2, 48)
    step = 2 * d if gated else d
    qkv = (torch.randn(tokens, hq * step + 2 * hk * d, generator=gen) * 3).to(device, dtype)
    wdt = torch.float32 if gated else dtype
    qw = (1 + 0.2 * torch.randn(d, generator=gen)).to(device, wdt)
    kw = (1 + 0.2 * torch.randn(d, generator=gen)).to(device, wdt)
    got = qk_norm(qkv, hq, hk, d, qw, kw, 1e-6, q_step=step)
    want = ref.qk_norm_ref(qkv, hq, hk, d, qw, kw, 1e-6, q_step=step)
    assert got.shape == (tokens, hq + hk, d)
    # One rounding of the output (the bound of test_rms_norm); q and k weights not swapped.
    torch.testing.assert_close(got, want, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul(dtype: torch.dtype, device: torch.device, full_shapes: bool) -> None:
    """Gated attention's output gate read in place from the q projection (a strided view: every
    head's gate follows its query) == the torch composition (reshape copy, sigmoid, multiply)."""
    from homelab_llm.engine.kernels.elementwise import sigmoid_mul

    gen = torch.Generator().manual_seed(2)
    tokens, h, d = (8, 24, 256) if full_shapes else (3, 4, 40)
    q = (torch.randn(tokens, h * 2 * d + 16, generator=gen) * 3).to(device, dtype)
    gate = q[:, :h * 2 * d].view(tokens, h, 2 * d)[..., d:]
    x = torch.randn(tokens, h * d, generator=gen).to(device, dtype)
    got = sigmoid_mul(x, gate)
    # The reference rounds sigmoid(gate) to the dtype before the product, the kernel does not:
    # two roundings of the output's size at most.
    torch.testing.assert_close(got, ref.sigmoid_mul_ref(x, gate), atol=2 * _tol(dtype), rtol=2 * _tol(dtype))
    with pytest.raises(ValueError, match="sigmoid_mul"):
        sigmoid_mul(x[:, :-1], gate)
