"""int8 KV cache (per-token-per-head scales) against a bf16 KV cache on the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from homelab_llm.engine.kernels import ref
from homelab_llm.engine.llm import LLM
from homelab_llm.engine.sampling_params import SamplingParams
from tests.engine.engine_fixtures import tiny_llm

PROMPTS = [
    "1, 2, 3, 4, 5, 6,",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]


def test_int8_holds_more_tokens_per_byte(tmp_path: Path) -> None:
    budget = 1 << 20
    caps = {}
    for dtype in ("auto", "bf16", "int8"):
        llm = tiny_llm(tmp_path, kv_cache_dtype=dtype, kv_cache_memory_bytes=budget)
        caps[dtype] = llm.engine.status()["kv"]["tokens_capacity"]
    # head_dim 16: bf16 = 32 B per token-head; int8 = 16 B + a 2 B scale -> 1.78x; per page the
    # pool rounds down, so compare the per-token byte ratio exactly and capacities loosely.
    assert caps["int8"] >= 1.7 * caps["bf16"]
    assert caps["int8"] >= 3.4 * caps["auto"]  # auto = fp32 on the CPU


def test_rotated_quantization_round_trips_and_tames_outlier_channels() -> None:
    """quantize_kv / dequantize_kv: each element back within one int8 step of its row (the
    inverse rotation averages the rotated rows' half-step errors), and on rows with a few
    RoPE-like outlier channels the Hadamard rotation cuts the error well below plain per-row
    int8 (measured 2.6x, 4.6x, 6.1x lower rms at head_dim 16, 64, 128; asserted 2x)."""
    gen = torch.Generator().manual_seed(0)
    for d in (16, 64, 128):
        x = torch.randn(200, 3, d, generator=gen)
        x[..., :2] *= 40.0  # outlier channels
        q, s = ref.quantize_kv(x)
        assert q.dtype == torch.int8 and s.dtype == ref.INT8_SCALE_DTYPE and s.shape == x.shape[:-1]
        back = ref.dequantize_kv(q, s, torch.float32)
        assert ((back - x).abs() <= s.float().unsqueeze(-1)).all()
        plain = ref.dequantize_per_token_head(*ref.quantize_per_token_head(x), torch.float32)
        err_rot, err_plain = (back - x).pow(2).mean().sqrt(), (plain - x).pow(2).mean().sqrt()
        assert err_rot < 0.5 * err_plain, (d, float(err_rot), float(err_plain))


def test_head_dim_not_a_power_of_two_is_stored_unrotated() -> None:
    x = torch.randn(5, 2, 48, generator=torch.Generator().manual_seed(1))
    assert ref.kv_rotation(48, x.device) is None
    q, s = ref.quantize_kv(x)
    q0, s0 = ref.quantize_per_token_head(x)
    assert torch.equal(q, q0) and torch.equal(s, s0)
    torch.testing.assert_close(ref.dequantize_kv(q, s, torch.float32),
                               ref.dequantize_per_token_head(q, s, torch.float32))


@pytest.mark.slow
def test_int8_keeps_greedy_text_and_top1_logprobs(smollm2_path: Path) -> None:
    """Issue #4's bar, strictly: same greedy tokens and every top-1 logprob within 0.05 of the
    bf16-KV run (measured with Hadamard-rotated int8 rows: max 0.029, median 0.004 over 60
    positions; plain per-row int8 was max 0.128). The one escape: a continuation may part where
    the bf16 run had a top-2 gap under 0.1 nats, the most two logprobs each off by 0.05 can swap;
    an fp32 KV cache parts from bf16 at such a tie (0.005 nats) too. It happens on some CPUs (an
    AVX-512 EPYC with one thread: the fourth prompt at its sixth token, a 0.0006-nat gap), so one
    prompt may part; the other four must match all 12 tokens."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    results = {}
    for dtype in ("bf16", "int8"):
        # The exact model (--dtype float32): only the KV cache differs between the two runs.
        llm = LLM(str(smollm2_path), device="cpu", dtype="float32", kv_cache_dtype=dtype,
                  kv_cache_memory_bytes=64 << 20, max_model_len=512)
        results[dtype] = llm.generate(PROMPTS, params)
        if dtype == "int8":
            kv = llm.engine.status()["kv"]
            assert kv["dtype"] == "int8"
            # head_dim 64: 128 B (bf16) vs 64 + 2 B per token-head -> 1.94x per byte
            assert 128 / (kv["bytes_per_token"] / (2 * 30 * 3)) >= 1.9
    diffs: list[float] = []
    parted = 0
    for ref_out, got in zip(results["bf16"], results["int8"]):
        for a, b in zip(ref_out.logprobs, got.logprobs):
            if a.token_id != b.token_id:
                gap = a.top[0][1] - a.top[1][1]
                assert gap < 0.1, f"int8 changed a confident token ({gap:.3f} nats): {ref_out.text!r}"
                parted += 1
                break
            diffs.append(abs(a.logprob - b.logprob))
    assert parted <= 1 and len(diffs) >= (len(PROMPTS) - 1) * params.max_tokens, (parted, len(diffs))
    assert max(diffs) <= 0.05, sorted(diffs)[-5:]
